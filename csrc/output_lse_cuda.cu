// Output/LSE boundary, CUDA. One fused kernel on a fixed grid: block b stores
// its chunk of every destination's head shard (payload and LSE) into that
// owner's inbox, publishes one flag per destination, waits for chunk b from
// every producer, then combines it in fp32 and rounds once. A warp handles
// one (row, head) item; payloads move as 16-byte vectors.

#include "device_signal.cuh"
#include "output_lse.h"
#include "semantics.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDeviceWorld = 16;

template <typename scalar_t>
struct Vec {
  static constexpr int kElems = 16 / sizeof(scalar_t);
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
    return static_cast<float>(reinterpret_cast<const scalar_t*>(&raw)[i]);
  }
  __device__ __forceinline__ void set(int i, float v) { reinterpret_cast<scalar_t*>(&raw)[i] = static_cast<scalar_t>(v); }
};

// Combine one item with the lane's share of its vectors. `lse(s)` is shard s's
// raw LSE; `src(s)` points at shard s's payload (dim elements).
template <typename scalar_t, typename LseAt, typename SrcAt>
__device__ __forceinline__ void combine_item(int n, LseAt lse, SrcAt src, int64_t nvec, bool base2,
                                             scalar_t* out, float* out_lse) {
  using V = Vec<scalar_t>;
  float w[kMaxDeviceWorld];
  const float L = lse_weights(n, lse, base2, w);
  const int lane = threadIdx.x & 31;
  if (lane == 0) *out_lse = L;
  // Two vectors per lane per step, so each source contributes two loads in flight.
  for (int64_t v0 = lane; v0 < nvec; v0 += 64) {
    const bool second = v0 + 32 < nvec;
    float acc[2][V::kElems];
#pragma unroll
    for (int e = 0; e < V::kElems; ++e) acc[0][e] = acc[1][e] = 0.0f;
    for (int s = 0; s < n; ++s) {
      if (w[s] == 0.0f) continue;  // a zero-weight payload is never read
      const uint4* p = reinterpret_cast<const uint4*>(src(s));
      V x0, x1;
      x0.raw = p[v0];
      if (second) x1.raw = p[v0 + 32];
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) {
        acc[0][e] += w[s] * x0.get(e);
        if (second) acc[1][e] += w[s] * x1.get(e);
      }
    }
    V o0, o1;
#pragma unroll
    for (int e = 0; e < V::kElems; ++e) {
      o0.set(e, acc[0][e]);
      o1.set(e, acc[1][e]);
    }
    reinterpret_cast<uint4*>(out)[v0] = o0.raw;
    if (second) reinterpret_cast<uint4*>(out)[v0 + 32] = o1.raw;
  }
}

template <typename scalar_t>
__global__ void lse_combine_kernel(const scalar_t* po, const float* pl, int n, int64_t items, int64_t dim,
                                   bool base2, scalar_t* out, float* lse) {
  const int64_t nvec = dim / Vec<scalar_t>::kElems;
  for (int64_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < items; i += gridDim.x * kWarps) {
    combine_item<scalar_t>(
        n, [&](int s) { return pl[s * items + i]; }, [&](int s) { return po + (s * items + i) * dim; }, nvec,
        base2, out + i * dim, lse + i);
  }
}

