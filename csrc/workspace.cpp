// The workspace registry: the generic layout (control region, tail pad) around
// a family's slots, and register / unregister / resolve of handles.

#include "sdcp.h"

#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace sdcp {

WorkspaceLayout compute_layout(WorkspaceKind kind, const std::vector<int64_t>& p,
                               int64_t world_size) {
  TORCH_CHECK_VALUE(world_size >= 1 && world_size <= kMaxWorld, cat("torch_sdcp: argument 'world_size': expected 1..",
                    kMaxWorld, ", got ", world_size));
  const int64_t k = static_cast<int64_t>(kind);
  TORCH_CHECK_VALUE(k >= 0 && k < kWorkspaceKinds, cat("torch_sdcp: argument 'kind': expected 0..",
                    kWorkspaceKinds - 1, ", got ", k));
  WorkspaceLayout l;
  family(kind).layout(p, world_size, l);
  l.control_bytes = align_up(static_cast<int64_t>(sizeof(DataFlagControl)), 4096);
  l.data_offset = l.control_bytes;
  l.region_bytes = l.control_bytes + l.slots * l.slot_bytes + kTailPad;
  return l;
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

std::mutex g_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Workspace>>& registry() {
  static auto* r = new std::unordered_map<int64_t, std::shared_ptr<const Workspace>>();
  return *r;  // leaked on purpose: nothing runs at interpreter exit
}


WorkspaceKind to_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind >= 0 && kind < kWorkspaceKinds, cat("torch_sdcp: argument 'kind': expected 0..",
                    kWorkspaceKinds - 1, ", got ", kind));
  return static_cast<WorkspaceKind>(kind);
}

int64_t workspace_nbytes(int64_t kind, c10::IntArrayRef params, int64_t world_size) {
  return compute_layout(to_kind(kind), params.vec(), world_size).region_bytes;
}

// [control_bytes, data_offset, slots, slot_bytes, region_bytes, part_values[0..3]]
std::vector<int64_t> workspace_layout(int64_t kind, c10::IntArrayRef params, int64_t world_size) {
  const auto l = compute_layout(to_kind(kind), params.vec(), world_size);
  return {l.control_bytes, l.data_offset, l.slots, l.slot_bytes, l.region_bytes,
          l.part_values[0], l.part_values[1], l.part_values[2], l.part_values[3]};
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
    auto record = std::make_shared<DataFlagRecords>();
    std::memset(static_cast<void*>(record.get()), 0, sizeof(DataFlagRecords));
    ws->error = &record->error;
    ws->error_device = nullptr;
    ws->error_storage = record;
  }
  ws->void_host = &reinterpret_cast<DataFlagRecords*>(ws->error)->void_word;
  if (ws->error_device != nullptr) ws->void_device = &reinterpret_cast<DataFlagRecords*>(ws->error_device)->void_word;
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

// A void call's placeholder is being made (on) or is done (off): see call_header.
void workspace_void_next(int64_t handle, bool on) { lookup(handle)->void_next.store(on, std::memory_order_relaxed); }

// The first void call met since the last take, as void_word (0: none), and
// clears it. A read of host memory: no synchronisation, capturable.
int64_t workspace_take_void(int64_t handle) {
  const auto ws = lookup(handle);
  return static_cast<int64_t>(__atomic_exchange_n(ws->void_host, uint64_t{0}, __ATOMIC_ACQ_REL));
}

// Where the void word lives in host memory: the Python layer reads it after
// every call without an op call (a plain load; the take above clears it).
int64_t workspace_void_address(int64_t handle) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(lookup(handle)->void_host)); }

// What this rank's peers have stored for its next call (its next view call
// with `view`): [the call's index, then rank-major 4 header words per rank,
// kSentinel where none has landed and for this rank]. For a call over
// max_rows on this rank, before it takes the collective path: a header here
// means that peer took the peer path, with the rows in its first word. The
// index is exact only when no call of this rank is running: the caller
// synchronises its stream first on CUDA, where both are copied off the
// device on a side stream.
std::vector<int64_t> workspace_peer_headers(int64_t handle, bool view) {
  const auto ws = lookup(handle);
  const FamilyInfo& f = family(ws->kind);
  TORCH_CHECK_VALUE((f.header_entry != nullptr || (f.tagged_header_entry != nullptr && !view)) &&
                        (!view || f.view_counter != nullptr),
                    cat("torch_sdcp: argument 'handle': expected a workspace whose calls carry call headers",
                        view ? " and a view" : "", ", got a ", f.name, " workspace"));
  const bool device = ws->device.is_cuda();
  TORCH_CHECK(!device || dataflag_device_hooks().read != nullptr,
              "torch_sdcp: workspace_peer_headers: this build has no CUDA kernels to read device memory with");
  auto load = [&](void* dst, const void* src, size_t bytes) {
    if (device) {
      dataflag_device_hooks().read(*ws, dst, src, bytes);
    } else {
      for (size_t i = 0; i < bytes / 4; ++i)
        static_cast<uint32_t*>(dst)[i] = __atomic_load_n(static_cast<const uint32_t*>(src) + i, __ATOMIC_ACQUIRE);
    }
  };
  uint64_t call = 0;
  load(&call, view ? f.view_counter(*ws) : &ws->control(ws->rank)->call_index[0], sizeof(call));
  std::vector<int64_t> out(1 + ws->world_size * kHeaderFields, static_cast<int64_t>(kSentinel));
  out[0] = static_cast<int64_t>(call);
  for (int64_t src = 0; src < ws->world_size; ++src) {
    if (src == ws->rank) continue;
    if (f.header_entry == nullptr) {  // tagged words: a word of another call is one that has not landed
      uint64_t tagged[kHeaderFields];
      load(tagged, f.tagged_header_entry(*ws, src, call), sizeof(tagged));
      for (uint32_t w = 0; w < kHeaderFields; ++w)
        if ((tagged[w] >> 32) == call_tag(call)) out[1 + src * kHeaderFields + w] = static_cast<uint32_t>(tagged[w]);
      continue;
    }
    uint32_t words[kHeaderFields];
    load(words, f.header_entry(*ws, src, call, view), sizeof(words));
    for (uint32_t w = 0; w < kHeaderFields; ++w) out[1 + src * kHeaderFields + w] = words[w];
  }
  return out;
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
  // Health is the caller's last check (check_workspace_health), after its
  // arguments: every rank reports its own argument error before a peer's abort.
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
  m.impl("workspace_void_next", &workspace_void_next);
  m.impl("workspace_take_void", &workspace_take_void);
  m.impl("workspace_void_address", &workspace_void_address);
  m.impl("workspace_peer_headers", &workspace_peer_headers);
}

}  // namespace sdcp
