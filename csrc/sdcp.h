// Shared declarations for the torch_sdcp operators: argument checks, the
// workspace registry and the peer-memory layout every family uses.
#pragma once

#include "dataflag.h"
#include "limits.h"

#include <torch/types.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace sdcp {

// Message text built without std::ostream. An extension compiled by a newer
// GCC than the torch wheel can crash formatting numbers through ostream locale
// facets (seen: GCC 13 against torch 2.11), so every message is assembled here
// and handed to TORCH_CHECK as one std::string, which it does not re-format.
class Text {
 public:
  Text& operator<<(const char* s) { s_ += s ? s : "(null)"; return *this; }
  Text& operator<<(const std::string& s) { s_ += s; return *this; }
  Text& operator<<(char c) { s_ += c; return *this; }
  Text& operator<<(bool b) { s_ += b ? "true" : "false"; return *this; }
  template <typename T, std::enable_if_t<std::is_integral<T>::value, int> = 0>
  Text& operator<<(T v) { s_ += std::to_string(v); return *this; }
  Text& operator<<(double v);
  Text& operator<<(const void* p);
  Text& operator<<(c10::IntArrayRef a);
  Text& operator<<(c10::ScalarType t) { s_ += c10::toString(t); return *this; }
  Text& operator<<(const c10::Device& d) { s_ += d.str(); return *this; }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

template <typename... Args>
std::string cat(const Args&... args) {
  Text t;
  (t << ... << args);
  return t.str();
}

// Errors name the argument, the expected and the actual value. `expected` and
// `actual` are `<<` chains, evaluated only on failure.
#define SDCP_CHECK_ARG(cond, arg, expected, actual)                                                  \
  TORCH_CHECK_VALUE(cond, [&] {                                                                      \
    ::sdcp::Text o_;                                                                                 \
    o_ << "torch_sdcp: argument '" << arg << "': expected " << expected << ", got " << actual;       \
    return o_.str();                                                                                 \
  }())

std::string shape_str(const at::Tensor& t);

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want);
void check_dim(const at::Tensor& t, const char* name, int64_t dim);
void check_size(const at::Tensor& t, const char* name, int64_t d, int64_t want);
void check_contiguous(const at::Tensor& t, const char* name);
void check_same_device(const at::Tensor& t, const char* name,
                       const at::Tensor& ref, const char* ref_name);
void check_float_dtype(const at::Tensor& t, const char* name);
// A peer op's call tag (dataflag.h kHeaderTagMask): -1 (untagged) or [0, kCallTagLimit).
void check_call_tag(int64_t tag);

// "0x0000abcd"
std::string hex32(uint32_t v);

// Layout arithmetic. Sizes are products of user arguments: every product is
// checked, and a region larger than kMaxRegionBytes is refused with an error
// naming `arg` (the argument that made it too large).
constexpr int64_t kMaxRegionBytes = int64_t{1} << 40;
int64_t checked_mul(std::initializer_list<int64_t> factors, const char* arg);
int64_t align_up(int64_t x, int64_t a);
// params holds n positive values, described by `what`.
void check_params(const std::vector<int64_t>& params, size_t n, const char* what);

// ---------------------------------------------------------------------------
// Workspaces. A workspace is one peer-addressable arena: rank r's region is
// mapped at base + r * stride in this process, for every r. The Python side
// allocates and maps it, then registers the mapping here under an integer
// handle; ops resolve the handle, so torch never sees peer memory as an
// argument.
//
// Region layout (identical on every rank; docs/PROTOCOL.md, version 4):
//   [0, control_bytes)        a DataFlagControl (call counters, abort word),
//                             padded to 4 KiB; a family may keep its own
//                             control words after it (QueryControl)
//   [control_bytes, ...)      the family's data, `slots` slots (1 or 2)
//   then the tail pad (kTailPad)
// ---------------------------------------------------------------------------

// A workspace's family, by the number the Python side passes (torch_sdcp's
// WorkspaceKind mirrors it). Each has one entry in kFamilies below.
enum class WorkspaceKind : int64_t {
  kExchange = 0,   // generic peer all-gather inbox (signalling primitive)
  kOutputLSE = 1,  // output/LSE boundary
  kTopK = 2,       // top-K boundary
  kQuery = 3,      // query boundary
};

// Values of a family's layout that its Geometry struct decodes (offsets
// inside a slot, strides, counts); the Python class names them in PARTS.
constexpr int kPartValues = 4;