template <typename scalar_t>
__global__ void output_lse_kernel(DeviceWorkspace ws, const scalar_t* po, const float* pl, int64_t rows,
                                  int64_t heads, int64_t dim, int64_t max_rows, bool base2, scalar_t* out,
                                  float* out_lse) {
  const uint64_t epoch = block_next_epoch(ws);
  const int slot = epoch & 1;
  const int n = ws.world;
  const int64_t hl = heads / n, items = rows * hl;
  const int64_t nvec = dim / Vec<scalar_t>::kElems;
  const int64_t per_block = (items + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(items, blockIdx.x * per_block), end = min(items, begin + per_block);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  // Inbox of rank d: payload [src][max_rows][hl][dim], LSE [src][max_rows][hl].
  auto inbox_out = [&](int d, int src) {
    return reinterpret_cast<scalar_t*>(ws.slot_data(d, slot) + ws.part[0]) + src * max_rows * hl * dim;
  };
  auto inbox_lse = [&](int d, int src) {
    return reinterpret_cast<float*>(ws.slot_data(d, slot) + ws.part[1]) + src * max_rows * hl;
  };
  // 1. Producer: item i = (t, h) goes to destination d's inbox, slot of this
  //    rank. The (destination, vector) pairs of an item are flattened and
  //    moved kUnroll per lane at a time: all loads first, then all stores.
  constexpr int kUnroll = 4;
  const int64_t pairs = n * nvec;
  for (int64_t i = begin + warp; i < end; i += kWarps) {
    const int64_t t = i / hl, h = i % hl;
    const scalar_t* src_row = po + (t * heads + h) * dim;  // + d * hl * dim for destination d
    for (int64_t base = 0; base < pairs; base += 32 * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t x = base + u * 32 + lane;
        if (x < pairs) buf[u] = reinterpret_cast<const uint4*>(src_row + (x / nvec) * hl * dim)[x % nvec];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t x = base + u * 32 + lane;
        if (x < pairs) reinterpret_cast<uint4*>(inbox_out(static_cast<int>(x / nvec), ws.rank) + i * dim)[x % nvec] = buf[u];
      }
    }
    if (lane < n) inbox_lse(lane, ws.rank)[i] = pl[t * heads + lane * hl + h];
  }
  block_publish_all(ws, epoch);
  // 2. Owner: wait for chunk b of every producer, then combine it.
  block_wait_all(ws, epoch);
  for (int64_t i = begin + warp; i < end; i += kWarps) {
    combine_item<scalar_t>(
        n, [&](int s) { return inbox_lse(ws.rank, s)[i]; },
        [&](int s) { return inbox_out(ws.rank, s) + i * dim; }, nvec, base2, out + i * dim, out_lse + i);
  }
  block_commit_epoch(ws, epoch);
}

// The kernels move payloads as 16-byte vectors.
void check_vectorizable(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(t.size(-1) * t.element_size() % 16 == 0, name,
                 "a last dimension of a multiple of 16 bytes on CUDA", t.size(-1) << " elements of "
                 << t.element_size() << " bytes");
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, "a 16-byte aligned data pointer",
                 "address " << t.data_ptr());
}

