// Top-K boundary, CUDA. Candidates become 64-bit keys (semantics.h, larger =
// selected first), so a selection is a descending sort and the ids come out in
// selection order. One block of 1024 threads per row:
//   - chunk sort: each warp sorts runs of 64 keys in registers (bitonic, warp
//     shuffles), then merge-path rounds in shared memory merge the runs of a
//     chunk of up to 4096 keys, truncating every run to k;
//   - list merge: sorted lists (chunks, or the owners' shards) are merged by
//     rank: each key's output position is its index in its own list plus, for
//     every other list, the number of keys ahead of it (a binary search), so
//     one pass places every key without further barriers.
// The peer merge: each owner sorts its row once and publishes its best
// min(C, k) keys in its own shard (one slot); every consumer copies the
// owners' shards into shared memory, acknowledges, and list-merges them.

#include "device_signal.cuh"
#include "semantics.h"
#include "topk.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <atomic>

namespace sdcp {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 4096;              // keys sorted together, 4 per thread
constexpr int64_t kMaxSortKeys = 16384;   // candidates per row of topk_select

__device__ __forceinline__ uint64_t kmax(uint64_t a, uint64_t b) { return a > b ? a : b; }
__device__ __forceinline__ uint64_t kmin(uint64_t a, uint64_t b) { return a < b ? a : b; }

// Sorts the warp's 64 keys descending; element i = lane + 32 * e is held in
// v[e]. Bitonic network: stage s builds sorted runs of s keys (even runs
// descending, odd ascending), substep j compares i with i ^ j.
__device__ __forceinline__ void warp_sort64(uint64_t v[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 2; s <= 64; s <<= 1) {
#pragma unroll
    for (int j = s >> 1; j > 0; j >>= 1) {
      if (j == 32) {  // partner in the same lane (only in the last stage: descending)
        const uint64_t hi = kmax(v[0], v[1]), lo = kmin(v[0], v[1]);
        v[0] = hi;
        v[1] = lo;
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = lane + 32 * e;
          const uint64_t w = __shfl_xor_sync(0xffffffffu, v[e], j);
          const bool descending = (i & s) == 0;
          const bool lower = (i & j) == 0;
          v[e] = (lower == descending) ? kmax(v[e], w) : kmin(v[e], w);
        }
      }
    }
  }
}

// One merge round: runs of `len` keys (the last may be shorter; `total` keys
// in all) are merged in pairs into runs of min(2 * len, cap) keys, each the
// best of its pair. Returns the number of keys written.
__device__ int merge_round(const uint64_t* in, uint64_t* out, int total, int len, int cap) {
  const int nruns = (total + len - 1) / len, nout = (nruns + 1) / 2;
  const int newlen = min(2 * len, cap);
  const int ipt = max(1, (nout * newlen + kThreads - 1) / kThreads);  // outputs per thread
  const int per_run = (newlen + ipt - 1) / ipt;
  for (int c = threadIdx.x; c < nout * per_run; c += kThreads) {
    const int p = c / per_run, q = (c % per_run) * ipt;
    const uint64_t* a = in + 2 * p * len;
    const uint64_t* b = a + len;
    const int la = min(len, total - 2 * p * len);
    const int lb = max(0, min(len, total - (2 * p + 1) * len));
    const int olen = min(la + lb, newlen);
    if (q >= olen) continue;
    // Merge path: how many of the first q outputs come from a (a wins ties).
    int lo = max(0, q - lb), hi = min(q, la);
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (a[mid] >= b[q - 1 - mid]) lo = mid + 1; else hi = mid;
    }
    int i = lo, j = q - lo;
    uint64_t* o = out + p * newlen + q;
    const int cnt = min(ipt, olen - q);
    for (int x = 0; x < cnt; ++x) {
      const bool take_a = j >= lb || (i < la && a[i] >= b[j]);
      o[x] = take_a ? a[i++] : b[j++];
    }
  }
  return (nout - 1) * newlen + min(total - 2 * (nout - 1) * len, newlen);
}

// Sorts the n <= kChunk keys key_at(0..n) descending in shared memory (a and b
// hold kChunk keys each). Returns the buffer holding the sorted keys; keys
// past min(n, cap) may be truncated away.
template <typename KeyAt>
__device__ uint64_t* chunk_sort(KeyAt key_at, int n, int cap, uint64_t* a, uint64_t* b) {
  const int padded = (n + 63) & ~63;  // padding keys are 0: below every candidate
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int base = warp * 64; base < padded; base += kWarps * 64) {
    uint64_t v[2];
    v[0] = base + lane < n ? key_at(base + lane) : 0;
    v[1] = base + lane + 32 < n ? key_at(base + lane + 32) : 0;
    warp_sort64(v);
    a[base + lane] = v[0];
    a[base + lane + 32] = v[1];
  }
  __syncthreads();
  int total = padded;
  for (int len = 64; len < total; len = min(2 * len, cap)) {
    total = merge_round(a, b, total, len, cap);
    uint64_t* t = a;
    a = b;
    b = t;
    __syncthreads();
  }
  return a;
}

