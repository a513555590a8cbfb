// Query boundary, CUDA: the fused RoPE / concatenation / quantisation producer
// and its fan-out. A warp produces one (row, head) item and stores it into
// every consumer's inbox (the same bytes N times), then each block publishes;
// after waiting it copies its chunk of the local inbox into a fresh tensor and
// acknowledges (query_gather), or leaves the inbox to be read in place until
// query_release acknowledges (query_publish). The inbox has one slot: a
// producer stores into it only after every consumer acknowledged the last
// epoch.

#include "device_signal.cuh"
#include "query.h"
#include "semantics.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct ProducerArgs {
  const c10::BFloat16* nope;
  const c10::BFloat16* pe;
  const void* positions;
  const void* cache;
  const float* scale;  // nullptr: 1.0
  int64_t nope_s0, nope_s1, pe_s0, pe_s1, pos_s0;
  int64_t rows, heads, nope_dim, rope_dim, max_pos;
  bool pos64, cache_f32, neox;
  bool vec_nope;  // nope rows are 16-byte aligned and a multiple of 8 elements
};

template <typename out_t>
__device__ __forceinline__ out_t convert_out(float v, float scale) {
  if constexpr (std::is_same<out_t, c10::Float8_e4m3fn>::value) return quantize_e4m3(v, scale);
  else return static_cast<out_t>(v);
}

// Produces item (t, h) into each of `ndst` destinations (dst[k] points at the
// item's first element). Called by a whole warp.
template <typename out_t>
__device__ void produce_item(const ProducerArgs& a, int64_t t, int64_t h, out_t* const* dst, int ndst) {
  const int lane = threadIdx.x & 31;
  const float scale = a.scale ? *a.scale : 1.0f;
  const c10::BFloat16* n = a.nope + t * a.nope_s0 + h * a.nope_s1;
  if (a.vec_nope) {  // 8 elements per lane step: one 16-byte load
    for (int64_t d = lane * 8; d < a.nope_dim; d += 32 * 8) {
      uint4 raw = *reinterpret_cast<const uint4*>(n + d);
      const c10::BFloat16* x = reinterpret_cast<const c10::BFloat16*>(&raw);
      out_t v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = convert_out<out_t>(static_cast<float>(x[e]), scale);
      for (int k = 0; k < ndst; ++k) {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[k][d + e] = v[e];
      }
    }
  } else {
    for (int64_t d = lane; d < a.nope_dim; d += 32) {
      const out_t v = convert_out<out_t>(static_cast<float>(n[d]), scale);
      for (int k = 0; k < ndst; ++k) dst[k][d] = v;
    }
  }
  int64_t pos = a.pos64 ? static_cast<const int64_t*>(a.positions)[t * a.pos_s0]
                        : static_cast<const int32_t*>(a.positions)[t * a.pos_s0];
  if (pos < 0 || pos >= a.max_pos) {
    if (lane == 0) printf("torch_sdcp: positions[%lld] = %lld is outside [0, %lld)\n", (long long)t, (long long)pos,
                          (long long)a.max_pos);
    __trap();
  }
  const int64_t half = a.rope_dim / 2;
  const c10::BFloat16* q = a.pe + t * a.pe_s0 + h * a.pe_s1;
  for (int64_t j = lane; j < half; j += 32) {
    float co, si;
    if (a.cache_f32) {
      const float* c = static_cast<const float*>(a.cache) + pos * a.rope_dim;
      co = c[j];
      si = c[half + j];
    } else {
      const c10::BFloat16* c = static_cast<const c10::BFloat16*>(a.cache) + pos * a.rope_dim;
      co = static_cast<float>(c[j]);
      si = static_cast<float>(c[half + j]);
    }
    const int64_t i0 = a.neox ? j : 2 * j, i1 = a.neox ? j + half : 2 * j + 1;
    const float x0 = static_cast<float>(q[i0]), x1 = static_cast<float>(q[i1]);
    const out_t o0 = convert_out<out_t>(rope_first(x0, x1, co, si), scale);
    const out_t o1 = convert_out<out_t>(rope_second(x0, x1, co, si), scale);
    for (int k = 0; k < ndst; ++k) {
      dst[k][a.nope_dim + i0] = o0;
      dst[k][a.nope_dim + i1] = o1;
    }
  }
}

