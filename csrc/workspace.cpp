// Argument checks, the workspace layout and the handle registry.

#include "sdcp.h"

#include "exchange.h"
#include "output_lse.h"
#include "query.h"
#include "topk.h"

#include <torch/library.h>

#include <memory>
#include <mutex>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <unordered_map>

namespace sdcp {

Text& Text::operator<<(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s_ += buf;
  return *this;
}

Text& Text::operator<<(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  s_ += buf;
  return *this;
}

Text& Text::operator<<(c10::IntArrayRef a) {
  s_ += '[';
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s_ += ", ";
    s_ += std::to_string(a[i]);
  }
  s_ += ']';
  return *this;
}

std::string shape_str(const at::Tensor& t) { return cat(t.sizes()); }

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  SDCP_CHECK_ARG(t.scalar_type() == want, name, "dtype " << want, "dtype " << t.scalar_type());
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  auto st = t.scalar_type();
  SDCP_CHECK_ARG(st == at::kBFloat16 || st == at::kHalf || st == at::kFloat, name,
                 "dtype bfloat16, float16 or float32", "dtype " << st);
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  SDCP_CHECK_ARG(t.dim() == dim, name, dim << " dimensions", t.dim() << " (shape " << t.sizes() << ")");
}

void check_size(const at::Tensor& t, const char* name, int64_t d, int64_t want) {
  SDCP_CHECK_ARG(t.size(d) == want, name, "size " << want << " at dim " << d,
                 t.size(d) << " (shape " << t.sizes() << ")");
}

void check_contiguous(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor",
                 "strides " << t.strides() << " for shape " << t.sizes());
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                       const char* ref_name) {
  SDCP_CHECK_ARG(t.device() == ref.device(), name, "device " << ref.device() << " (that of '" << ref_name << "')",
                 "device " << t.device());
}

const char* kind_name(WorkspaceKind kind) {
  switch (kind) {
    case WorkspaceKind::kExchange: return "exchange";
    case WorkspaceKind::kOutputLSE: return "output_lse";
    case WorkspaceKind::kTopK: return "topk";
    case WorkspaceKind::kQuery: return "query";
  }
  return "unknown";
}

int64_t checked_mul(std::initializer_list<int64_t> factors, const char* arg) {
  int64_t product = 1;
  for (int64_t f : factors) {
    TORCH_CHECK_VALUE(f >= 0, cat("torch_sdcp: argument '", arg, "': expected sizes >= 0, got a factor ", f));
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(product, f, &product) && product <= kMaxRegionBytes,
                      cat("torch_sdcp: argument '", arg, "': expected a workspace region of at most ",
                          kMaxRegionBytes, " bytes per rank, got a size that exceeds it (a factor of ", f, ")"));
  }
  return product;
}

int64_t align_up(int64_t x, int64_t a) {
  TORCH_CHECK_VALUE(x >= 0 && x <= kMaxRegionBytes, cat("torch_sdcp: internal: size ", x, " out of range"));
  return (x + a - 1) / a * a;
}

void check_params(const std::vector<int64_t>& p, size_t n, const char* what) {
  TORCH_CHECK_VALUE(p.size() == n, cat("torch_sdcp: argument 'params': expected ", n, " values (", what,
                    "), got ", p.size()));
  for (size_t i = 0; i < p.size(); ++i)
    TORCH_CHECK_VALUE(p[i] > 0, cat("torch_sdcp: argument 'params': expected positive values (", what,
                      "), got ", p[i], " at position ", i));
}

WorkspaceLayout compute_layout(WorkspaceKind kind, const std::vector<int64_t>& p,
                               int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1 && world_size <= kMaxWorld, cat("torch_sdcp: argument 'world_size': expected 1..",
                    kMaxWorld, ", got ", world_size));
  WorkspaceLayout l;
  switch (kind) {
    case WorkspaceKind::kExchange: exchange_layout(p, world_size, l); break;
    case WorkspaceKind::kOutputLSE: output_lse_layout(p, world_size, l); break;
    case WorkspaceKind::kTopK: topk_layout(p, world_size, l); break;
    case WorkspaceKind::kQuery: query_layout(p, world_size, l); break;
    default:
      TORCH_CHECK_VALUE(false, cat("torch_sdcp: argument 'kind': expected 0..3, got ", static_cast<int64_t>(kind)));
  }
  l.control_bytes = align_up(static_cast<int64_t>(sizeof(DataFlagControl)), 4096);
  l.data_offset = l.control_bytes;
  l.region_bytes = l.control_bytes + l.slots * l.slot_bytes + kTailPad;
  return l;
}

