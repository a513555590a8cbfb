// Query boundary: argument checks, the workspace layout and output allocation
// shared by the CPU and CUDA kernels; `query_all_gather_heads` is registered
// once for both backends, on top of `query_all_gather_heads_out`.

#include "query.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace sdcp {

void query_layout(const std::vector<int64_t>& p, int64_t n, WorkspaceLayout& l) {
  check_params(p, 4, "max_rows, local_heads, head_dim, elem_bytes");
  const int64_t rows = p[0], hl = p[1], dim = p[2], eb = p[3];
  // The sentinel model needs an element with a NaN whose bytes are all ones.
  TORCH_CHECK_VALUE(eb == 1 || eb == 2 || eb == 4, cat("torch_sdcp: argument 'elem_bytes': expected 1, 2 or 4 ",
                    "(float8, bf16/fp16 or fp32), got ", eb));
  TORCH_CHECK_VALUE(checked_mul({dim, eb}, "head_dim") % 4 == 0, cat("torch_sdcp: argument 'head_dim': expected ",
                    "heads of a multiple of 4 bytes (the signalling word), got ", dim, " elements of ", eb, " bytes"));
  // One slot: the view, then the two rotating buffers of the copying ops
  // (their own index; see QueryGeometry), then the call headers.
  l.slots = 1;
  const int64_t view = align_up(checked_mul({rows, n, hl, dim, eb}, "max_rows"), kAlign);
  const int64_t buffer = align_up(checked_mul({n - 1, rows, hl, dim, eb}, "max_rows"), kAlign);
  const int64_t headers = view + checked_mul({kDataFlagBuffers, buffer}, "max_rows");
  l.part_values[0] = 0;        // view [row][src*H_loc + h][dim]
  l.part_values[1] = view;     // buffer 0 [peer][row][h][dim]; buffer 1 follows
  l.part_values[2] = buffer;   // bytes of one buffer
  l.part_values[3] = headers;  // call headers [buffer 0, buffer 1, view][peer][16 bytes]
  l.slot_bytes = headers + align_up((kQueryViewHeaders + 1) * (n - 1) * kHeaderFields * 4, kAlign);
}

QueryGeometry QueryGeometry::of(const Workspace& ws) {
  const auto& p = ws.params;
  const auto& o = ws.layout.part_values;
  return {p[0], p[1], p[2], p[3], o[0], o[1], o[2], o[3], query_canonical(p[3])};
}

QueryShape check_query_inputs(const at::Tensor& ql_nope, const at::Tensor& q_pe,
                              const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const std::optional<at::Tensor>& q_scale, at::ScalarType out_dtype) {
  check_dim(ql_nope, "ql_nope", 3);
  check_dim(q_pe, "q_pe", 3);
  check_dtype(ql_nope, "ql_nope", at::kBFloat16);
  check_dtype(q_pe, "q_pe", at::kBFloat16);
  check_size(q_pe, "q_pe", 0, ql_nope.size(0));
  check_size(q_pe, "q_pe", 1, ql_nope.size(1));
  SDCP_CHECK_ARG(ql_nope.stride(2) == 1, "ql_nope", "unit stride in the last dimension",
                 "strides " << ql_nope.strides());
  SDCP_CHECK_ARG(q_pe.stride(2) == 1, "q_pe", "unit stride in the last dimension",
                 "strides " << q_pe.strides());
  const int64_t rope = q_pe.size(2);
  SDCP_CHECK_ARG(rope % 2 == 0 && rope > 0, "q_pe", "an even, positive last dimension", rope);
  check_dim(positions, "positions", 1);
  check_size(positions, "positions", 0, ql_nope.size(0));
  SDCP_CHECK_ARG(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                 "positions", "dtype int64 or int32", "dtype " << positions.scalar_type());
  check_dim(cos_sin_cache, "cos_sin_cache", 2);
  check_size(cos_sin_cache, "cos_sin_cache", 1, rope);
  SDCP_CHECK_ARG(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == at::kBFloat16,
                 "cos_sin_cache", "dtype float32 or bfloat16", "dtype " << cos_sin_cache.scalar_type());
  check_contiguous(cos_sin_cache, "cos_sin_cache");
  check_same_device(q_pe, "q_pe", ql_nope, "ql_nope");
  check_same_device(positions, "positions", ql_nope, "ql_nope");
  check_same_device(cos_sin_cache, "cos_sin_cache", ql_nope, "ql_nope");
  SDCP_CHECK_ARG(out_dtype == at::kBFloat16 || out_dtype == at::kFloat8_e4m3fn, "out_dtype",
                 "bfloat16 or float8_e4m3fn", out_dtype);
  if (q_scale.has_value()) {
    const auto& s = *q_scale;
    SDCP_CHECK_ARG(s.numel() == 1, "q_scale", "one element", "shape " << s.sizes());
    check_dtype(s, "q_scale", at::kFloat);
    check_same_device(s, "q_scale", ql_nope, "ql_nope");
    SDCP_CHECK_ARG(out_dtype == at::kFloat8_e4m3fn, "q_scale", "None for a bfloat16 output",
                   "a scale tensor");
  }
  return QueryShape{ql_nope.size(0), ql_nope.size(1), ql_nope.size(2), rope};
}