// Places every key of `nlists` sorted lists (list l at lists + l * lstride,
// `len` keys, the last list `last_len`) by rank, and calls emit(pos, key) for
// the positions below k. Ties across lists go to the lower list, so positions
// are a permutation.
template <typename Emit>
__device__ void list_merge(const uint64_t* lists, int nlists, int lstride, int len, int last_len, int k, Emit emit) {
  for (int e = threadIdx.x; e < nlists * lstride; e += kThreads) {
    const int l = e / lstride, i = e % lstride;
    if (i >= (l == nlists - 1 ? last_len : len) || i >= k) continue;
    const uint64_t x = lists[e];
    int pos = i;
    for (int d = 0; d < nlists && pos < k; ++d) {
      if (d == l) continue;
      const uint64_t* other = lists + d * lstride;
      int lo = 0, hi = d == nlists - 1 ? last_len : len;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const bool ahead = d < l ? other[mid] >= x : other[mid] > x;
        if (ahead) lo = mid + 1; else hi = mid;
      }
      pos += lo;
    }
    if (pos < k) emit(pos, x);
  }
}

// Shared memory of block_select over m keys: two chunk buffers, then the
// sorted lists of the chunks (only with more than one chunk).
int64_t select_smem(int64_t m, int64_t k) {
  const int64_t chunks = std::max<int64_t>(1, (m + kChunk - 1) / kChunk);
  const int64_t lstride = std::min<int64_t>(kChunk, k);
  return 2 * kChunk * 8 + (chunks > 1 ? chunks * lstride * 8 : 0);
}

// The best min(m, k) of keys key_at(0..m) in order: emit(pos, key). The caller
// emits the -1 padding for positions m..k. `before_emit` runs (once, by the
// whole block) after the sorting and before the first emit.
template <typename KeyAt, typename Emit, typename BeforeEmit>
__device__ void block_select(uint8_t* smem, KeyAt key_at, int m, int k, Emit emit, BeforeEmit before_emit) {
  auto* a = reinterpret_cast<uint64_t*>(smem);
  auto* b = a + kChunk;
  auto* lists = b + kChunk;
  const int chunks = max(1, (m + kChunk - 1) / kChunk);
  const int lstride = min(kChunk, k);
  if (chunks == 1) {
    const uint64_t* sorted = chunk_sort(key_at, m, k, a, b);
    before_emit();
    for (int pos = threadIdx.x; pos < min(m, k); pos += kThreads) emit(pos, sorted[pos]);
    return;
  }
  for (int c = 0; c < chunks; ++c) {
    const int base = c * kChunk, n = min(kChunk, m - base);
    const uint64_t* sorted = chunk_sort([&](int j) { return key_at(base + j); }, n, k, a, b);
    for (int j = threadIdx.x; j < min(n, lstride); j += kThreads) lists[c * lstride + j] = sorted[j];
    __syncthreads();
  }
  before_emit();
  const int last = m - (chunks - 1) * kChunk;
  list_merge(lists, chunks, lstride, lstride, min(last, lstride), k, emit);
}

__global__ void __launch_bounds__(kThreads) topk_select_kernel(const float* scores, const int32_t* ids, int64_t s0,
                                                               int64_t i0, int m, int k, int32_t* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t t = blockIdx.x;
  int32_t* o = out + t * k;
  block_select(
      smem, [&](int j) { return topk_key(scores[t * s0 + j], ids[t * i0 + j]); }, m, k,
      [&](int pos, uint64_t key) { o[pos] = topk_key_id(key); }, [] {});
  for (int pos = m + threadIdx.x; pos < k; pos += kThreads) o[pos] = -1;
}

