// Host-backend equivalents of the device signals: the same flags in the same
// shared memory, published with a release store and awaited with acquire
// loads, every wait bounded.
#pragma once

#include "sdcp.h"

#include <chrono>
#include <thread>

namespace sdcp {

inline uint64_t host_next_epoch(const Workspace& ws, int64_t block = 0) {
  return ws.epochs(ws.rank)[block] + 1;  // local counter, one writer: this rank
}

inline void host_commit_epoch(const Workspace& ws, uint64_t epoch, int64_t block = 0) {
  __atomic_store_n(&ws.epochs(ws.rank)[block], epoch, __ATOMIC_RELAXED);
}

namespace detail {

// Spins until `f` holds at least `value`; throws after the workspace timeout
// with rank, peer, what was awaited, slot and epoch.
inline void host_wait_flag(const Workspace& ws, const uint64_t* f, int64_t src, uint64_t value,
                           const char* what) {
  if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= value) return;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(ws.timeout_ns);
  for (uint64_t spins = 0;; ++spins) {
    if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= value) return;
    if (spins > 64) std::this_thread::yield();
    if ((spins & 255) == 0 && std::chrono::steady_clock::now() - start > limit) {
      TORCH_CHECK(false, cat("torch_sdcp: timeout: rank ", ws.rank, " waited ",
                  ws.timeout_ns / 1e9, " s for peer ", src, " to ", what, " (", kind_name(ws.kind),
                  " workspace ", ws.handle, ", slot ", ws.slot_of(value), ", epoch ", value,
                  ", flag holds ", __atomic_load_n(f, __ATOMIC_ACQUIRE),
                  "); the peer stopped participating or calls differ between ranks"));
    }
  }
}

}  // namespace detail

// Publish epoch `epoch` into rank `dst`'s ready flag for (this rank, block).
// Every store of this thread made before it is ordered before the flag.
inline void host_publish(const Workspace& ws, int64_t dst, uint64_t epoch, int64_t block = 0) {
  __atomic_store_n(ws.flag(dst, ws.ready_set(epoch), ws.rank, block), epoch, __ATOMIC_RELEASE);
}

// Wait until rank `src` published `epoch` (or later) into our flag.
inline void host_wait(const Workspace& ws, int64_t src, uint64_t epoch, int64_t block = 0) {
  detail::host_wait_flag(ws, ws.flag(ws.rank, ws.ready_set(epoch), src, block), src, epoch, "publish");
}

// One-slot workspaces: tell rank `dst` that this rank finished reading epoch
// `epoch` (every load of this thread before it is ordered before the flag).
inline void host_ack(const Workspace& ws, int64_t dst, uint64_t epoch, int64_t block = 0) {
  __atomic_store_n(ws.flag(dst, kAckSet, ws.rank, block), epoch, __ATOMIC_RELEASE);
}

// Before writing epoch `epoch` into a one-slot workspace: wait until rank
// `src` has finished reading epoch `epoch - 1`.
inline void host_wait_ack(const Workspace& ws, int64_t src, uint64_t epoch, int64_t block = 0) {
  detail::host_wait_flag(ws, ws.flag(ws.rank, kAckSet, src, block), src, epoch - 1,
                         "finish reading (acknowledge) the previous epoch");
}

// ---- Data-as-flag (Protocol::kLamport) on the host backend ---------------

// The call index of this rank's next call (one writer: this rank).
inline uint64_t host_call_index(const Workspace& ws) {
  return __atomic_load_n(&ws.lamport(ws.rank)->call_index[0], __ATOMIC_RELAXED);
}

inline void host_finish_call(const Workspace& ws, uint64_t call) {
  __atomic_store_n(&ws.lamport(ws.rank)->call_index[0], call + 1, __ATOMIC_RELAXED);
}

// Spins until `ready()` holds; throws after the workspace timeout naming the
// rank, the peer, the buffer and the call index.
template <typename Ready>
void host_spin(const Workspace& ws, int64_t src, uint64_t call, Ready ready) {
  if (ready()) return;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(ws.timeout_ns);
  for (uint64_t spins = 0;; ++spins) {
    if (ready()) return;
    if (spins > 64) std::this_thread::yield();
    if ((spins & 255) == 0 && std::chrono::steady_clock::now() - start > limit) {
      TORCH_CHECK(false, cat("torch_sdcp: timeout: rank ", ws.rank, " waited ", ws.timeout_ns / 1e9,
                  " s for peer ", src, "'s data (", kind_name(ws.kind), " workspace ", ws.handle, ", buffer ",
                  call % kLamportBuffers, ", call ", call,
                  "); the peer stopped participating or calls differ between ranks"));
    }
  }
}

// Stores `count` payload words into a peer's buffer, rewriting the sentinel.
inline void host_store_payload(uint32_t* dst, const uint32_t* src, int64_t count, bool lse) {
  for (int64_t i = 0; i < count; ++i)
    __atomic_store_n(dst + i, lse ? canonical_lse_word(src[i]) : canonical_payload_word(src[i]), __ATOMIC_RELAXED);
}

// Waits until none of `count` words of a local buffer is the sentinel, copies
// them to `out` and writes the sentinel back.
inline void host_take_payload(const Workspace& ws, int64_t src, uint64_t call, uint32_t* buf, int64_t count,
                              uint32_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    host_spin(ws, src, call, [&] { return __atomic_load_n(buf + i, __ATOMIC_ACQUIRE) != kSentinel; });
    out[i] = __atomic_load_n(buf + i, __ATOMIC_RELAXED);
    __atomic_store_n(buf + i, kSentinel, __ATOMIC_RELAXED);
  }
}

}  // namespace sdcp