// ---- Failure handling ------------------------------------------------------

DataFlagDeviceHooks& dataflag_device_hooks() {
  static DataFlagDeviceHooks hooks;
  return hooks;
}

namespace {

// FNV-1a over the kind, the world size and the parameters, never 0 or the sentinel.
uint32_t geometry_hash(WorkspaceKind kind, int64_t world_size, const std::vector<int64_t>& params) {
  uint32_t h = 2166136261u;
  auto mix = [&](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint32_t>((static_cast<uint64_t>(v) >> (8 * b)) & 0xFF);
      h *= 16777619u;
    }
  };
  mix(static_cast<int64_t>(kind));
  mix(world_size);
  for (int64_t p : params) mix(p);
  return canonical_header_word(h == 0 ? 1u : h);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// The query's header flags (query_call_flags in query.h): the op, and for the
// producer its RoPE style and whether it quantised with a scale.
std::string query_flags_text(uint32_t v) {
  static const char* ops[] = {"an unknown op", "query_gather", "query_all_gather_heads", "query_publish"};
  std::string s = ops[v & 3u];
  if ((v & 3u) == 1u || (v & 3u) == 3u)
    s += cat(" (", (v & 4u) ? "neox" : "interleaved", " RoPE, ", (v & 8u) ? "with" : "without", " q_scale)");
  return s;
}

// One side of a mismatch, in the words of the workspace's family.
std::string header_value(const Workspace& ws, uint32_t field, uint32_t v) {
  switch (field) {
    case kHeaderRows:
      return cat(v, ws.kind == WorkspaceKind::kExchange ? " bytes" : " rows");
    case kHeaderDtype:
      if (v < static_cast<uint32_t>(c10::ScalarType::NumOptions))
        return cat("dtype ", c10::toString(static_cast<c10::ScalarType>(v)));
      return cat("dtype code ", v);
    case kHeaderFlags:
      if (ws.kind == WorkspaceKind::kOutputLSE) return cat("lse base ", v ? "2" : "e");
      if (ws.kind == WorkspaceKind::kExchange) return cat("x of shape hash ", hex32(v));
      if (ws.kind == WorkspaceKind::kQuery) return query_flags_text(v);
      return cat("flags ", hex32(v));
    default:
      return cat("a workspace of geometry hash ", hex32(v), " (kind, world size and parameters)");
  }
}

const char* reason_text(uint32_t reason) {
  switch (reason) {
    case kReasonTimeout: return "it timed out waiting for a peer";
    case kReasonMismatch: return "its call differs from a peer's (call mismatch)";
    case kReasonError: return "a call raised an error on that rank after the call was entered";
    case kReasonBadInput: return "a kernel on that rank met bad input (a position outside cos_sin_cache)";
    default: return "unknown reason";
  }
}

std::string call_text(uint64_t call) { return call == ~uint64_t{0} ? std::string("unknown") : std::to_string(call); }

std::string where(const Workspace& ws, const DataFlagError& e) {
  if (dataflag_wait_is_view(e.wait))  // the query's view: one buffer, its own call index
    return cat(kind_name(ws.kind), " workspace ", ws.handle, ", view buffer, view call ", call_text(e.call));
  return cat(kind_name(ws.kind), " workspace ", ws.handle, ", buffer ",
             e.call == ~uint64_t{0} ? std::string("unknown") : std::to_string(e.call % kDataFlagBuffers), ", call ",
             call_text(e.call));
}

std::string block_text(const DataFlagError& e) { return e.block >= 0 ? cat(" block ", e.block) : std::string(); }

const char* wait_text(uint32_t wait) { return dataflag_wait_is_header(wait) ? "call header" : "data"; }

// "peer 1's data", "peer 1 to release the previous view call"
std::string waited_for(int64_t peer, uint32_t wait) {
  if (wait == kWaitViewRelease) return cat("peer ", peer, " to release the previous view call");
  return cat("peer ", peer, "'s ", wait_text(wait));
}

}  // namespace