QueryCall prepare_query_call(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                             const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale,
                             int64_t workspace, at::ScalarType out_dtype, bool allocate_out) {
  QueryCall c;
  c.shape = check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype);
  c.ws = resolve_workspace(workspace, WorkspaceKind::kQuery, ql_nope);
  c.geo = QueryGeometry::of(*c.ws);
  const QueryShape& s = c.shape;
  const QueryGeometry& g = c.geo;
  SDCP_CHECK_ARG(s.rows <= g.max_rows, "ql_nope", "at most max_rows = " << g.max_rows << " rows",
                 s.rows << " (larger batches take the collective path)");
  SDCP_CHECK_ARG(s.heads == g.local_heads, "ql_nope", "local_heads = " << g.local_heads << " heads", s.heads);
  SDCP_CHECK_ARG(s.width() == g.head_dim, "ql_nope, q_pe", "nope + rope = " << g.head_dim,
                 s.nope << " + " << s.rope);
  SDCP_CHECK_ARG(static_cast<int64_t>(c10::elementSize(out_dtype)) == g.elem_bytes, "out_dtype",
                 "an element of " << g.elem_bytes << " bytes (the workspace dtype)", out_dtype);
  check_workspace_health(*c.ws);
  if (allocate_out)
    c.out = at::empty({s.rows, c.ws->world_size * s.heads, s.width()}, ql_nope.options().dtype(out_dtype));
  return c;
}

namespace {

// Dtypes whose all-ones element is NaN, so the sentinel is never a value
// (float8_e4m3fnuz and raw bytes have no such NaN: refused).
bool sentinel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kFloat8_e4m3fn ||
         t == at::kFloat8_e5m2;
}

}  // namespace

HeadsCall prepare_all_gather_heads(const at::Tensor& q, int64_t workspace, const at::Tensor& out) {
  check_dim(q, "q", 3);
  SDCP_CHECK_ARG(sentinel_dtype(q.scalar_type()), "q",
                 "dtype bfloat16, float16, float32, float8_e4m3fn or float8_e5m2 (a NaN of all-ones bytes)",
                 "dtype " << q.scalar_type());
  HeadsCall c{resolve_workspace(workspace, WorkspaceKind::kQuery, q), {}, q.size(0), {}};
  c.geo = QueryGeometry::of(*c.ws);
  const QueryGeometry& g = c.geo;
  SDCP_CHECK_ARG(c.rows <= g.max_rows, "q", "at most max_rows = " << g.max_rows << " rows",
                 c.rows << " (larger batches take the collective path)");
  check_size(q, "q", 1, g.local_heads);
  check_size(q, "q", 2, g.head_dim);
  SDCP_CHECK_ARG(static_cast<int64_t>(q.element_size()) == g.elem_bytes, "q",
                 "elements of " << g.elem_bytes << " bytes (the workspace dtype)", q.scalar_type());
  check_contiguous(q, "q");
  const int64_t heads = c.ws->world_size * g.local_heads;
  SDCP_CHECK_ARG(out.sizes() == at::IntArrayRef({c.rows, heads, g.head_dim}), "out",
                 "shape [" << c.rows << ", " << heads << ", " << g.head_dim << "]", "shape " << out.sizes());
  check_dtype(out, "out", q.scalar_type());
  check_contiguous(out, "out");
  check_same_device(out, "out", q, "q");
  check_workspace_health(*c.ws);
  return c;
}

