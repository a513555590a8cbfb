// A workspace as the CUDA kernels see it, and the basic device accesses the
// data-as-flag protocol (dataflag.cuh) and the query view's release flags are
// built on. docs/PROTOCOL.md has the protocol and its argument.
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
  // Data-as-flag workspaces: this rank's error record in host-mapped memory
  // (dataflag.h), or null (a timeout then traps).
  DataFlagError* error;
  // This rank's void word (dataflag.h void_word) in the same memory, or null.
  uint64_t* voided;

  __device__ __forceinline__ uint8_t* region(int r) const { return base + r * stride; }
  __device__ __forceinline__ uint8_t* slot_data(int r, int slot) const {
    return region(r) + data_offset + slot * slot_bytes;
  }
  // Data-as-flag workspaces (dataflag.h): this rank's control, the buffer of a
  // call in rank r's region, and where a destination keeps a source's entry.
  __device__ __forceinline__ DataFlagControl* dataflag_control() const {
    return reinterpret_cast<DataFlagControl*>(region(rank));
  }
  __device__ __forceinline__ uint8_t* buffer(int r, uint64_t call) const {
    return slot_data(r, static_cast<int>(call % kDataFlagBuffers));
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
  d.error = ws.error_device;
  d.voided = ws.void_device;
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

}  // namespace sdcp
