// Query boundary, CUDA: the fused RoPE / concatenation / quantisation producer
// and the data-as-flag fan-out of a rank's heads (docs/PROTOCOL.md, version
// 4). A warp handles one (row, local head) item: it produces it once into
// shared memory (or reads it, for a query produced elsewhere) and stores it as
// canonicalised 16-byte vectors into every destination; then it polls the
// peers' copies of its items in the local buffer. The copying ops rotate two
// buffers by the call index and re-fill what they read; the zero-copy view is
// one fixed buffer that query_release re-fills and acknowledges.

#include "lamport.cuh"
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

// Produces item (t, h) into `dst` (its first element). Called by a whole warp.
template <typename out_t>
__device__ void produce_item(const ProducerArgs& a, int64_t t, int64_t h, out_t* dst) {
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
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[d + e] = v[e];
    }
  } else {
    for (int64_t d = lane; d < a.nope_dim; d += 32) {
      dst[d] = convert_out<out_t>(static_cast<float>(n[d]), scale);
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
    dst[a.nope_dim + i0] = convert_out<out_t>(rope_first(x0, x1, co, si), scale);
    dst[a.nope_dim + i1] = convert_out<out_t>(rope_second(x0, x1, co, si), scale);
  }
}

template <typename out_t>
__global__ void query_rope_quant_kernel(ProducerArgs a, out_t* out) {
  const int64_t items = a.rows * a.heads, width = a.nope_dim + a.rope_dim;
  for (int64_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < items; i += gridDim.x * kWarps) {
    produce_item<out_t>(a, i / a.heads, i % a.heads, out + i * width);
  }
}

// Bytes of one produced item, staged per warp in shared memory.
constexpr int kMaxItemBytes = 2048;

// The items of one call, (row, local head) i = t * H_loc + h, as 16-byte vectors.
// Produced: the fused RoPE / quantisation, once per item into the warp's stage.
template <typename out_t>
struct Produced {
  static constexpr int kStageVecs = kMaxItemBytes / 16;
  ProducerArgs a;
  __device__ __forceinline__ const uint4* item(int64_t i, uint4* stage) const {
    produce_item<out_t>(a, i / a.heads, i % a.heads, reinterpret_cast<out_t*>(stage));
    __syncwarp();
    return stage;
  }
};

// Given: a query produced elsewhere, q [T, H_loc, W] packed.
struct Given {
  static constexpr int kStageVecs = 1;
  const uint4* q;
  int64_t nvec;
  __device__ __forceinline__ const uint4* item(int64_t i, uint4*) const { return q + i * nvec; }
};

// What a kernel needs of the workspace geometry (QueryGeometry) and the call.
struct DeviceQuery {
  int64_t rows, local_heads, nvec;  // nvec: 16-byte vectors per item
  int64_t entry_vecs;               // vectors of one peer's entry in a rotating buffer
  int64_t view_offset, buffers_offset, buffer_bytes;
  uint32_t canonical;
};

__device__ __forceinline__ QueryControl* control_of(const DeviceWorkspace& ws, int r) {
  return reinterpret_cast<QueryControl*>(ws.region(r) + kQueryControlOffset);
}

__device__ __forceinline__ uint4 canonical_vector(uint4 v, uint32_t c) {
  return make_uint4(canonical_word(v.x, c), canonical_word(v.y, c), canonical_word(v.z, c), canonical_word(v.w, c));
}

// The view call this kernel runs (every thread of the block gets it).
__device__ __forceinline__ uint64_t block_view_call(const DeviceWorkspace& ws) {
  __shared__ uint64_t call;
  if (threadIdx.x == 0) call = *reinterpret_cast<volatile uint64_t*>(&control_of(ws, ws.rank)->view_call);
  __syncthreads();
  return call;
}

// Reports a wait of the view path that ran out of time and traps.
static __device__ __noinline__ void view_timeout(const DeviceWorkspace& ws, int src, uint64_t call, const char* what) {
  printf("torch_sdcp: timeout: rank %d block %d waited %.3f s for peer %d%s (workspace %lld, view buffer, view "
         "call %llu); the peer stopped participating or calls differ between ranks\n",
         ws.rank, blockIdx.x, ws.timeout_ns * 1e-9, src, what, (long long)ws.handle, (unsigned long long)call);
  __trap();
}

// Before storing view call `call` into the peers' views: every peer has
// released call - 1 (re-filled its view and said so). The block's last warp
// polls, one lane per peer, while the other warps produce their first item.
__device__ __forceinline__ void block_wait_released(const DeviceWorkspace& ws, uint64_t call) {
  const int first = blockDim.x > 32 ? static_cast<int>(blockDim.x) - 32 : 0;
  const QueryControl* c = control_of(ws, ws.rank);
  for (int s = static_cast<int>(threadIdx.x) - first; s >= 0 && s < ws.world; s += 32) {
    if (s == ws.rank || ld_acquire_sys(&c->released[s]) >= call) continue;
    const uint64_t start = globaltimer_ns();
    while (ld_acquire_sys(&c->released[s]) < call)
      if (globaltimer_ns() - start > ws.timeout_ns) view_timeout(ws, s, call, " to release the previous view call");
  }
  __syncthreads();
}

