// Data-as-flag signalling on the GPU (lamport.h has the protocol): the call
// index, bounded polls of local buffers, and stores into peers' buffers.
#pragma once

#include "device_signal.cuh"
#include "lamport.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

namespace sdcp {

// Programmatic dependent launch (sm_90+): a kernel launched with
// launch_lamport may start while the previous kernel of the stream finishes;
// it waits here, before it reads anything, until that kernel has completed
// and its memory is visible. Then it lets the next kernel start its launch.
__device__ __forceinline__ void pdl_wait_and_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The call this kernel runs, read by every warp from its block's counter
// (lamport.h). Also advances the counters of the blocks this grid does not
// have (b + g, b + 2g, ...): no block of this grid reads them.
__device__ __forceinline__ uint64_t block_call_index(const DeviceWorkspace& ws) {
  pdl_wait_and_release();
  uint64_t* counters = ws.lamport_control()->call_index;
  uint64_t call = 0;
  if ((threadIdx.x & 31) == 0) call = *reinterpret_cast<volatile uint64_t*>(&counters[blockIdx.x]);
  call = __shfl_sync(0xffffffffu, call, 0);
  for (uint32_t j = blockIdx.x + gridDim.x * (threadIdx.x + 1); j < kLamportBlocks; j += gridDim.x * blockDim.x)
    counters[j] = call + 1;
  return call;
}

// Advances this block's own counter once every warp has read it. A plain
// store: the next call is another kernel (or waits in pdl_wait_and_release
// until this grid completed), and a fence here would wait for this thread's
// stores into peer memory to be acknowledged.
__device__ __forceinline__ void block_finish_call(const DeviceWorkspace& ws, uint64_t call) {
  __syncthreads();
  if (threadIdx.x == 0) ws.lamport_control()->call_index[blockIdx.x] = call + 1;
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return v.x == kSentinel || v.y == kSentinel || v.z == kSentinel || v.w == kSentinel;
}

__device__ __forceinline__ uint4 canonical_payload(uint4 v) {
  return make_uint4(canonical_payload_word(v.x), canonical_payload_word(v.y), canonical_payload_word(v.z),
                    canonical_payload_word(v.w));
}

// Reports a wait that ran out of time and traps (the stream fails with an
// error the host sees).
static __device__ __noinline__ void lamport_timeout(const DeviceWorkspace& ws, int src, uint64_t call) {
  printf("torch_sdcp: timeout: rank %d block %d waited %.3f s for peer %d's data (workspace %lld, buffer %d, "
         "call %llu); the peer stopped participating or calls differ between ranks\n",
         ws.rank, blockIdx.x, ws.timeout_ns * 1e-9, src, (long long)ws.handle, (int)(call % kLamportBuffers),
         (unsigned long long)call);
  __trap();
}

// Polls a 16-byte vector of a local buffer until no word is the sentinel.
__device__ __forceinline__ uint4 poll_vector(const DeviceWorkspace& ws, const uint4* p, int src, uint64_t call) {
  uint4 v = ld_volatile_v4(p);
  if (!has_sentinel(v)) return v;
  const uint64_t start = globaltimer_ns();
  do {
    if (globaltimer_ns() - start > ws.timeout_ns) lamport_timeout(ws, src, call);
    v = ld_volatile_v4(p);
  } while (has_sentinel(v));
  return v;
}

__device__ __forceinline__ uint32_t poll_word(const DeviceWorkspace& ws, const uint32_t* p, int src, uint64_t call) {
  uint32_t v = ld_volatile_u32(p);
  if (v != kSentinel) return v;
  const uint64_t start = globaltimer_ns();
  do {
    if (globaltimer_ns() - start > ws.timeout_ns) lamport_timeout(ws, src, call);
    v = ld_volatile_u32(p);
  } while (v == kSentinel);
  return v;
}

// Polls a tagged 64-bit word until it carries `tag` in its high half.
__device__ __forceinline__ uint32_t poll_tagged(const DeviceWorkspace& ws, const uint64_t* p, uint32_t tag, int src,
                                                uint64_t call) {
  uint64_t v = ld_volatile_u64(p);
  if (static_cast<uint32_t>(v >> 32) == tag) return static_cast<uint32_t>(v);
  const uint64_t start = globaltimer_ns();
  do {
    if (globaltimer_ns() - start > ws.timeout_ns) lamport_timeout(ws, src, call);
    v = ld_volatile_u64(p);
  } while (static_cast<uint32_t>(v >> 32) != tag);
  return static_cast<uint32_t>(v);
}

// Blocks for `items` of `items_per_block`, at most `per_sm` per SM and
// kLamportBlocks (every block of a data-as-flag kernel only waits for the
// same block of its peers, so the grid need not be co-resident; the cap keeps
// the launch small).
inline int lamport_grid(int64_t items, int64_t items_per_block, int device, int per_sm = 2) {
  static int sms[64] = {0};
  int& n = sms[device & 63];
  if (n == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = (items + items_per_block - 1) / items_per_block;
  const int64_t cap = std::min<int64_t>(static_cast<int64_t>(per_sm) * n, kLamportBlocks);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap)));
}

// Whether data-as-flag kernels use programmatic dependent launch on `device`
// (compute capability 9.0 or later, unless SDCP_PDL=0).
inline bool lamport_pdl(int device) {
  static int cached[64] = {0};  // 0 unknown, 1 no, 2 yes
  int& c = cached[device & 63];
  if (c == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    const char* env = std::getenv("SDCP_PDL");
    c = (major >= 9 && !(env && std::string(env) == "0")) ? 2 : 1;
  }
  return c == 2;
}

// Launches a data-as-flag kernel (its first step is block_call_index, which
// waits for the previous kernel where the launch is programmatic).
template <typename... KernelArgs, typename... Args>
void launch_lamport(void (*kernel)(KernelArgs...), int grid, int threads, cudaStream_t stream, int device,
                    Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = lamport_pdl(device) ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace sdcp