std::string describe_dataflag_error(const Workspace& ws, const DataFlagError& e) {
  switch (e.state) {
    case kReasonTimeout:
      if (e.wait == kWaitViewRelease)
        return cat("timeout: rank ", ws.rank, block_text(e), " waited ", ws.timeout_ns / 1e9, " s for ",
                   waited_for(e.peer, e.wait), " (", where(ws, e), "); the peer stopped participating, its reader "
                   "of the last view did not finish, or it did not call release()");
      return cat("timeout: rank ", ws.rank, block_text(e), " waited ", ws.timeout_ns / 1e9, " s for ",
                 waited_for(e.peer, e.wait), " (", where(ws, e), "); ",
                 dataflag_wait_is_header(e.wait)
                     ? "the peer did not enter this call: it stopped participating, skipped the call, or took the "
                       "collective path (rows > max_rows) while this rank took the peer path"
                     : "the peer stopped participating, skipped the call, took the collective path (rows > "
                       "max_rows), or calls differ between ranks");
    case kReasonMismatch: {
      const bool me_first = ws.rank < e.peer;
      const int64_t a = me_first ? ws.rank : e.peer, b = me_first ? e.peer : ws.rank;
      const uint32_t va = me_first ? e.mine : e.theirs, vb = me_first ? e.theirs : e.mine;
      return cat("call mismatch (", where(ws, e), "): rank ", a, " called with ", header_value(ws, e.field, va),
                 ", rank ", b, " with ", header_value(ws, e.field, vb),
                 "; every rank must make the same calls with the same shapes, dtypes and options");
    }
    case kReasonError:
      return cat("rank ", ws.rank, " abandoned a call (", where(ws, e), ") after an error was raised in it");
    case kReasonBadInput: {
      const bool saturated = e.mine == 0x7FFFFFFFu || e.mine == 0x80000000u;
      return cat("bad input on rank ", ws.rank, block_text(e), " (", where(ws, e), "): argument 'positions': ",
                 "expected values in [0, ", e.theirs, ") (the rows of cos_sin_cache), got ",
                 saturated ? (static_cast<int32_t>(e.mine) < 0 ? "a value below " : "a value of at least ") : "",
                 static_cast<int32_t>(e.mine), " at row ", e.field,
                 "; positions are checked on the device only (a host check would synchronise the stream)");
    }
    case kReasonPeerAbort: {
      std::string s = cat("peer ", e.aborter, " aborted: ", reason_text(e.abort_reason));
      if (e.peer >= 0)
        s += cat("; rank ", ws.rank, block_text(e), " waited for ", waited_for(e.peer, e.wait), " (", where(ws, e),
                 ")");
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
  if (state == kReasonNone) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  DataFlagError e;
  std::memcpy(&e, static_cast<const void*>(ws.error), sizeof(e));
  e.state = state;
  TORCH_CHECK(false, cat("torch_sdcp: ", kind_name(ws.kind), " workspace ", ws.handle, " on rank ", ws.rank,
              " is poisoned: ", describe_dataflag_error(ws, e),
              "; re-create the workspace (close() it and create a new one)"));
}

namespace {

std::mutex g_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Workspace>>& registry() {
  static auto* r = new std::unordered_map<int64_t, std::shared_ptr<const Workspace>>();
  return *r;  // leaked on purpose: nothing runs at interpreter exit
}

WorkspaceKind to_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 3, cat("torch_sdcp: argument 'kind': expected 0..3, got ", kind));
  return static_cast<WorkspaceKind>(kind);
}

int64_t workspace_nbytes(int64_t kind, c10::IntArrayRef params, int64_t world_size) {
  return compute_layout(to_kind(kind), params.vec(), world_size).region_bytes;
}

// [control_bytes, data_offset, slots, slot_bytes, region_bytes, part_offset[0..3]]
std::vector<int64_t> workspace_layout(int64_t kind, c10::IntArrayRef params, int64_t world_size) {
  const auto l = compute_layout(to_kind(kind), params.vec(), world_size);
  return {l.control_bytes, l.data_offset, l.slots, l.slot_bytes, l.region_bytes,
          l.part_offset[0], l.part_offset[1], l.part_offset[2], l.part_offset[3]};
}

void workspace_register(int64_t handle, int64_t kind, c10::IntArrayRef params, int64_t base,
                        int64_t stride, int64_t rank, int64_t world_size, c10::Device device,
                        int64_t timeout_ns) {
  auto ws = std::make_shared<Workspace>();
  ws->handle = handle;
  ws->kind = to_kind(kind);
  ws->params = params.vec();
  ws->layout = compute_layout(ws->kind, ws->params, world_size);
  TORCH_CHECK_VALUE(base != 0, cat("torch_sdcp: argument 'base': expected a mapped address, got 0"));
  TORCH_CHECK_VALUE(stride >= ws->layout.region_bytes, cat("torch_sdcp: argument 'stride': expected at least ",
                    ws->layout.region_bytes, " bytes, got ", stride));
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, cat("torch_sdcp: argument 'rank': expected 0..",
                    world_size - 1, ", got ", rank));
  TORCH_CHECK_VALUE(timeout_ns > 0, cat("torch_sdcp: argument 'timeout_ns': expected > 0, got ", timeout_ns));
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), cat("torch_sdcp: argument 'device': expected cpu or cuda, got ", device));
  ws->base = static_cast<uintptr_t>(base);
  ws->stride = stride;
  ws->rank = rank;
  ws->world_size = world_size;
  ws->device = device;
  ws->timeout_ns = timeout_ns;
  ws->geometry_hash = geometry_hash(ws->kind, world_size, ws->params);
  if (device.is_cuda() && dataflag_device_hooks().alloc_error != nullptr)
    ws->error_storage = dataflag_device_hooks().alloc_error(device, &ws->error, &ws->error_device);
  if (ws->error == nullptr) {  // host backend, or no mapped memory: the kernels trap on a timeout
    auto record = std::make_shared<DataFlagError>();
    std::memset(static_cast<void*>(record.get()), 0, sizeof(DataFlagError));
    ws->error = record.get();
    ws->error_device = nullptr;
    ws->error_storage = record;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& r = registry();
  TORCH_CHECK_VALUE(r.find(handle) == r.end(), cat("torch_sdcp: argument 'handle': expected an unused handle, got ",
                    handle, " which is already registered"));
  r.emplace(handle, std::move(ws));
}