// Grid: max_rows blocks (per-block epochs), block t handles row t.
__global__ void __launch_bounds__(kThreads) topk_merge_kernel(DeviceWorkspace ws, TopKGeometry g, const float* scores,
                                                              const int32_t* ids, int64_t s0, int64_t i0, int rows,
                                                              int c, int k, int32_t* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  const uint64_t epoch = block_next_epoch(ws);
  const int t = blockIdx.x, n = ws.world;
  const int kk = static_cast<int>(g.keys_per_row);  // min(c, k)
  auto shard = [&](int r) { return reinterpret_cast<uint64_t*>(ws.slot_data(r, 0) + g.shard_offset) + t * kk; };
  // 1. Owner: sort the row once; once every consumer has finished reading the
  //    previous epoch, store the best kk keys into the own shard, in order.
  uint64_t* own = shard(ws.rank);
  if (t < rows) {
    block_select(
        smem, [&](int j) { return topk_key(scores[t * s0 + j], ids[t * i0 + j]); }, c, kk,
        [&](int pos, uint64_t key) { own[pos] = key; }, [&] { block_wait_acks(ws, epoch); });
  } else {
    block_wait_acks(ws, epoch);
  }
  block_publish_all(ws, epoch);
  block_wait_all(ws, epoch);
  // 2. Consumer: copy every owner's sorted row into shared memory (16-byte
  //    loads), acknowledge, then place the keys by rank.
  auto* lists = reinterpret_cast<uint64_t*>(smem);
  if (t < rows) {
    if (kk % 2 == 0) {  // rows are 16-byte aligned
      const int vec_per_list = kk / 2;
      for (int x = threadIdx.x; x < n * vec_per_list; x += kThreads) {
        const int r = x / vec_per_list, v = x % vec_per_list;
        reinterpret_cast<uint4*>(lists + r * kk)[v] = reinterpret_cast<const uint4*>(shard(r))[v];
      }
    } else {
      for (int x = threadIdx.x; x < n * kk; x += kThreads) lists[x] = shard(x / kk)[x % kk];
    }
  }
  block_ack_all(ws, epoch);
  if (t < rows) {
    int32_t* o = out + static_cast<int64_t>(t) * k;
    list_merge(lists, n, kk, kk, kk, k, [&](int pos, uint64_t key) { o[pos] = topk_key_id(key); });
  }
  block_commit_epoch(ws, epoch);
}

int64_t max_smem_optin(const at::Tensor& on) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, on.get_device()));
  return value;
}

// Opt the kernel into `bytes` of dynamic shared memory on the current device
// (the attribute call is made only when a larger size is first needed).
void set_smem(const void* kernel, int64_t bytes, std::array<std::atomic<int64_t>, 64>& current, int device) {
  auto& cur = current[device & 63];
  if (bytes > cur.load()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    cur.store(bytes);
  }
}

void select_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t k, at::Tensor& out) {
  const int64_t rows = scores.size(0), m = scores.size(1);
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per row on CUDA", m);
  SDCP_CHECK_ARG(k <= INT32_MAX / 2, "k", "at most " << INT32_MAX / 2 << " on CUDA", k);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t smem = select_smem(m, k), limit = max_smem_optin(scores);
  SDCP_CHECK_ARG(smem <= limit, "scores", "a row that fits in shared memory (" << limit << " bytes)", smem << " bytes for "
                 << m << " candidates and k = " << k);
  static std::array<std::atomic<int64_t>, 64> current{};
  set_smem(reinterpret_cast<const void*>(topk_select_kernel), smem, current, scores.get_device());
  topk_select_kernel<<<rows, kThreads, smem, at::cuda::getCurrentCUDAStream().stream()>>>(
      scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0), static_cast<int>(m),
      static_cast<int>(k), out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void merge_cuda(const TopKMergeCall& c, const at::Tensor& scores, const at::Tensor& ids) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  const int64_t cand = c.geo.candidates_per_rank, kk = c.geo.keys_per_row, k = c.geo.k;
  const int64_t smem = std::max(select_smem(cand, kk), ws.world_size * kk * 8), limit = max_smem_optin(scores);
  SDCP_CHECK_ARG(smem <= limit, "scores", "candidates that fit in shared memory (" << limit << " bytes)",
                 smem << " bytes for " << cand << " candidates per rank, " << ws.world_size << " ranks and k = " << k);
  const c10::cuda::CUDAGuard guard(scores.device());
  static std::array<std::atomic<int64_t>, 64> current{};
  set_smem(reinterpret_cast<const void*>(topk_merge_kernel), smem, current, scores.get_device());
  // The grid is fixed by the workspace (max_rows blocks): per-block epochs.
  topk_merge_kernel<<<ws.layout.blocks, kThreads, smem, at::cuda::getCurrentCUDAStream().stream()>>>(
      device_workspace(ws), c.geo, scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0),
      static_cast<int>(c.rows), static_cast<int>(cand), static_cast<int>(k), c.out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("topk_select", &topk_select_op<select_cuda>);
  m.impl("topk_merge", &topk_merge_op<merge_cuda>);
}

}  // namespace sdcp
