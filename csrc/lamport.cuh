// Data-as-flag signalling on the GPU (lamport.h has the protocol): the call
// index, bounded polls of local buffers, and stores into peers' buffers.
#pragma once

#include "device_signal.cuh"
#include "lamport.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace sdcp {

// The call this kernel runs (every thread of the block gets it).
__device__ __forceinline__ uint64_t block_call_index(const DeviceWorkspace& ws) {
  __shared__ uint64_t call;
  if (threadIdx.x == 0) call = *reinterpret_cast<volatile uint64_t*>(&ws.lamport_control()->call_index);
  __syncthreads();
  return call;
}

// The last block of the grid to finish advances the call index: every block
// read it (and used the value) before it arrived, so none can see the next
// value. No fence: the next call is another kernel, and a fence here would
// wait for this thread's stores into peer memory to be acknowledged.
__device__ __forceinline__ void block_finish_call(const DeviceWorkspace& ws, uint64_t call) {
  __syncthreads();
  if (threadIdx.x == 0) {
    LamportControl* c = ws.lamport_control();
    if (atomicAdd(&c->arrived, 1u) == gridDim.x - 1) {
      c->arrived = 0;
      *reinterpret_cast<volatile uint64_t*>(&c->call_index) = call + 1;
    }
  }
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

// Blocks for `items` of `items_per_block`, at most two per SM (every block
// of a data-as-flag kernel only waits for the same block of its peers, so the
// grid need not be co-resident; the cap keeps the launch small).
inline int lamport_grid(int64_t items, int64_t items_per_block, int device) {
  static int sms[64] = {0};
  int& n = sms[device & 63];
  if (n == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = (items + items_per_block - 1) / items_per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, 2 * n)));
}

}  // namespace sdcp
