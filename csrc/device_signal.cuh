// Device-side signals (docs/DESIGN.md section 4): epochs advanced by the kernels,
// slot = epoch % 2 (or one acknowledged slot), publish = all writers' stores
// -> __syncthreads() -> one st.release.sys per destination flag, wait =
// ld.acquire.sys spin on a local flag bounded by %globaltimer ->
// __syncthreads(). docs/PROTOCOL.md has the argument.
#pragma once

#include "sdcp.h"

#include <cstdint>
#include <cstdio>

namespace sdcp {

// A workspace as the kernels see it (passed by value).
struct DeviceWorkspace {
  uint8_t* base;
  int64_t stride;
  int64_t data_offset;
  int64_t slot_bytes;
  int64_t handle;
  uint64_t timeout_ns;
  int32_t rank;
  int32_t world;
  int32_t blocks;
  int32_t slots;
  // Data-as-flag workspaces: this rank's error record in host-mapped memory
  // (lamport.h), or null (a timeout then traps).
  LamportError* error;

  __device__ __forceinline__ uint8_t* region(int r) const { return base + r * stride; }
  __device__ __forceinline__ uint64_t* epoch(int block) const {
    return reinterpret_cast<uint64_t*>(region(rank)) + block;
  }
  // flags[set][src][block] in rank r's region.
  __device__ __forceinline__ uint64_t* flag(int r, int set, int src, int block) const {
    return reinterpret_cast<uint64_t*>(region(r) + 8 * blocks) + (set * world + src) * blocks + block;
  }
  // Data slot and "ready" flag set of epoch e (Workspace::slot_of / ready_set).
  __device__ __forceinline__ int slot_of(uint64_t e) const { return slots == 2 ? static_cast<int>(e & 1) : 0; }
  __device__ __forceinline__ int ready_set(uint64_t e) const { return slots == 2 ? static_cast<int>(e & 1) : 0; }
  __device__ __forceinline__ uint8_t* slot_data(int r, int slot) const {
    return region(r) + data_offset + slot * slot_bytes;
  }
  // Data-as-flag workspaces (lamport.h): this rank's control, the buffer of a
  // call in rank r's region, and where a destination keeps a source's entry.
  __device__ __forceinline__ LamportControl* lamport_control() const {
    return reinterpret_cast<LamportControl*>(region(rank));
  }
  __device__ __forceinline__ uint8_t* buffer(int r, uint64_t call) const {
    return slot_data(r, static_cast<int>(call % kLamportBuffers));
  }
  // (src - dst - 1) mod world, for ranks src != dst in [0, world)
  __device__ __forceinline__ int peer_slot(int src, int dst) const {
    const int x = src - dst - 1 + world;
    return x >= world ? x - world : x;
  }
};

inline DeviceWorkspace device_workspace(const Workspace& ws) {
  DeviceWorkspace d;
  d.base = reinterpret_cast<uint8_t*>(ws.base);
  d.stride = ws.stride;
  d.data_offset = ws.layout.data_offset;
  d.slot_bytes = ws.layout.slot_bytes;
  d.handle = ws.handle;
  d.timeout_ns = static_cast<uint64_t>(ws.timeout_ns);
  d.rank = static_cast<int32_t>(ws.rank);
  d.world = static_cast<int32_t>(ws.world_size);
  d.blocks = static_cast<int32_t>(ws.layout.blocks);
  d.slots = static_cast<int32_t>(ws.layout.slots);
  d.error = ws.error_device;
  return d;
}

// The CUDA kernels hold per-rank arrays of kMaxDeviceWorld entries.
inline void check_device_world(const Workspace& ws) {
  SDCP_CHECK_ARG(ws.world_size <= kMaxDeviceWorld, "workspace", "a world size of at most " << kMaxDeviceWorld
                 << " on CUDA", ws.world_size);
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Reads this block's next epoch (every thread gets it). One writer per
// counter: the block itself, in block_commit_epoch.
__device__ __forceinline__ uint64_t block_next_epoch(const DeviceWorkspace& ws) {
  __shared__ uint64_t next;
  if (threadIdx.x == 0) next = *ws.epoch(blockIdx.x) + 1;
  __syncthreads();
  return next;
}

__device__ __forceinline__ void block_commit_epoch(const DeviceWorkspace& ws, uint64_t epoch) {
  if (threadIdx.x == 0) *ws.epoch(blockIdx.x) = epoch;
}

// Thread s spins until flag `f` (written by peer s) holds at least `value`;
// on timeout it reports rank, block, peer, what it awaited, slot and epoch and
// traps, which fails the stream with an error the host sees.
__device__ __forceinline__ void wait_flag(const DeviceWorkspace& ws, const uint64_t* f, int s, uint64_t value,
                                          const char* what) {
  if (ld_acquire_sys(f) >= value) return;
  const uint64_t start = globaltimer_ns();
  while (ld_acquire_sys(f) < value) {
    if (globaltimer_ns() - start > ws.timeout_ns) {
      printf("torch_sdcp: timeout: rank %d block %d waited %.3f s for peer %d to %s (workspace %lld, slot %d, "
             "epoch %llu, flag holds %llu); the peer stopped participating or calls differ between ranks\n",
             ws.rank, blockIdx.x, ws.timeout_ns * 1e-9, s, what, (long long)ws.handle, ws.slot_of(value),
             (unsigned long long)value, (unsigned long long)ld_acquire_sys(f));
      __trap();
    }
  }
}

// Every thread's stores so far are ordered before the flags this block sets in
// every destination (thread d publishes to destination d).
__device__ __forceinline__ void block_publish_all(const DeviceWorkspace& ws, uint64_t epoch) {
  __syncthreads();
  for (int d = threadIdx.x; d < ws.world; d += blockDim.x)
    st_release_sys(ws.flag(d, ws.ready_set(epoch), ws.rank, blockIdx.x), epoch);
}

// Thread s waits for source s's publish of `epoch`, then the block barriers.
__device__ __forceinline__ void block_wait_all(const DeviceWorkspace& ws, uint64_t epoch) {
  for (int s = threadIdx.x; s < ws.world; s += blockDim.x)
    wait_flag(ws, ws.flag(ws.rank, ws.ready_set(epoch), s, blockIdx.x), s, epoch, "publish");
  __syncthreads();
}

// One-slot workspaces. After the block's reads of epoch `epoch` (and a
// barrier), tell every writer that this rank is done with it.
__device__ __forceinline__ void block_ack_all(const DeviceWorkspace& ws, uint64_t epoch) {
  __syncthreads();
  for (int d = threadIdx.x; d < ws.world; d += blockDim.x)
    st_release_sys(ws.flag(d, kAckSet, ws.rank, blockIdx.x), epoch);
}

// Before writing epoch `epoch`: every reader has acknowledged `epoch - 1`.
// The block's last warp polls, so that warps which arrive later (still
// producing) overlap the wait.
__device__ __forceinline__ void block_wait_acks(const DeviceWorkspace& ws, uint64_t epoch) {
  const int first = blockDim.x > 32 ? static_cast<int>(blockDim.x) - 32 : 0;
  for (int s = static_cast<int>(threadIdx.x) - first; s >= 0 && s < ws.world; s += 32)
    wait_flag(ws, ws.flag(ws.rank, kAckSet, s, blockIdx.x), s, epoch - 1,
              "finish reading (acknowledge) the previous epoch");
  __syncthreads();
}

}  // namespace sdcp