// Every family signals with data-as-flag (docs/PROTOCOL.md, version 4).
struct WorkspaceLayout {
  int64_t control_bytes = 0;  // the DataFlagControl, aligned to 4 KiB
  int64_t slot_bytes = 0;     // one data slot
  int64_t data_offset = 0;    // == control_bytes
  int64_t slots = 2;          // data slots: 2 (the buffers, by call index) or 1 (query: view and buffers in one)
  int64_t region_bytes = 0;   // control + slots + tail pad (before granularity rounding)
  // Family-specific values, named by each family's Geometry struct
  // (ExchangeGeometry, OutputLSEGeometry, TopKGeometry, QueryGeometry).
  int64_t part_values[kPartValues] = {0, 0, 0, 0};
};

struct Workspace;

// What the workspace code needs of a family: its name, its slot layout and
// the words of its failure texts. Each family defines its entry in
// <family>.cpp; a text the family does not need is null.
struct FamilyInfo {
  const char* name;  // "exchange", "output_lse", "topk", "query"
  // Lays out one slot: slots, slot_bytes and part_values (params as the
  // family's Geometry struct documents them).
  void (*layout)(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);
  // What a call header's rows word counts (the exchange's: " bytes").
  const char* rows_unit;
  // A call header's flags word in the family's words (a mismatch's text).
  std::string (*flags_text)(uint32_t flags);
  // Waits on the query's view (kWaitView*): where ("view buffer, view call
  // 3"), what a release waits for ("to release the previous view call") and
  // what a release timeout suggests.
  std::string (*view_where)(uint64_t view_call);
  const char* view_release_wait;
  const char* view_release_hint;
  // A kernel's bad input (kReasonBadInput): why a peer aborted, and what this
  // rank's record says about the argument.
  const char* bad_input_reason;
  std::string (*bad_input_text)(const DataFlagError& e);
  // Where this rank finds source src's call header of call `call` (of its
  // view call with `view`), in its own region: what a call over max_rows on
  // this rank looks for, to learn that a peer took the peer path and with
  // how many rows (workspace_peer_headers), or that a peer is inside a call
  // that this rank leaves (close, resize). Null where the family's header is
  // tagged words (tagged_header_entry); `view` only for a family with a
  // view_counter.
  const uint32_t* (*header_entry)(const Workspace& ws, int64_t src, uint64_t call, bool view);
  // The same, for a family whose header is kHeaderFields tagged 64-bit words
  // (the exchange): a word has landed when it carries call_tag(call).
  const uint64_t* (*tagged_header_entry)(const Workspace& ws, int64_t src, uint64_t call);
  // The counter of this rank's view calls, in its own region (the query).
  const uint64_t* (*view_counter)(const Workspace& ws);
};

extern const FamilyInfo kExchangeFamily, kOutputLSEFamily, kTopKFamily, kQueryFamily;

// Every family, indexed by WorkspaceKind: the one list of families.
inline constexpr const FamilyInfo* kFamilies[] = {&kExchangeFamily, &kOutputLSEFamily, &kTopKFamily, &kQueryFamily};
constexpr int64_t kWorkspaceKinds = static_cast<int64_t>(sizeof(kFamilies) / sizeof(kFamilies[0]));

inline const FamilyInfo& family(WorkspaceKind kind) { return *kFamilies[static_cast<int64_t>(kind)]; }
inline const char* kind_name(WorkspaceKind kind) { return family(kind).name; }

// The layout of a workspace of `kind`, whose params the family's Geometry
// struct documents: the family lays out its slots (FamilyInfo::layout); this
// adds the control region and the tail pad.
WorkspaceLayout compute_layout(WorkspaceKind kind,
                               const std::vector<int64_t>& params,
                               int64_t world_size);

struct Workspace {
  int64_t handle = -1;
  WorkspaceKind kind = WorkspaceKind::kExchange;
  std::vector<int64_t> params;
  WorkspaceLayout layout;
  uintptr_t base = 0;  // address of rank 0's region in this process
  int64_t stride = 0;  // bytes between consecutive ranks' regions
  int64_t rank = 0;
  int64_t world_size = 1;
  c10::Device device{c10::kCPU};
  int64_t timeout_ns = 0;
  // Failure handling (docs/PROTOCOL.md "Failure behaviour"): a hash of kind,
  // world size and parameters that every call header carries, and this
  // rank's error record (never null once registered: host memory, or
  // host-mapped pinned memory on CUDA, whose device address is error_device).
  uint32_t geometry_hash = 0;
  DataFlagError* error = nullptr;
  DataFlagError* error_device = nullptr;
  std::shared_ptr<void> error_storage;
  // The void word (dataflag.h void_word), right after the error record in
  // the same memory: 0, or the first void call a consumer met here. The host
  // takes it (workspace_take_void); kernels store it through void_device.
  uint64_t* void_host = nullptr;
  uint64_t* void_device = nullptr;
  // Set by workspace_void_next around the placeholder call of a void call:
  // the headers made meanwhile carry kHeaderVoidBit. Calls on one workspace
  // are ordered (one caller at a time), so nothing else reads it meanwhile.
  mutable std::atomic<bool> void_next{false};