std::tuple<at::Tensor, at::Tensor> lse_combine_cuda(const at::Tensor& partial_out, const at::Tensor& partial_lse,
                                                    bool base2) {
  check_dim(partial_out, "partial_out", 4);
  check_dim(partial_lse, "partial_lse", 3);
  check_float_dtype(partial_out, "partial_out");
  check_dtype(partial_lse, "partial_lse", at::kFloat);
  check_contiguous(partial_out, "partial_out");
  check_contiguous(partial_lse, "partial_lse");
  for (int d = 0; d < 3; ++d) check_size(partial_lse, "partial_lse", d, partial_out.size(d));
  check_same_device(partial_lse, "partial_lse", partial_out, "partial_out");
  check_vectorizable(partial_out, "partial_out");
  const int64_t n = partial_out.size(0), rows = partial_out.size(1), heads = partial_out.size(2);
  const int64_t dim = partial_out.size(3), items = rows * heads;
  SDCP_CHECK_ARG(n >= 1 && n <= kMaxDeviceWorld, "partial_out", "1.." << kMaxDeviceWorld << " shards in dim 0", n);
  auto out = at::empty({rows, heads, dim}, partial_out.options());
  auto lse = at::empty({rows, heads}, partial_lse.options());
  if (items == 0) return {out, lse};
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int grid = static_cast<int>(std::min<int64_t>((items + kWarps - 1) / kWarps, 1024));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_combine", [&] {
    lse_combine_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        partial_out.data_ptr<scalar_t>(), partial_lse.data_ptr<float>(), static_cast<int>(n), items, dim, base2,
        out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

void output_lse_combine_out_cuda(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t workspace,
                                 bool base2, at::Tensor& out, at::Tensor& out_lse) {
  check_partial_inputs(partial_out, partial_lse);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out);
  const Workspace& ws = *ws_ptr;
  check_output_lse_workspace(ws, partial_out);
  check_combine_outputs(ws, partial_out, out, out_lse);
  check_vectorizable(partial_out, "partial_out");
  check_vectorizable(out, "out");
  SDCP_CHECK_ARG(ws.world_size <= kMaxDeviceWorld, "workspace", "a world size of at most " << kMaxDeviceWorld,
                 ws.world_size);
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto dws = device_workspace(ws);
  // The grid is fixed by the workspace (per-block epochs), even for 0 rows.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "output_lse_combine", [&] {
    output_lse_kernel<scalar_t><<<ws.layout.blocks, kThreads, 0, stream>>>(
        dws, partial_out.data_ptr<scalar_t>(), partial_lse.data_ptr<float>(), partial_out.size(0),
        partial_out.size(1), partial_out.size(2), ws.params[0], base2, out.data_ptr<scalar_t>(),
        out_lse.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> output_lse_combine_cuda(const at::Tensor& partial_out,
                                                           const at::Tensor& partial_lse, int64_t workspace,
                                                           bool base2) {
  check_partial_inputs(partial_out, partial_lse);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out);
  const int64_t n = ws_ptr->world_size;
  SDCP_CHECK_ARG(partial_out.size(1) % n == 0, "partial_out", "heads divisible by the world size " << n,
                 partial_out.size(1));
  auto out = at::empty({partial_out.size(0), partial_out.size(1) / n, partial_out.size(2)}, partial_out.options());
  auto lse = at::empty({partial_out.size(0), partial_out.size(1) / n}, partial_lse.options());
  output_lse_combine_out_cuda(partial_out, partial_lse, workspace, base2, out, lse);
  return {out, lse};
}

}  // namespace

// ---------------------------------------------------------------------------
// lse_correct: the local kernel of the collective Output/LSE path (LSE
// all_gather -> this kernel -> reduce_scatter on heads). One warp per (t, h):
// every lane forms the global LSE from the N gathered LSEs (broadcast loads,
// fp32), then the warp scales the D payload elements as 16-byte vectors, two
// in flight per lane, rounding once, and stores them head-major [H, T, D] so
// that reduce_scatter on dim 0 needs no transpose copy. A zero weight stores
// exact zeros without reading the payload.
// ---------------------------------------------------------------------------

namespace {

constexpr int kCorrectThreads = 256;
constexpr int kCorrectWarps = kCorrectThreads / 32;

// Weight of shard `rank` and the global LSE of one (t, h): the arithmetic of
// lse_weights (semantics.h) in the same order, with no per-shard array (any N).
__device__ __forceinline__ float correct_weight(const float* lse, int64_t stride, int64_t n, int64_t rank,
                                                bool base2, float* L_out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse[i * stride]);
    m = l > m ? l : m;
  }
  if (m == -INFINITY) m = 0.0f;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse[i * stride]);
    sum += base2 ? exp2f(l - m) : expf(l - m);
  }
  if (sum == 0.0f) {
    *L_out = -INFINITY;
    return 0.0f;
  }
  const float L = m + (base2 ? log2f(sum) : logf(sum));
  *L_out = L;
  const float l = lse_sanitize(lse[rank * stride]);
  return base2 ? exp2f(l - L) : expf(l - L);
}