ReleaseCall prepare_query_release(const at::Tensor& view, int64_t workspace) {
  ReleaseCall c{resolve_workspace(workspace, WorkspaceKind::kQuery, view), {}, 0};
  c.geo = QueryGeometry::of(*c.ws);
  const QueryGeometry& g = c.geo;
  const void* mine = query_view(*c.ws, g, c.ws->rank);
  SDCP_CHECK_ARG(view.data_ptr() == mine || view.numel() == 0, "inbox",  // an empty tensor has no address
                 "the view of this rank's inbox that gather_view() returned (address " << mine << ")",
                 "a tensor at " << static_cast<const void*>(view.data_ptr()));
  check_dim(view, "inbox", 3);
  SDCP_CHECK_ARG(view.size(0) <= g.max_rows, "inbox", "at most max_rows = " << g.max_rows << " rows", view.size(0));
  check_size(view, "inbox", 1, c.ws->world_size * g.local_heads);
  check_size(view, "inbox", 2, g.head_dim);
  SDCP_CHECK_ARG(static_cast<int64_t>(view.element_size()) == g.elem_bytes, "inbox",
                 "elements of " << g.elem_bytes << " bytes (the workspace dtype)", view.scalar_type());
  c.rows = view.size(0);
  check_workspace_health(*c.ws);
  return c;
}

namespace {

// Allocates the gathered query and runs the `_out` op of the input's backend
// through the dispatcher.
at::Tensor query_all_gather_heads(const at::Tensor& q, int64_t workspace, int64_t tag) {
  check_call_tag(tag);  // before the workspace is resolved (which refuses a poisoned one): arguments first
  check_dim(q, "q", 3);
  const auto ws = resolve_workspace(workspace, WorkspaceKind::kQuery, q);
  auto out = at::empty({q.size(0), ws->world_size * q.size(1), q.size(2)}, q.options());
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sdcp::query_all_gather_heads_out", "")
                             .typed<void(const at::Tensor&, int64_t, at::Tensor&, int64_t)>();
  op.call(q, workspace, out, tag);
  return out;
}

}  // namespace

// One implementation for both backends (the fake lives in torch_sdcp/fake.py).
TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("query_all_gather_heads", &query_all_gather_heads);
}

#ifdef SDCP_WITH_CUDA
TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("query_all_gather_heads", &query_all_gather_heads);
}
#endif

namespace {

// A call header's flags word (query_call_flags in query.h): the op, and for
// the producer its RoPE style and whether it quantised with a scale.
std::string query_flags_text(uint32_t v) {
  static const char* ops[] = {"an unknown op", "query_gather", "query_all_gather_heads", "query_publish"};
  std::string s = ops[v & 3u];
  if ((v & 3u) == 1u || (v & 3u) == 3u)
    s += cat(" (", (v & 4u) ? "neox" : "interleaved", " RoPE, ", (v & 8u) ? "with" : "without", " q_scale)");
  return s;
}

// The view: one buffer with its own call index.
std::string query_view_where(uint64_t view_call) {
  return cat("view buffer, view call ", view_call == ~uint64_t{0} ? std::string("unknown") : std::to_string(view_call));
}

// A position outside cos_sin_cache (the producer kernels' record: field =
// row, mine = the position saturated to int32, theirs = the cache rows).
std::string query_bad_input_text(const DataFlagError& e) {
  const bool saturated = e.mine == 0x7FFFFFFFu || e.mine == 0x80000000u;
  return cat("argument 'positions': ", "expected values in [0, ", e.theirs, ") (the rows of cos_sin_cache), got ",
             saturated ? (static_cast<int32_t>(e.mine) < 0 ? "a value below " : "a value of at least ") : "",
             static_cast<int32_t>(e.mine), " at row ", e.field,
             "; positions are checked on the device only (a host check would synchronise the stream)");
}

// The copying calls' header set is call % 2, the view's its own.
const uint32_t* query_header_entry(const Workspace& ws, int64_t src, uint64_t call, bool view) {
  return query_header(ws, QueryGeometry::of(ws), ws.rank, src,
                      view ? kQueryViewHeaders : static_cast<int64_t>(call % kDataFlagBuffers));
}

const uint64_t* query_view_counter(const Workspace& ws) { return &query_control(ws, ws.rank)->view_call; }

}  // namespace

const FamilyInfo kQueryFamily = {
    .name = "query",
    .layout = query_layout,
    .rows_unit = " rows",
    .flags_text = query_flags_text,
    .view_where = query_view_where,
    .view_release_wait = "to release the previous view call",
    .view_release_hint = "the peer stopped participating, its reader of the last view did not finish, or it did "
                         "not call release()",
    .bad_input_reason = "a kernel on that rank met bad input (a position outside cos_sin_cache)",
    .bad_input_text = query_bad_input_text,
    .header_entry = query_header_entry,
    .view_counter = query_view_counter,
};

}  // namespace sdcp
