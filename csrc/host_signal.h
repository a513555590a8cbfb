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

// Publish epoch `epoch` into rank `dst`'s flag for (slot, this rank, block).
// Every store of this thread made before it is ordered before the flag.
inline void host_publish(const Workspace& ws, int64_t dst, uint64_t epoch, int64_t block = 0) {
  __atomic_store_n(ws.flag(dst, epoch & 1, ws.rank, block), epoch, __ATOMIC_RELEASE);
}

// Wait until rank `src` published `epoch` (or later) into our flag; throws
// with rank, peer, slot and epoch after the workspace timeout.
inline void host_wait(const Workspace& ws, int64_t src, uint64_t epoch, int64_t block = 0) {
  const uint64_t* f = ws.flag(ws.rank, epoch & 1, src, block);
  if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= epoch) return;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(ws.timeout_ns);
  for (uint64_t spins = 0;; ++spins) {
    if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= epoch) return;
    if (spins > 64) std::this_thread::yield();
    if ((spins & 255) == 0 && std::chrono::steady_clock::now() - start > limit) {
      TORCH_CHECK(false, cat("torch_sdcp: timeout: rank ", ws.rank, " waited ",
                  ws.timeout_ns / 1e9, " s for peer ", src, " (", kind_name(ws.kind),
                  " workspace ", ws.handle, ", slot ", epoch & 1, ", epoch ", epoch,
                  ", flag holds ", __atomic_load_n(f, __ATOMIC_ACQUIRE),
                  "); the peer stopped participating or calls differ between ranks"));
    }
  }
}

}  // namespace sdcp
