// Failure handling of data-as-flag workspaces, CUDA side (dataflag.cuh): the
// host-mapped error record of each workspace, and the abort a host-side
// error stores into every rank's control region. Installed into
// dataflag_device_hooks() when the extension loads.

#include "dataflag.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <optional>

namespace sdcp {
namespace {

__global__ void store_abort_kernel(DeviceWorkspace ws, uint64_t word) {
  for (int r = threadIdx.x; r < ws.world; r += blockDim.x) {
    uint64_t* a = &reinterpret_cast<DataFlagControl*>(ws.region(r))->abort;
    if (ld_volatile_u64(a) == 0) st_volatile_u64(a, word);
  }
  __threadfence_system();
}

// Pinned, mapped host memory: the kernels write it (volatile stores and a
// system fence), the host reads it without synchronising a stream, during
// capture too. Null when the device cannot map host memory (then a timeout
// traps, as without this record).
std::shared_ptr<void> alloc_error(const c10::Device& device, DataFlagError** host, DataFlagError** dev) {
  // A device that cannot be made current (no driver: a machine without a GPU running a build with
  // the CUDA kernels) has no mapped record; the host record stands in, and no kernel runs there.
  std::optional<c10::cuda::CUDAGuard> guard;
  try {
    guard.emplace(device);
  } catch (const c10::Error&) {
    (void)cudaGetLastError();
    return nullptr;
  }
  void* h = nullptr;
  if (cudaHostAlloc(&h, sizeof(DataFlagRecords), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  void* d = nullptr;
  if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFreeHost(h);
    return nullptr;
  }
  std::memset(h, 0, sizeof(DataFlagRecords));
  // Load the abort kernel (and make the side streams) now: under lazy loading
  // (the default since CUDA 12.2) its first launch waits for this context to
  // go idle, which never happens while a kernel of this workspace waits for a
  // peer that died, so the watcher's abort would arrive only with the timeout.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()), &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusNone) {
    auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index());
    store_abort_kernel<<<1, 1, 0, side.stream()>>>(DeviceWorkspace{}, 0);  // world 0: stores nothing
  }
  (void)cudaGetLastError();
  *host = static_cast<DataFlagError*>(h);
  *dev = static_cast<DataFlagError*>(d);
  // cudaFreeHost waits for the device, so no kernel still writes the record.
  return std::shared_ptr<void>(h, [](void* p) { cudaFreeHost(p); });
}

// On a high-priority side stream, so that it runs beside a kernel of this
// workspace that is still waiting (its grid leaves room on the SMs); never
// while the current stream is being captured (nothing may be launched into
// or beside a capture here), where the local record alone poisons.
void store_abort(const Workspace& ws, uint64_t word) {
  const c10::cuda::CUDAGuard guard(ws.device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(ws.device.index()), &status) != cudaSuccess ||
      status != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return;
  }
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, ws.device.index());
  store_abort_kernel<<<1, 64, 0, side.stream()>>>(device_workspace(ws), word);
  (void)cudaGetLastError();  // best effort: the peers time out otherwise
}

// Off the current stream, which may be waiting in a kernel of this
// workspace; a non-blocking side stream, so that no other stream's kernel
// (one waiting for a peer, say) delays the copy.
void read(const Workspace& ws, void* dst, const void* src, size_t bytes) {
  const c10::cuda::CUDAGuard guard(ws.device);
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, ws.device.index());
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, side.stream()));
  C10_CUDA_CHECK(cudaStreamSynchronize(side.stream()));
}

struct Install {
  Install() {
    dataflag_device_hooks().alloc_error = &alloc_error;
    dataflag_device_hooks().store_abort = &store_abort;
    dataflag_device_hooks().read = &read;
  }
} install;

}  // namespace
}  // namespace sdcp
