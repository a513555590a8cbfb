// Host-backend equivalents of the device signals (data-as-flag, dataflag.h):
// the same buffers in the same shared memory, every wait bounded.
#pragma once

#include "sdcp.h"

#include <chrono>
#include <thread>

namespace sdcp {

// ---- Data-as-flag on the host backend --------------------------------------

// The call index of this rank's next call (one writer: this rank).
inline uint64_t host_call_index(const Workspace& ws) {
  return __atomic_load_n(&ws.control(ws.rank)->call_index[0], __ATOMIC_RELAXED);
}

inline void host_finish_call(const Workspace& ws, uint64_t call) {
  __atomic_store_n(&ws.control(ws.rank)->call_index[0], call + 1, __ATOMIC_RELAXED);
}

// Runs the pending Python signal handlers (Ctrl-C) from a host wait, with the
// GIL (failure.cpp); when one raises, aborts the workspace on every rank and
// rethrows its exception (KeyboardInterrupt), so that a wait ends at once.
void host_check_signals(const Workspace& ws, uint64_t call);

// How often a host wait runs the pending signal handlers.
constexpr auto kHostSignalPeriod = std::chrono::milliseconds(20);

// Records `e` as this rank's error, aborts the workspace on every rank
// (dataflag_abort) and throws its description.
[[noreturn]] inline void host_fail(const Workspace& ws, const DataFlagError& e) {
  dataflag_abort(ws, e);
  TORCH_CHECK(false, cat("torch_sdcp: ", describe_dataflag_error(ws, e)));
  __builtin_unreachable();
}

// Spins until `ready()` holds. Its slow path reads this rank's abort word and
// gives up at once when a peer aborted the workspace; after the workspace
// timeout it aborts the workspace itself. Either way it throws naming the
// rank, the peer, what it waited for (`wait`, DataFlagWait), the buffer and the
// call index.
template <typename Ready>
void host_spin(const Workspace& ws, int64_t src, uint64_t call, Ready ready, uint32_t wait = kWaitData) {
  if (ready()) return;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(ws.timeout_ns);
  const uint64_t* abort = &ws.control(ws.rank)->abort;
  auto signals_checked = start;
  for (uint64_t spins = 0;; ++spins) {
    // The abort word first: what its writer stored before aborting (its call
    // header, say) is then visible to ready(), and is used, not given up on.
    const uint64_t a = __atomic_load_n(abort, __ATOMIC_ACQUIRE);
    if (ready()) return;
    if (spins > 64) std::this_thread::yield();
    bool late = false;
    if ((spins & 255) == 0) {
      const auto now = std::chrono::steady_clock::now();
      late = now - start > limit;
      if (now - signals_checked > kHostSignalPeriod) {
        signals_checked = now;
        host_check_signals(ws, call);
      }
    }
    if (a == 0 && !late) continue;
    DataFlagError e{};
    e.block = -1;
    e.peer = static_cast<int32_t>(src);
    e.wait = wait;
    e.call = call;
    e.aborter = -1;
    if (a != 0) {
      e.state = kReasonPeerAbort;
      e.aborter = abort_word_rank(a);
      e.abort_reason = abort_word_reason(a);
    } else {
      e.state = kReasonTimeout;
    }
    host_fail(ws, e);
  }
}

// ---- Call headers (dataflag.h) ------------------------------------------

// Sentinel buffers: stores this rank's header into a peer's header entry
// before any payload word of the call.
inline void host_store_call_header(uint32_t* dst, const CallHeader& h) {
  for (uint32_t f = 0; f < kHeaderFields; ++f) __atomic_store_n(dst + f, h.w[f], __ATOMIC_RELAXED);
}

// Fails the call (and aborts the workspace on every rank) with a call
// mismatch in header field `field`: this rank's word and peer `src`'s.
[[noreturn]] inline void host_fail_mismatch(const Workspace& ws, int64_t src, uint64_t call, uint32_t field,
                                            uint32_t mine, uint32_t theirs, uint32_t wait) {
  DataFlagError e{};
  e.state = kReasonMismatch;
  e.block = -1;
  e.peer = static_cast<int32_t>(src);
  e.wait = wait;
  e.call = call;
  e.field = field;
  e.mine = mine;
  e.theirs = theirs;
  e.aborter = -1;
  host_fail(ws, e);
}

// Fails the call (and aborts the workspace on every rank) when `theirs`
// differs from `mine`, naming both sides; `wait` says which header (the
// call's, or the query view's); `op_bits` as for call_header_mismatch.
inline void host_compare_call_header(const Workspace& ws, int64_t src, uint64_t call, const CallHeader& mine,
                                     const CallHeader& theirs, uint32_t wait = kWaitHeader, uint32_t op_bits = 0) {
  const uint32_t f = call_header_mismatch(mine, theirs, op_bits);
  if (f == kHeaderFields) {
    if (header_is_void(theirs)) {  // the first void met stays until the host takes it
      uint64_t none = 0;
      __atomic_compare_exchange_n(ws.void_host, &none, void_word(src, call), false, __ATOMIC_RELEASE,
                                  __ATOMIC_RELAXED);
    }
    return;
  }
  host_fail_mismatch(ws, src, call, f, mine.w[f], theirs.w[f], wait);
}

// Sentinel buffers: waits for peer `src`'s header of this call, writes the
// sentinel back and compares it with this rank's. Take it before the
// payload: a rank with more rows must not wait for rows that never come.
inline void host_check_call_header(const Workspace& ws, int64_t src, uint64_t call, uint32_t* p,
                                   const CallHeader& mine) {
  CallHeader theirs;
  for (uint32_t f = 0; f < kHeaderFields; ++f) {
    host_spin(ws, src, call, [&] { return __atomic_load_n(p + f, __ATOMIC_ACQUIRE) != kSentinel; }, kWaitHeader);
    theirs.w[f] = __atomic_load_n(p + f, __ATOMIC_RELAXED);
    __atomic_store_n(p + f, kSentinel, __ATOMIC_RELAXED);
  }
  host_compare_call_header(ws, src, call, mine, theirs);
}

// Tagged buffers (the exchange): the header as kHeaderFields tagged words.
inline void host_store_call_header_tagged(uint64_t* dst, uint64_t tag, const CallHeader& h) {
  for (uint32_t f = 0; f < kHeaderFields; ++f) __atomic_store_n(dst + f, tag | h.w[f], __ATOMIC_RELAXED);
}

inline void host_check_call_header_tagged(const Workspace& ws, int64_t src, uint64_t call, const uint64_t* p,
                                          uint64_t tag, const CallHeader& mine) {
  CallHeader theirs;
  for (uint32_t f = 0; f < kHeaderFields; ++f) {
    uint64_t v = 0;
    host_spin(ws, src, call, [&] { return ((v = __atomic_load_n(p + f, __ATOMIC_ACQUIRE)) & ~0xFFFFFFFFull) == tag; },
              kWaitHeader);
    theirs.w[f] = static_cast<uint32_t>(v);
  }
  host_compare_call_header(ws, src, call, mine, theirs);
}

// Stores `count` payload words into a peer's buffer, rewriting the sentinel.
inline void host_store_payload(uint32_t* dst, const uint32_t* src, int64_t count, bool lse) {
  for (int64_t i = 0; i < count; ++i)
    __atomic_store_n(dst + i, lse ? canonical_lse_word(src[i]) : canonical_payload_word(src[i]), __ATOMIC_RELAXED);
}

// Waits until none of `count` words of a local buffer is the sentinel, copies
// them to `out` and writes the sentinel back.
inline void host_take_payload(const Workspace& ws, int64_t src, uint64_t call, uint32_t* buf, int64_t count,
                              uint32_t* out, uint32_t wait = kWaitData) {
  for (int64_t i = 0; i < count; ++i) {
    host_spin(ws, src, call, [&] { return __atomic_load_n(buf + i, __ATOMIC_ACQUIRE) != kSentinel; }, wait);
    out[i] = __atomic_load_n(buf + i, __ATOMIC_RELAXED);
    __atomic_store_n(buf + i, kSentinel, __ATOMIC_RELAXED);
  }
}

}  // namespace sdcp