// Polls a vector of the local view until no word is the sentinel.
__device__ __forceinline__ void poll_view(const DeviceWorkspace& ws, const uint4* p, int src, uint64_t call) {
  if (!has_sentinel(ld_volatile_v4(p))) return;
  const uint64_t start = globaltimer_ns();
  while (has_sentinel(ld_volatile_v4(p)))
    if (globaltimer_ns() - start > ws.timeout_ns) view_timeout(ws, src, call, "'s data");
}

// One call. Block b owns the items [begin, end) of the same partition on
// every rank (rows and H_loc agree), stores them before it waits, and waits
// only for the peers' copies of its own items, which the peers' block b
// stores before it waits: the grid is sized to the items and need not be
// co-resident.
//  kView == false (query_gather, query_all_gather_heads_out): this rank's
//    heads go straight into `out`, every peer's copy into its entry of the
//    rotating buffer `call % 2`; the peers' copies are polled, copied into
//    `out` and re-filled with the sentinel at once.
//  kView == true (query_publish): after every peer released the last view
//    call, this rank's heads go into every rank's view (its own included);
//    the peers' copies are polled in place and stay for the reader.
template <typename Items, bool kView>
__global__ void __launch_bounds__(kThreads) query_kernel(DeviceWorkspace ws, DeviceQuery q, Items items, uint4* out) {
  __shared__ __align__(16) uint4 stage[kWarps][Items::kStageVecs];
  const uint64_t call = kView ? block_view_call(ws) : block_call_index(ws);
  const int n = ws.world, me = ws.rank, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t hl = q.local_heads, nvec = q.nvec, total = q.rows * hl;
  const int64_t per_block = (total + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(total, blockIdx.x * per_block), end = min(total, begin + per_block);
  auto view_of = [&](int r) { return reinterpret_cast<uint4*>(ws.slot_data(r, 0) + q.view_offset); };
  auto entry = [&](int dst, int src) {  // [row][h] of src in dst's buffer of this call
    return reinterpret_cast<uint4*>(ws.slot_data(dst, 0) + q.buffers_offset +
                                    static_cast<int64_t>(call % kLamportBuffers) * q.buffer_bytes) +
           ws.peer_slot(src, dst) * q.entry_vecs;
  };
  // Item i of source s in the gathered layout [row][s * H_loc + h].
  auto gathered = [&](int64_t i, int s) { return ((i / hl) * n + s) * hl + i % hl; };

  // 1. Store this rank's items.
  const int64_t first = begin + warp;
  const uint4* x = nullptr;
  if constexpr (kView) {
    if (first < end) x = items.item(first, stage[warp]);
    block_wait_released(ws, call);
  }
  for (int64_t i = first; i < end; i += kWarps) {
    if (!kView || i != first) x = items.item(i, stage[warp]);
    const int64_t mine = gathered(i, me) * nvec;
    for (int64_t v = lane; v < nvec; v += 32) {
      const uint4 val = canonical_vector(x[v], q.canonical);
      if constexpr (kView) {
        for (int d = 0; d < n; ++d) view_of(d)[mine + v] = val;
      } else {
        out[mine + v] = val;
        for (int d = 0; d < n; ++d)
          if (d != me) entry(d, me)[i * nvec + v] = val;
      }
    }
    __syncwarp();  // the stage is rewritten by the next item
  }

  // 2. Wait for the peers' copies of the same items, (peer, vector) pairs
  //    flattened over the lanes.
  const int64_t pairs = (n - 1) * nvec;
  for (int64_t i = first; i < end; i += kWarps) {
    for (int64_t p = lane; p < pairs; p += 32) {
      const int s = static_cast<int>((me + 1 + p / nvec) % n);
      const int64_t v = p % nvec;
      if constexpr (kView) {
        poll_view(ws, view_of(me) + gathered(i, s) * nvec + v, s, call);
      } else {
        uint4* src = entry(me, s) + i * nvec + v;
        out[gathered(i, s) * nvec + v] = poll_vector(ws, src, s, call);
        *src = make_uint4(kSentinel, kSentinel, kSentinel, kSentinel);
      }
    }
  }
  if constexpr (!kView) block_finish_call(ws, call);
}

// The reader of the view is done: re-fill the peers' heads of the first `rows`
// rows with the sentinel, then the last block to finish tells every producer
// (one release store per peer, after a system fence that orders every block's
// re-fill before it) and advances the view call. The fences wait for local
// stores only, and the kernel runs after the reader, off the producers'
// critical path.
__global__ void __launch_bounds__(kThreads) query_release_kernel(DeviceWorkspace ws, DeviceQuery q) {
  const int n = ws.world, me = ws.rank;
  const int64_t head_vecs = q.local_heads * q.nvec;  // one source's heads of one row
  const int64_t per_row = (n - 1) * head_vecs, total = q.rows * per_row;
  uint4* view = reinterpret_cast<uint4*>(ws.slot_data(me, 0) + q.view_offset);
  const uint4 sentinel = make_uint4(kSentinel, kSentinel, kSentinel, kSentinel);
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < total;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = x / per_row, r = x % per_row;
    const int s = static_cast<int>((me + 1 + r / head_vecs) % n);
    view[(t * n + s) * head_vecs + r % head_vecs] = sentinel;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's re-fill (ordered by the barrier) before its arrival
    QueryControl* c = control_of(ws, me);
    if (atomicAdd(&c->release_arrived, 1u) == gridDim.x - 1) {
      __threadfence_system();  // every block's re-fill before the releases
      c->release_arrived = 0;
      const uint64_t call = *reinterpret_cast<volatile uint64_t*>(&c->view_call);
      for (int d = 0; d < n; ++d)
        if (d != me) st_release_sys(&control_of(ws, d)->released[me], call + 1);
      *reinterpret_cast<volatile uint64_t*>(&c->view_call) = call + 1;
    }
  }
}

