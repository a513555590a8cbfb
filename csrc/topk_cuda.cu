// Top-K boundary, CUDA. One block per row: the candidates become 64-bit keys
// (semantics.h) and a block-wide radix sort (CUB) orders them descending, so
// the ids come out in selection order. The peer merge runs on a fixed grid of
// max_rows blocks: block t writes the owner's row t into its own shard,
// publishes, waits for row t of every owner and reads their shards in place.

#include "device_signal.cuh"
#include "semantics.h"
#include "topk.h"

#include <ATen/cuda/CUDAContext.h>
#include <cub/block/block_radix_sort.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 1024;
constexpr int64_t kMaxSortKeys = 16384;  // 16 keys per thread

// Keys per thread for m candidates: the smallest power of two that fits.
int items_per_thread(int64_t m) {
  int items = 1;
  while (items * kThreads < m) items <<= 1;
  return items;
}

template <int kItems>
using BlockSort = cub::BlockRadixSort<uint64_t, kThreads, kItems>;

// Sorts the block's keys descending (a blocked arrangement: thread t holds
// positions [t * kItems, (t + 1) * kItems)) and writes the first k ids.
// `key_at(j)` gives candidate j's key, 0 past the end.
template <int kItems, typename KeyAt>
__device__ void sort_and_select(uint8_t* smem, KeyAt key_at, int64_t k, int32_t* out) {
  uint64_t keys[kItems];
#pragma unroll
  for (int e = 0; e < kItems; ++e) keys[e] = key_at(static_cast<int64_t>(threadIdx.x) * kItems + e);
  auto& temp = *reinterpret_cast<typename BlockSort<kItems>::TempStorage*>(smem);
  BlockSort<kItems>(temp).SortDescending(keys);
#pragma unroll
  for (int e = 0; e < kItems; ++e) {
    const int64_t pos = static_cast<int64_t>(threadIdx.x) * kItems + e;
    if (pos < k) out[pos] = topk_key_id(keys[e]);
  }
  for (int64_t pos = static_cast<int64_t>(kThreads) * kItems + threadIdx.x; pos < k; pos += kThreads) out[pos] = -1;
}

template <int kItems>
__global__ void __launch_bounds__(kThreads) topk_select_kernel(const float* scores, const int32_t* ids, int64_t s0,
                                                               int64_t i0, int64_t m, int64_t k, int32_t* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t t = blockIdx.x;
  sort_and_select<kItems>(
      smem, [&](int64_t j) { return j < m ? topk_key(scores[t * s0 + j], ids[t * i0 + j]) : uint64_t{0}; }, k,
      out + t * k);
}

template <int kItems>
__global__ void __launch_bounds__(kThreads) topk_merge_kernel(DeviceWorkspace ws, const float* scores,
                                                              const int32_t* ids, int64_t s0, int64_t i0,
                                                              int64_t rows, int64_t c, int64_t k, int32_t* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  const uint64_t epoch = block_next_epoch(ws);
  const int slot = epoch & 1;
  const int64_t t = blockIdx.x;
  auto shard_scores = [&](int r) { return reinterpret_cast<float*>(ws.slot_data(r, slot) + ws.part[0]) + t * c; };
  auto shard_ids = [&](int r) { return reinterpret_cast<int32_t*>(ws.slot_data(r, slot) + ws.part[1]) + t * c; };
  if (t < rows) {  // the owner writes its row once, into its own shard
    float* os = shard_scores(ws.rank);
    int32_t* oi = shard_ids(ws.rank);
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      os[j] = scores[t * s0 + j];
      oi[j] = ids[t * i0 + j];
    }
  }
  block_publish_all(ws, epoch);
  block_wait_all(ws, epoch);
  if (t < rows) {  // every consumer reads every owner's row in place
    const int64_t m = ws.world * c;
    sort_and_select<kItems>(
        smem,
        [&](int64_t j) {
          if (j >= m) return uint64_t{0};
          const int r = static_cast<int>(j / c);
          return topk_key(shard_scores(r)[j % c], shard_ids(r)[j % c]);
        },
        k, out + t * k);
  }
  block_commit_epoch(ws, epoch);
}

template <template <int> class Launch, typename... Args>
void dispatch_items(int items, Args&&... args) {
  switch (items) {
    case 1: Launch<1>::run(args...); break;
    case 2: Launch<2>::run(args...); break;
    case 4: Launch<4>::run(args...); break;
    case 8: Launch<8>::run(args...); break;
    default: Launch<16>::run(args...); break;
  }
}

void set_smem(const void* kernel, int64_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int kItems>
struct LaunchSelect {
  static void run(const at::Tensor& scores, const at::Tensor& ids, int64_t k, at::Tensor& out, cudaStream_t stream) {
    const int64_t smem = sizeof(typename BlockSort<kItems>::TempStorage);
    set_smem(reinterpret_cast<const void*>(topk_select_kernel<kItems>), smem);
    topk_select_kernel<kItems><<<scores.size(0), kThreads, smem, stream>>>(scores.data_ptr<float>(), ids.data_ptr<int32_t>(),
                                                       scores.stride(0), ids.stride(0), scores.size(1), k,
                                                       out.data_ptr<int32_t>());
  }
};

template <int kItems>
struct LaunchMerge {
  static void run(const Workspace& ws, const at::Tensor& scores, const at::Tensor& ids, int64_t k, at::Tensor& out,
                  cudaStream_t stream) {
    const int64_t smem = sizeof(typename BlockSort<kItems>::TempStorage);
    set_smem(reinterpret_cast<const void*>(topk_merge_kernel<kItems>), smem);
    // The grid is fixed by the workspace (max_rows blocks): per-block epochs.
    topk_merge_kernel<kItems><<<ws.layout.blocks, kThreads, smem, stream>>>(device_workspace(ws), scores.data_ptr<float>(),
                                                         ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0),
                                                         scores.size(0), scores.size(1), k, out.data_ptr<int32_t>());
  }
};

at::Tensor topk_select_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const int64_t rows = scores.size(0), m = scores.size(1);
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per row on CUDA", m);
  auto out = at::empty({rows, k}, ids.options());
  if (rows == 0) return out;
  const c10::cuda::CUDAGuard guard(scores.device());
  dispatch_items<LaunchSelect>(items_per_thread(m), scores, ids, k, out, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor topk_merge_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kTopK, scores);
  const Workspace& ws = *ws_ptr;
  check_topk_workspace(ws, scores, k);
  const int64_t m = ws.world_size * scores.size(1);
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores",
                 "at most " << kMaxSortKeys << " candidates per row over all ranks on CUDA", m);
  auto out = at::empty({scores.size(0), k}, ids.options());
  const c10::cuda::CUDAGuard guard(scores.device());
  dispatch_items<LaunchMerge>(items_per_thread(m), ws, scores, ids, k, out, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("topk_select", &topk_select_cuda);
  m.impl("topk_merge", &topk_merge_cuda);
}

}  // namespace sdcp