template <typename scalar_t>
__global__ void lse_correct_kernel(const scalar_t* __restrict__ po, const float* __restrict__ gl, int64_t n,
                                   int64_t rank, int64_t rows, int64_t heads, int64_t dim, bool base2,
                                   scalar_t* __restrict__ out, float* __restrict__ out_lse) {
  using V = Vec<scalar_t>;
  const int64_t items = rows * heads, nvec = dim / V::kElems;
  const int lane = threadIdx.x & 31;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kCorrectWarps + threadIdx.x / 32; i < items;
       i += static_cast<int64_t>(gridDim.x) * kCorrectWarps) {
    float L;
    const float w = correct_weight(gl + i, items, n, rank, base2, &L);
    if (lane == 0) out_lse[i] = L;
    const int64_t t = i / heads, h = i - t * heads;
    uint4* dst = reinterpret_cast<uint4*>(out + (h * rows + t) * dim);
    if (w == 0.0f) {  // exactly 0; the payload (maybe NaN) is never read
      for (int64_t v = lane; v < nvec; v += 32) dst[v] = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const uint4* src = reinterpret_cast<const uint4*>(po + i * dim);
    for (int64_t v0 = lane; v0 < nvec; v0 += 64) {
      const bool second = v0 + 32 < nvec;
      V x0, x1;
      x0.raw = src[v0];
      if (second) x1.raw = src[v0 + 32];
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) {
        x0.set(e, w * x0.get(e));
        if (second) x1.set(e, w * x1.get(e));
      }
      dst[v0] = x0.raw;
      if (second) dst[v0 + 32] = x1.raw;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> lse_correct_cuda(const at::Tensor& partial_out, const at::Tensor& gathered_lse,
                                                    int64_t rank, bool base2) {
  check_dim(partial_out, "partial_out", 3);
  check_dim(gathered_lse, "gathered_lse", 3);
  check_float_dtype(partial_out, "partial_out");
  check_dtype(gathered_lse, "gathered_lse", at::kFloat);
  check_contiguous(partial_out, "partial_out");
  check_contiguous(gathered_lse, "gathered_lse");
  check_size(gathered_lse, "gathered_lse", 1, partial_out.size(0));
  check_size(gathered_lse, "gathered_lse", 2, partial_out.size(1));
  check_same_device(gathered_lse, "gathered_lse", partial_out, "partial_out");
  const int64_t n = gathered_lse.size(0), rows = partial_out.size(0), heads = partial_out.size(1);
  const int64_t dim = partial_out.size(2), items = rows * heads;
  SDCP_CHECK_ARG(n >= 1, "gathered_lse", "at least one shard in dimension 0", n);
  SDCP_CHECK_ARG(rank >= 0 && rank < n, "rank", "a rank in [0, " << n << ")", rank);
  SDCP_CHECK_ARG(dim % 8 == 0, "partial_out", "a last dimension of a multiple of 8 elements on CUDA",
                 dim << " elements");
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(partial_out.data_ptr()) % 16 == 0, "partial_out",
                 "a 16-byte aligned data pointer", "address " << partial_out.data_ptr());
  auto out = at::empty({heads, rows, dim}, partial_out.options());  // head-major
  auto lse = at::empty({rows, heads}, gathered_lse.options());
  if (items == 0) return {out, lse};
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int grid = static_cast<int>(std::min<int64_t>((items + kCorrectWarps - 1) / kCorrectWarps, 4096));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_correct", [&] {
    lse_correct_kernel<scalar_t><<<grid, kCorrectThreads, 0, stream>>>(
        partial_out.data_ptr<scalar_t>(), gathered_lse.data_ptr<float>(), n, rank, rows, heads, dim, base2,
        out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("lse_correct", &lse_correct_cuda);
}

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("lse_combine", &lse_combine_cuda);
  m.impl("output_lse_combine", &output_lse_combine_cuda);
  m.impl("output_lse_combine_out", &output_lse_combine_out_cuda);
}

}  // namespace sdcp
