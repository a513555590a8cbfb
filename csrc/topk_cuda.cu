// Top-K boundary, CUDA. One block per row: the candidates become 64-bit keys
// (semantics.h) in shared memory and a bitonic sort orders them, so the ids
// come out in selection order. The peer merge runs on a fixed grid of
// max_rows blocks: block t writes the owner's row t into its own shard,
// publishes, waits for row t of every owner and reads their shards in place.

#include "device_signal.cuh"
#include "semantics.h"
#include "topk.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 1024;
constexpr int64_t kMaxSortKeys = 16384;  // 128 KiB of shared memory

int64_t sort_size(int64_t m) {
  int64_t p = 1;
  while (p < m) p <<= 1;
  return p;
}

// Sorts keys[0, p) descending; p is a power of two.
__device__ void bitonic_sort_desc(uint64_t* keys, int64_t p) {
  for (int64_t k = 2; k <= p; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      for (int64_t i = threadIdx.x; i < p; i += blockDim.x) {
        const int64_t x = i ^ j;
        if (x > i) {
          const uint64_t a = keys[i], b = keys[x];
          const bool desc = (i & k) == 0;
          if (desc ? a < b : a > b) {
            keys[i] = b;
            keys[x] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

__device__ void write_selection(const uint64_t* keys, int64_t m, int64_t k, int32_t* out) {
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) out[i] = i < m ? topk_key_id(keys[i]) : -1;
}

__global__ void topk_select_kernel(const float* scores, const int32_t* ids, int64_t s0, int64_t i0, int64_t m,
                                   int64_t p, int64_t k, int32_t* out) {
  extern __shared__ uint64_t keys[];
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < p; j += blockDim.x)
    keys[j] = j < m ? topk_key(scores[t * s0 + j], ids[t * i0 + j]) : 0;
  __syncthreads();
  bitonic_sort_desc(keys, p);
  write_selection(keys, m, k, out + t * k);
}

__global__ void topk_merge_kernel(DeviceWorkspace ws, const float* scores, const int32_t* ids, int64_t s0,
                                  int64_t i0, int64_t rows, int64_t c, int64_t p, int64_t k, int32_t* out) {
  extern __shared__ uint64_t keys[];
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
  if (t < rows) {
    const int64_t m = ws.world * c;
    for (int64_t j = threadIdx.x; j < p; j += blockDim.x) {
      uint64_t key = 0;
      if (j < m) {
        const int r = static_cast<int>(j / c);
        key = topk_key(shard_scores(r)[j % c], shard_ids(r)[j % c]);
      }
      keys[j] = key;
    }
    __syncthreads();
    bitonic_sort_desc(keys, p);
    write_selection(keys, m, k, out + t * k);
  }
  block_commit_epoch(ws, epoch);
}

void set_smem(const void* kernel, int64_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

at::Tensor topk_select_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const int64_t rows = scores.size(0), m = scores.size(1);
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per row on CUDA", m);
  auto out = at::empty({rows, k}, ids.options());
  if (rows == 0) return out;
  const c10::cuda::CUDAGuard guard(scores.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t p = sort_size(std::max<int64_t>(m, 1));
  set_smem(reinterpret_cast<const void*>(&topk_select_kernel), p * 8);
  topk_select_kernel<<<rows, kThreads, p * 8, stream>>>(scores.data_ptr<float>(), ids.data_ptr<int32_t>(),
                                                         scores.stride(0), ids.stride(0), m, p, k,
                                                         out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor topk_merge_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kTopK, scores);
  const Workspace& ws = *ws_ptr;
  check_topk_workspace(ws, scores, k);
  const int64_t rows = scores.size(0), c = scores.size(1), m = ws.world_size * c;
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per row over all ranks on CUDA",
                 m);
  auto out = at::empty({rows, k}, ids.options());
  const c10::cuda::CUDAGuard guard(scores.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t p = sort_size(m);
  set_smem(reinterpret_cast<const void*>(&topk_merge_kernel), p * 8);
  topk_merge_kernel<<<ws.layout.blocks, kThreads, p * 8, stream>>>(
      device_workspace(ws), scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0),
      rows, c, p, k, out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("topk_select", &topk_select_cuda);
  m.impl("topk_merge", &topk_merge_cuda);
}

}  // namespace sdcp