  uint8_t* region(int64_t r) const {
    return reinterpret_cast<uint8_t*>(base + static_cast<uintptr_t>(r * stride));
  }
  DataFlagControl* control(int64_t r) const { return reinterpret_cast<DataFlagControl*>(region(r)); }
  uint8_t* slot_data(int64_t r, int64_t slot) const {
    return region(r) + layout.data_offset + slot * layout.slot_bytes;
  }
};

// What a workspace's error memory holds (host memory, or host-mapped pinned
// memory on CUDA): the error record, then the void word.
struct DataFlagRecords {
  DataFlagError error;  // this rank's own failure (a timeout, a mismatch, bad input, an error in a call)
  uint64_t void_word;
  DataFlagError peer_abort;  // CUDA: a peer's abort word seen by a kernel here (read when `error` is empty)
};

// A call's header: its call tag (checked by check_call_tag: -1 untagged) in
// the dtype word, and kHeaderVoidBit when it is the placeholder of a void call.
inline CallHeader call_header(const Workspace& ws, int64_t rows, int64_t dtype, uint32_t flags, int64_t tag) {
  CallHeader h = make_call_header(rows, dtype, flags, ws.geometry_hash);
  h.w[kHeaderDtype] |= header_tag_bits(tag);  // the dtype is below 256: the word is never the sentinel
  if (ws.void_next.load(std::memory_order_relaxed)) h.w[kHeaderDtype] |= kHeaderVoidBit;
  return h;
}

// Where rank `dst` keeps what rank `src` sends it in a data-as-flag
// buffer: one entry per peer, none for itself (0 .. N-2).
inline int64_t peer_slot(int64_t src, int64_t dst, int64_t n) { return (src - dst - 1 + n) % n; }

// Rank dst's call header entry for source src in buffer `buf`, for a family
// whose buffers end in the headers [peer][kHeaderFields words] at
// `header_offset` (Output/LSE, top-K).
inline uint32_t* buffer_header(const Workspace& ws, int64_t header_offset, int64_t dst, int64_t src, int64_t buf) {
  return reinterpret_cast<uint32_t*>(ws.slot_data(dst, buf) + header_offset) +
         peer_slot(src, dst, ws.world_size) * kHeaderFields;
}

// ---- Failure handling of data-as-flag workspaces ------------------------
// A failed or aborted workspace is poisoned on this rank: its error record
// is set. Every op that resolves it raises (check_workspace_health), and so
// does workspace_check; the abort word in every rank's control region lets
// the peers' polls give up at once.

// The text of an error record (what failed, rank, peer, buffer, call).
std::string describe_dataflag_error(const Workspace& ws, const DataFlagError& e);
// Records `e` as this rank's error (unless one is recorded already) and
// stores this rank's abort word into every rank's control region that has
// none yet (own included; on CUDA through the device hook, off the stream).
void dataflag_abort(const Workspace& ws, const DataFlagError& e);
// Raises "poisoned ..." when this rank's error record is set, or (host
// backend) a peer's abort word is in this rank's control region.
void check_workspace_health(const Workspace& ws);

// The CUDA backend's part, set by dataflag_cuda.cu when it is built:
// allocation of a host-mapped error record (host pointer, device pointer),
// and a launch (on a side stream) that stores an abort word into every
// rank's control region where none is yet.
struct DataFlagDeviceHooks {
  std::shared_ptr<void> (*alloc_error)(const c10::Device& device, DataFlagError** host, DataFlagError** dev) = nullptr;
  void (*store_abort)(const Workspace& ws, uint64_t word) = nullptr;
  // Copies `bytes` of the workspace's device memory at `src` to host `dst`
  // (on a side stream, waited for).
  void (*read)(const Workspace& ws, void* dst, const void* src, size_t bytes) = nullptr;
};
DataFlagDeviceHooks& dataflag_device_hooks();

// Resolve a handle; checks that it is alive, of the expected kind, and lives
// on the device of `on` (CPU tensors need a host workspace, CUDA tensors a
// CUDA workspace on the same device). Not its health: an op checks that
// (check_workspace_health) after all its arguments, so that a rank's own bad
// argument is reported before a peer's abort.
std::shared_ptr<const Workspace> resolve_workspace(int64_t handle, WorkspaceKind kind,
                                                   const at::Tensor& on);

}  // namespace sdcp
