// Signalling primitive, CUDA: peer all-gather through a workspace. Block b
// stores chunk b of x into every rank's inbox, publishes one flag per
// destination, waits for chunk b of every source, copies it out.

#include "device_signal.cuh"
#include "exchange.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

template <typename vec_t>
__device__ void copy_chunk(const uint8_t* src, uint8_t* dst, int64_t begin, int64_t end) {
  const auto* s = reinterpret_cast<const vec_t*>(src);
  auto* d = reinterpret_cast<vec_t*>(dst);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) d[i] = s[i];
}

template <typename vec_t>
__global__ void peer_all_gather_kernel(DeviceWorkspace ws, const uint8_t* x, uint8_t* out, int64_t nvec,
                                       int64_t per_src) {
  const uint64_t epoch = block_next_epoch(ws);
  const int slot = epoch & 1;
  const int64_t per_block = (nvec + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(nvec, blockIdx.x * per_block), end = min(nvec, begin + per_block);
  for (int d = 0; d < ws.world; ++d)
    copy_chunk<vec_t>(x, ws.slot_data(d, slot) + ws.rank * per_src, begin, end);
  block_publish_all(ws, epoch);
  block_wait_all(ws, epoch);
  const int64_t nbytes = nvec * sizeof(vec_t);
  for (int s = 0; s < ws.world; ++s)
    copy_chunk<vec_t>(ws.slot_data(ws.rank, slot) + s * per_src, out + s * nbytes, begin, end);
  block_commit_epoch(ws, epoch);
}

void all_gather_cuda(const AllGatherCall& c, const at::Tensor& x) {
  const Workspace& ws = *c.ws;
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto dws = device_workspace(ws);
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(c.out.data_ptr());
  const int64_t nbytes = c.nbytes, per_src = c.geo.source_bytes;
  const bool vec16 = nbytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  // The grid is fixed by the workspace: per-block epochs must advance together.
  if (vec16) {
    peer_all_gather_kernel<uint4><<<ws.layout.blocks, 256, 0, stream>>>(dws, src, dst, nbytes / 16, per_src);
  } else {
    peer_all_gather_kernel<uint8_t><<<ws.layout.blocks, 256, 0, stream>>>(dws, src, dst, nbytes, per_src);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("peer_all_gather", &peer_all_gather_op<all_gather_cuda>);
}

}  // namespace sdcp