DeviceQuery device_query(const QueryGeometry& g, int64_t rows) {
  const int64_t nvec = g.item_bytes() / 16;
  return {rows, g.local_heads, nvec, g.max_rows * g.local_heads * nvec, g.view_offset, g.buffers_offset,
          g.buffer_bytes, g.canonical};
}

// The kernels move items as 16-byte vectors; a produced item is staged in at
// most kMaxItemBytes of shared memory.
void check_item_bytes(const QueryGeometry& g, const char* arg, bool staged) {
  const int64_t limit = staged ? kMaxItemBytes : kMaxRegionBytes;
  SDCP_CHECK_ARG(g.item_bytes() % 16 == 0 && g.item_bytes() <= limit, arg,
                 "heads of a multiple of 16 bytes" << (staged ? ", at most 2048," : "") << " on CUDA",
                 g.head_dim << " elements of " << g.elem_bytes << " bytes");
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

// Launches the gather kernel (copying), or the publish kernel (view).
void gather_cuda(const QueryCall& c, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                 at::ScalarType out_dtype, bool view) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  check_item_bytes(c.geo, "ql_nope, q_pe", true);
  const c10::cuda::CUDAGuard guard(ql_nope.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto a = producer_args(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, c.shape);
  const auto dws = device_workspace(ws);
  const auto dq = device_query(c.geo, c.shape.rows);
  // One warp per item; at least one block.
  const int grid = lamport_grid(c.shape.rows * c.shape.heads, kWarps, ql_nope.get_device());
  auto* out = c.out ? static_cast<uint4*>(c.out->data_ptr()) : nullptr;
  auto launch = [&](auto items) {
    using Items = decltype(items);
    if (view) query_kernel<Items, true><<<grid, kThreads, 0, stream>>>(dws, dq, items, nullptr);
    else query_kernel<Items, false><<<grid, kThreads, 0, stream>>>(dws, dq, items, out);
  };
  if (out_dtype == at::kFloat8_e4m3fn) launch(Produced<c10::Float8_e4m3fn>{a});
  else launch(Produced<c10::BFloat16>{a});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_aligned(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, "a 16-byte aligned data pointer on CUDA",
                 "address " << t.data_ptr());
}

void all_gather_heads_cuda(const HeadsCall& c, const at::Tensor& q, at::Tensor& out) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  check_item_bytes(c.geo, "q", false);
  check_aligned(q, "q");
  check_aligned(out, "out");
  const c10::cuda::CUDAGuard guard(q.device());
  const auto dq = device_query(c.geo, c.rows);
  const int grid = lamport_grid(c.rows * c.geo.local_heads, kWarps, q.get_device());
  query_kernel<Given, false><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      device_workspace(ws), dq, Given{static_cast<const uint4*>(q.data_ptr()), dq.nvec},
      static_cast<uint4*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void release_cuda(const ReleaseCall& c, const at::Tensor& view) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  check_item_bytes(c.geo, "inbox", false);
  const c10::cuda::CUDAGuard guard(view.device());
  const auto dq = device_query(c.geo, c.rows);
  // One thread per re-filled vector; at least one block (it acknowledges).
  const int grid = lamport_grid(c.rows * (ws.world_size - 1) * c.geo.local_heads * dq.nvec, kThreads,
                                view.get_device());
  query_release_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(device_workspace(ws), dq);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("query_rope_quant", &query_rope_quant_op<rope_quant_cuda>);
  m.impl("query_gather", &query_gather_op<gather_cuda>);
  m.impl("query_publish", &query_publish_op<gather_cuda>);
  m.impl("query_release", &query_release_op<release_cuda>);
  m.impl("query_all_gather_heads_out", &query_all_gather_heads_out_op<all_gather_heads_cuda>);
}

}  // namespace sdcp
