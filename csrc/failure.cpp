// Failure handling of data-as-flag workspaces (sdcp.h): the text of an error
// record, the abort, and the health check every op runs.

#include <Python.h>  // first, as Python requires
#include <pybind11/pybind11.h>

#include "host_signal.h"
#include "sdcp.h"

#include <atomic>
#include <cstring>

namespace sdcp {

DataFlagDeviceHooks& dataflag_device_hooks() {
  static DataFlagDeviceHooks hooks;
  return hooks;
}

namespace {

// One side of a mismatch, in the words of the workspace's family.
std::string header_value(const Workspace& ws, uint32_t field, uint32_t v) {
  const FamilyInfo& f = family(ws.kind);
  switch (field) {
    case kHeaderRows:
      return cat(v, f.rows_unit);
    case kHeaderDtype:
      v &= ~(kHeaderVoidBit | kHeaderTagMask);  // the dtype alone (a void call's: the dtype it stands for)
      if (v < static_cast<uint32_t>(c10::ScalarType::NumOptions))
        return cat("dtype ", c10::toString(static_cast<c10::ScalarType>(v)));
      return cat("dtype code ", v);
    case kHeaderFlags:
      return f.flags_text != nullptr ? f.flags_text(v) : cat("flags ", hex32(v));
    default:
      return cat("a workspace of geometry hash ", hex32(v), " (kind, world size and parameters)");
  }
}

// One side of a call-tag mismatch.
std::string tag_text(uint32_t v) {
  const uint32_t t = (v & kHeaderTagMask) >> kHeaderTagShift;
  return t == 0 ? std::string("no call tag") : cat("call tag ", t - 1);
}

const char* reason_text(const Workspace& ws, uint32_t reason) {
  switch (reason) {
    case kReasonTimeout: return "it timed out waiting for a peer";
    case kReasonMismatch: return "its call differs from a peer's (call mismatch)";
    case kReasonError: return "a call raised an error on that rank after the call was entered";
    case kReasonBadInput: {
      const char* r = family(ws.kind).bad_input_reason;
      return r != nullptr ? r : "a kernel on that rank met bad input";
    }
    default: return "unknown reason";
  }
}

std::string call_text(uint64_t call) { return call == ~uint64_t{0} ? std::string("unknown") : std::to_string(call); }

std::string where(const Workspace& ws, const DataFlagError& e) {
  const FamilyInfo& f = family(ws.kind);
  if (dataflag_wait_is_view(e.wait) && f.view_where != nullptr)  // one buffer, its own call index
    return cat(f.name, " workspace ", ws.handle, ", ", f.view_where(e.call));
  return cat(f.name, " workspace ", ws.handle, ", buffer ",
             e.call == ~uint64_t{0} ? std::string("unknown") : std::to_string(e.call % kDataFlagBuffers), ", call ",
             call_text(e.call));
}

std::string block_text(const DataFlagError& e) { return e.block >= 0 ? cat(" block ", e.block) : std::string(); }

const char* wait_text(uint32_t wait) { return dataflag_wait_is_header(wait) ? "call header" : "data"; }

bool is_view_release(const Workspace& ws, uint32_t wait) {
  return wait == kWaitViewRelease && family(ws.kind).view_release_wait != nullptr;
}

// "peer 1's data", "peer 1 to release the previous view call"
std::string waited_for(const Workspace& ws, int64_t peer, uint32_t wait) {
  if (is_view_release(ws, wait)) return cat("peer ", peer, " ", family(ws.kind).view_release_wait);
  return cat("peer ", peer, "'s ", wait_text(wait));
}

}  // namespace

std::string describe_dataflag_error(const Workspace& ws, const DataFlagError& e) {
  switch (e.state) {
    case kReasonTimeout:
      if (is_view_release(ws, e.wait))
        return cat("timeout: rank ", ws.rank, block_text(e), " waited ", ws.timeout_ns / 1e9, " s for ",
                   waited_for(ws, e.peer, e.wait), " (", where(ws, e), "); ", family(ws.kind).view_release_hint);
      return cat("timeout: rank ", ws.rank, block_text(e), " waited ", ws.timeout_ns / 1e9, " s for ",
                 waited_for(ws, e.peer, e.wait), " (", where(ws, e), "); ",
                 dataflag_wait_is_header(e.wait)
                     ? "the peer did not enter this call: it stopped participating, skipped the call, or took the "
                       "collective path (rows > max_rows) while this rank took the peer path"
                     : "the peer stopped participating, skipped the call, took the collective path (rows > "
                       "max_rows), or calls differ between ranks");
    case kReasonMismatch: {
      const bool me_first = ws.rank < e.peer;
      const int64_t a = me_first ? ws.rank : e.peer, b = me_first ? e.peer : ws.rank;
      const uint32_t va = me_first ? e.mine : e.theirs, vb = me_first ? e.theirs : e.mine;
      // Another call (its tag differs): named by the tags, whatever else differs.
      if (e.field == kHeaderDtype && (header_dtype_difference(va, vb) & kHeaderTagMask) != 0)
        return cat("call mismatch (", where(ws, e), "): rank ", a, " called with ", tag_text(va), ", rank ", b,
                   " with ", tag_text(vb),
                   "; every rank must make the same calls in the same order (a call skipped, added or reordered "
                   "on one rank)");
      return cat("call mismatch (", where(ws, e), "): rank ", a, " called with ", header_value(ws, e.field, va),
                 ", rank ", b, " with ", header_value(ws, e.field, vb),
                 "; every rank must make the same calls with the same shapes, dtypes and options");
    }
    case kReasonError:
      return cat("rank ", ws.rank, " abandoned a call (", where(ws, e), ") after an error was raised in it");
    case kReasonBadInput: {
      const FamilyInfo& f = family(ws.kind);
      return cat("bad input on rank ", ws.rank, block_text(e), " (", where(ws, e), "): ",
                 f.bad_input_text != nullptr ? f.bad_input_text(e) : cat("at row ", e.field));
    }
    case kReasonPeerAbort: {
      std::string s = cat("peer ", e.aborter, " aborted: ", reason_text(ws, e.abort_reason));
      if (e.peer >= 0)
        s += cat("; rank ", ws.rank, block_text(e), " waited for ", waited_for(ws, e.peer, e.wait), " (",
                 where(ws, e), ")");
      else
        s += cat(" (", kind_name(ws.kind), " workspace ", ws.handle, ")");
      return s;
    }
    default:
      return cat("error record state ", e.state);
  }
}

void dataflag_abort(const Workspace& ws, const DataFlagError& e) {
  if (__atomic_load_n(&ws.error->state, __ATOMIC_ACQUIRE) == kReasonNone) {
    DataFlagError r = e;
    const uint32_t state = r.state;
    r.state = kReasonNone;
    std::memcpy(static_cast<void*>(ws.error), &r, sizeof(r));
    __atomic_store_n(&ws.error->state, state, __ATOMIC_RELEASE);
  }
  if (e.state == kReasonPeerAbort) return;  // the aborter told everyone
  const uint64_t word = dataflag_abort_word(ws.rank, e.state);
  if (ws.device.is_cpu()) {
    for (int64_t r = 0; r < ws.world_size; ++r) {
      uint64_t expected = 0;
      __atomic_compare_exchange_n(&ws.control(r)->abort, &expected, word, false, __ATOMIC_RELEASE,
                                  __ATOMIC_RELAXED);
    }
  } else if (dataflag_device_hooks().store_abort != nullptr) {
    dataflag_device_hooks().store_abort(ws, word);
  }
}

void check_workspace_health(const Workspace& ws) {
  uint32_t state = __atomic_load_n(&ws.error->state, __ATOMIC_ACQUIRE);
  if (state == kReasonNone && ws.device.is_cpu()) {
    const uint64_t a = __atomic_load_n(&ws.control(ws.rank)->abort, __ATOMIC_ACQUIRE);
    if (a != 0) {
      DataFlagError e{};
      e.state = kReasonPeerAbort;
      e.block = -1;
      e.peer = -1;
      e.call = __atomic_load_n(&ws.control(ws.rank)->call_index[0], __ATOMIC_RELAXED);
      e.aborter = abort_word_rank(a);
      e.abort_reason = abort_word_reason(a);
      dataflag_abort(ws, e);
      state = kReasonPeerAbort;
    }
  }
  // CUDA: without an own failure, a peer's abort a kernel recorded (dataflag.cuh record_failure).
  const DataFlagError* record = ws.error;
  if (state == kReasonNone) {
    record = &reinterpret_cast<const DataFlagRecords*>(ws.error)->peer_abort;
    state = __atomic_load_n(&record->state, __ATOMIC_ACQUIRE);
  }
  if (state == kReasonNone) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  DataFlagError e;
  std::memcpy(&e, static_cast<const void*>(record), sizeof(e));
  e.state = state;
  TORCH_CHECK(false, cat("torch_sdcp: ", kind_name(ws.kind), " workspace ", ws.handle, " on rank ", ws.rank,
              " is poisoned: ", describe_dataflag_error(ws, e),
              "; re-create the workspace (close() it and create a new one)"));
}

void host_check_signals(const Workspace& ws, uint64_t call) {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  if (PyErr_CheckSignals() == 0) {
    PyGILState_Release(gil);
    return;
  }
  // A handler raised (KeyboardInterrupt): the call is abandoned on every rank.
  DataFlagError e{};
  e.state = kReasonError;
  e.block = -1;
  e.peer = -1;
  e.aborter = -1;
  e.call = call;
  dataflag_abort(ws, e);
  pybind11::error_already_set raised;  // takes the pending exception; pybind11 restores it for the caller
  PyGILState_Release(gil);
  throw raised;
}

}  // namespace sdcp
