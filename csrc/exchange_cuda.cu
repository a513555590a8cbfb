// Signalling primitive, CUDA: peer all-gather through a data-as-flag
// workspace. Every word of x travels tagged with the call (dataflag.h), so the
// consumer polls its local buffer and no flag, fence or acknowledgement is
// needed; the grid is sized to the words.

#include "exchange.h"
#include "dataflag.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 256;

template <bool kAligned>
__device__ __forceinline__ uint32_t load_word(const uint8_t* x, int64_t nbytes, int64_t w) {
  if (kAligned) return reinterpret_cast<const uint32_t*>(x)[w];
  uint32_t v = 0;
  for (int b = 0; b < 4 && 4 * w + b < nbytes; ++b) v |= static_cast<uint32_t>(x[4 * w + b]) << (8 * b);
  return v;
}

template <bool kAligned>
__device__ __forceinline__ void store_word(uint8_t* out, int64_t nbytes, int64_t w, uint32_t v) {
  if (kAligned) {
    reinterpret_cast<uint32_t*>(out)[w] = v;
    return;
  }
  for (int b = 0; b < 4 && 4 * w + b < nbytes; ++b) out[4 * w + b] = static_cast<uint8_t>(v >> (8 * b));
}

// Thread j stores word j of x, tagged with the call, into every peer's
// buffer and its own output row, then polls word j of every peer's entry.
// Block 0's last warp also stores this rank's call header for every peer
// (lane d for peer d) before any data, and checks every peer's header before
// it polls data: for small exchanges that warp holds no words, so the check
// runs beside the other warps' polls.
// The workspace is a grid constant (no per-thread local copy for the failure
// paths, which take its address). Compiled per case, because at a few bytes
// the call is one warp's chain of dependent steps and every instruction on it
// counts: kAligned (x, out and nbytes 4-byte aligned: one 32-bit access per
// word, no byte path) and kOneWord (every thread has at most one word: no
// loop over words).
template <bool kAligned, bool kOneWord>
__global__ void __launch_bounds__(kThreads)
    peer_all_gather_kernel(const __grid_constant__ DeviceWorkspace ws, const uint8_t* x, uint8_t* out, int64_t nbytes,
                           int64_t source_bytes, int64_t header_offset, const __grid_constant__ CallHeader hdr) {
  // This thread's first word is loaded before the call index, so that the two
  // loads are in flight together (x is the previous kernel's output: after
  // the programmatic wait).
  pdl_wait_and_release();
  const int64_t words = (nbytes + 3) / 4;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const uint32_t first_word = first < words ? load_word<kAligned>(x, nbytes, first) : 0;
  const uint64_t call = block_call_index(ws);
  const uint64_t tag = static_cast<uint64_t>(call_tag(call)) << 32;
  const int n = ws.world, me = ws.rank;
  auto entry = [&](int dst, int src) {
    return reinterpret_cast<uint64_t*>(ws.buffer(dst, call) + ws.peer_slot(src, dst) * source_bytes);
  };
  auto header = [&](int dst, int src) {
    return reinterpret_cast<uint64_t*>(ws.buffer(dst, call) + header_offset) + ws.peer_slot(src, dst) * kHeaderFields;
  };
  const int peer = threadIdx.x & 31;
  const bool header_lane = blockIdx.x == 0 && threadIdx.x / 32 == blockDim.x / 32 - 1 && peer < n && peer != me;
  if (header_lane) store_call_header_tagged(header(peer, me), tag, hdr);
  auto push = [&](int64_t w, uint32_t v) {
    for (int d = 0; d < n; ++d)
      if (d != me) st_volatile_u64(entry(d, me) + w, tag | v);
    store_word<kAligned>(out + me * nbytes, nbytes, w, v);
  };
  auto gather = [&](int64_t w) {
    for (int s = 0; s < n; ++s)
      if (s != me)
        store_word<kAligned>(out + s * nbytes, nbytes, w, poll_tagged(ws, entry(me, s) + w, tag >> 32, s, call));
  };
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (kOneWord) {
    if (first < words) push(first, first_word);
  } else {
    for (int64_t w = first; w < words; w += step) push(w, w == first ? first_word : load_word<kAligned>(x, nbytes, w));
  }
  if (header_lane) check_call_header_tagged(ws, header(me, peer), tag >> 32, hdr, peer, call);
  if (kOneWord) {
    if (first < words) gather(first);
  } else {
    for (int64_t w = first; w < words; w += step) gather(w);
  }
  block_finish_call(ws, call);
}

void all_gather_cuda(const AllGatherCall& c, const at::Tensor& x) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);  // the header lanes are one warp
  const c10::cuda::CUDAGuard guard(x.device());
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(c.out.data_ptr());
  const bool aligned = c.nbytes % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % 4 == 0;
  const int64_t words = (c.nbytes + 3) / 4;
  const int grid = dataflag_grid(words, kThreads, x.get_device());
  const bool one_word = words <= static_cast<int64_t>(grid) * kThreads;
  auto launch = [&](auto kernel) {
    launch_dataflag(kernel, grid, kThreads, at::cuda::getCurrentCUDAStream(), x.get_device(), device_workspace(ws),
                   src, dst, c.nbytes, c.geo.source_bytes, c.geo.header_offset, c.header);
  };
  if (aligned) one_word ? launch(peer_all_gather_kernel<true, true>) : launch(peer_all_gather_kernel<true, false>);
  else one_word ? launch(peer_all_gather_kernel<false, true>) : launch(peer_all_gather_kernel<false, false>);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("peer_all_gather", &peer_all_gather_op<all_gather_cuda>);
}

}  // namespace sdcp