template <typename out_t>
__global__ void query_rope_quant_kernel(ProducerArgs a, out_t* out) {
  const int64_t items = a.rows * a.heads, width = a.nope_dim + a.rope_dim;
  for (int64_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < items; i += gridDim.x * kWarps) {
    out_t* dst[1] = {out + i * width};
    produce_item<out_t>(a, i / a.heads, i % a.heads, dst, 1);
  }
}

// Bytes of one produced item, staged per warp in shared memory.
constexpr int kMaxItemBytes = 2048;

// kCopyOut: copy the gathered chunk into `out` and acknowledge (query_gather);
// otherwise the inbox stays for a zero-copy reader (query_publish).
template <typename out_t, bool kCopyOut>
__global__ void query_gather_kernel(DeviceWorkspace ws, int64_t inbox_offset, ProducerArgs a, out_t* out) {
  __shared__ __align__(16) uint8_t stage[kWarps][kMaxItemBytes];
  const uint64_t epoch = block_next_epoch(ws);
  const int slot = 0;
  const int n = ws.world, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t hl = a.heads, width = a.nope_dim + a.rope_dim, items = a.rows * hl;
  const int64_t nvec = width * static_cast<int64_t>(sizeof(out_t)) / 16;  // 16-byte vectors per item
  const int64_t per_block = (items + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(items, blockIdx.x * per_block), end = min(items, begin + per_block);
  // Inbox [row][src * hl + h][width] of every rank.
  auto inbox = [&](int d) { return reinterpret_cast<uint4*>(ws.slot_data(d, slot) + inbox_offset); };
  // 1. Produce each item once into shared memory, then store it into every
  //    consumer's inbox as 16-byte vectors. Every consumer must have finished
  //    reading the previous epoch first: the wait overlaps the first item.
  auto produce = [&](int64_t i) {
    out_t* staged = reinterpret_cast<out_t*>(stage[warp]);
    produce_item<out_t>(a, i / hl, i % hl, &staged, 1);
    __syncwarp();
  };
  const int64_t first = begin + warp;
  if (first < end) produce(first);
  block_wait_acks(ws, epoch);
  for (int64_t i = first; i < end; i += kWarps) {
    if (i != first) produce(i);
    const int64_t t = i / hl, h = i % hl;
    const uint4* src = reinterpret_cast<const uint4*>(stage[warp]);
    const int64_t item = (t * n + ws.rank) * hl + h;
    for (int d = 0; d < n; ++d) {
      uint4* dst = inbox(d) + item * nvec;
      for (int64_t v = lane; v < nvec; v += 32) dst[v] = src[v];
    }
    __syncwarp();
  }
  block_publish_all(ws, epoch);
  block_wait_all(ws, epoch);
  // 2. Copy chunk b of every source out of the local inbox, then tell every
  //    producer that this block's part of the inbox is free again.
  if constexpr (kCopyOut) {
    const uint4* local = inbox(ws.rank);
    uint4* o = reinterpret_cast<uint4*>(out);
    const int64_t chunk = end - begin, total = chunk * n * nvec;
    for (int64_t x = threadIdx.x; x < total; x += blockDim.x) {
      const int64_t v = x % nvec, rest = x / nvec, s = rest / chunk, i = begin + rest % chunk;
      const int64_t item = ((i / hl) * n + s) * hl + i % hl;
      o[item * nvec + v] = local[item * nvec + v];
    }
    block_ack_all(ws, epoch);
  }
  block_commit_epoch(ws, epoch);
}

// The zero-copy reader is done with the inbox: acknowledge every block's last
// epoch to every producer.
__global__ void query_release_kernel(DeviceWorkspace ws) {
  const uint64_t epoch = *ws.epoch(blockIdx.x);
  for (int d = threadIdx.x; d < ws.world; d += blockDim.x)
    st_release_sys(ws.flag(d, kAckSet, ws.rank, blockIdx.x), epoch);
}

ProducerArgs producer_args(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                           const at::Tensor& cache, const std::optional<at::Tensor>& q_scale, bool neox,
                           const QueryShape& s) {
  ProducerArgs a;
  a.nope = ql_nope.data_ptr<c10::BFloat16>();
  a.pe = q_pe.data_ptr<c10::BFloat16>();
  a.positions = positions.data_ptr();
  a.cache = cache.data_ptr();
  a.scale = q_scale.has_value() ? q_scale->data_ptr<float>() : nullptr;
  a.nope_s0 = ql_nope.stride(0);
  a.nope_s1 = ql_nope.stride(1);
  a.pe_s0 = q_pe.stride(0);
  a.pe_s1 = q_pe.stride(1);
  a.pos_s0 = positions.stride(0);
  a.rows = s.rows;
  a.heads = s.heads;
  a.nope_dim = s.nope;
  a.rope_dim = s.rope;
  a.max_pos = cache.size(0);
  a.pos64 = positions.scalar_type() == at::kLong;
  a.cache_f32 = cache.scalar_type() == at::kFloat;
  a.neox = neox;
  a.vec_nope = s.nope % 8 == 0 && a.nope_s0 % 8 == 0 && a.nope_s1 % 8 == 0 &&
               reinterpret_cast<uintptr_t>(a.nope) % 16 == 0;
  return a;
}

void rope_quant_cuda(const QueryShape& s, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                  at::ScalarType out_dtype, at::Tensor& out) {
  const int64_t items = s.rows * s.heads;
  const c10::cuda::CUDAGuard guard(ql_nope.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto a = producer_args(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, s);
  const int grid = static_cast<int>(std::min<int64_t>((items + kWarps - 1) / kWarps, 1024));
  if (out_dtype == at::kFloat8_e4m3fn) {
    query_rope_quant_kernel<c10::Float8_e4m3fn>
        <<<grid, kThreads, 0, stream>>>(a, static_cast<c10::Float8_e4m3fn*>(out.data_ptr()));
  } else {
    query_rope_quant_kernel<c10::BFloat16><<<grid, kThreads, 0, stream>>>(a, out.data_ptr<c10::BFloat16>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches the gather kernel; the call has no output for query_publish.
void gather_cuda(const QueryCall& c, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                 at::ScalarType out_dtype) {
  const Workspace& ws = *c.ws;
  const QueryShape& s = c.shape;
  check_device_world(ws);
  const int64_t item_bytes = s.width() * static_cast<int64_t>(c10::elementSize(out_dtype));
  SDCP_CHECK_ARG(item_bytes % 16 == 0 && item_bytes <= kMaxItemBytes, "ql_nope, q_pe",
                 "heads of a multiple of 16 bytes, at most " << kMaxItemBytes << ", on CUDA",
                 s.width() << " elements of " << out_dtype);
  const c10::cuda::CUDAGuard guard(ql_nope.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto a = producer_args(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, s);
  const auto dws = device_workspace(ws);
  const auto grid = static_cast<unsigned>(ws.layout.blocks);
  void* out = c.out ? c.out->data_ptr() : nullptr;
  if (out_dtype == at::kFloat8_e4m3fn) {
    using T = c10::Float8_e4m3fn;
    if (out) query_gather_kernel<T, true><<<grid, kThreads, 0, stream>>>(dws, c.geo.inbox_offset, a, static_cast<T*>(out));
    else query_gather_kernel<T, false><<<grid, kThreads, 0, stream>>>(dws, c.geo.inbox_offset, a, nullptr);
  } else {
    using T = c10::BFloat16;
    if (out) query_gather_kernel<T, true><<<grid, kThreads, 0, stream>>>(dws, c.geo.inbox_offset, a, static_cast<T*>(out));
    else query_gather_kernel<T, false><<<grid, kThreads, 0, stream>>>(dws, c.geo.inbox_offset, a, nullptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void release_cuda(const Workspace& ws, const at::Tensor& inbox) {
  const c10::cuda::CUDAGuard guard(inbox.device());
  query_release_kernel<<<static_cast<unsigned>(ws.layout.blocks), 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      device_workspace(ws));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("query_rope_quant", &query_rope_quant_op<rope_quant_cuda>);
  m.impl("query_gather", &query_gather_op<gather_cuda>);
  m.impl("query_publish", &query_publish_op<gather_cuda>);
  m.impl("query_release", &query_release_op<release_cuda>);
}

}  // namespace sdcp