void workspace_unregister(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  registry().erase(handle);  // idempotent
}

std::shared_ptr<const Workspace> lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = registry().find(handle);
  TORCH_CHECK_VALUE(it != registry().end(), cat("torch_sdcp: argument 'handle': expected a live workspace handle, got ",
                    handle, " (never created, or already closed)"));
  return it->second;
}

// Raises when the workspace is poisoned on this rank (never synchronises:
// on CUDA the record is host-mapped memory; usable during capture).
void workspace_check(int64_t handle) { check_workspace_health(*lookup(handle)); }

// A call raised after it was entered: poison the workspace on this rank and
// tell every peer (a peer waiting in the call gives up at once).
void workspace_abort(int64_t handle) {
  const auto ws = lookup(handle);
  DataFlagError e{};
  e.state = kReasonError;
  e.block = -1;
  e.peer = -1;
  e.aborter = -1;
  e.call = ws->device.is_cpu()
               ? __atomic_load_n(&ws->control(ws->rank)->call_index[0], __ATOMIC_RELAXED)
               : ~uint64_t{0};
  dataflag_abort(*ws, e);
}

std::vector<int64_t> workspace_handles() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<int64_t> out;
  for (auto& kv : registry()) out.push_back(kv.first);
  return out;
}

}  // namespace

std::shared_ptr<const Workspace> resolve_workspace(int64_t handle, WorkspaceKind kind,
                                                   const at::Tensor& on) {
  std::shared_ptr<const Workspace> ws;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = registry().find(handle);
    TORCH_CHECK_VALUE(it != registry().end(), cat("torch_sdcp: argument 'workspace': expected a live ",
                      kind_name(kind), " workspace handle, got ", handle,
                      " (never created, or already closed)"));
    ws = it->second;
  }
  TORCH_CHECK_VALUE(ws->kind == kind, cat("torch_sdcp: argument 'workspace': expected a ", kind_name(kind),
                    " workspace, got handle ", handle, " of kind ", kind_name(ws->kind)));
  TORCH_CHECK_VALUE(ws->device == on.device() || (ws->device.is_cpu() && on.is_cpu()), cat("torch_sdcp: argument 'workspace': expected a workspace on ", on.device(),
                    " (the inputs' device), got one on ", ws->device));
  check_workspace_health(*ws);
  // The shared pointer keeps the descriptor (not the mapping) alive; the
  // mapping is only released by close(), which synchronises and barriers
  // before it unregisters.
  return ws;
}

TORCH_LIBRARY_IMPL(sdcp, CompositeExplicitAutograd, m) {
  m.impl("workspace_nbytes", &workspace_nbytes);
  m.impl("workspace_layout", &workspace_layout);
  m.impl("workspace_register", &workspace_register);
  m.impl("workspace_unregister", &workspace_unregister);
  m.impl("workspace_handles", &workspace_handles);
  m.impl("workspace_check", &workspace_check);
  m.impl("workspace_abort", &workspace_abort);
}

}  // namespace sdcp
