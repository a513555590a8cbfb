// Query boundary: argument checks, the inbox layout and output allocation
// shared by the CPU and CUDA kernels.

#include "query.h"

namespace sdcp {

void query_layout(const std::vector<int64_t>& p, int64_t n, WorkspaceLayout& l) {
  check_params(p, 4, "max_rows, local_heads, head_dim, elem_bytes");
  const int64_t rows = p[0], hl = p[1], dim = p[2], eb = p[3];
  l.blocks = 256;
  // One slot: the inbox may be read after the call (a zero-copy view), so
  // producers wait for the consumer's acknowledgement before reusing it.
  l.slots = 1;
  l.part_offset[0] = 0;  // inbox [row][src*H_loc + h][dim]
  l.slot_bytes = align_up(checked_mul({rows, n, hl, dim, eb}, "max_rows"), kAlign);
}

QueryGeometry QueryGeometry::of(const Workspace& ws) {
  const auto& p = ws.params;
  return {p[0], p[1], p[2], p[3], ws.layout.part_offset[0]};
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
  if (allocate_out)
    c.out = at::empty({s.rows, c.ws->world_size * s.heads, s.width()}, ql_nope.options().dtype(out_dtype));
  return c;
}

std::shared_ptr<const Workspace> prepare_query_release(const at::Tensor& inbox, int64_t workspace) {
  auto ws = resolve_workspace(workspace, WorkspaceKind::kQuery, inbox);
  SDCP_CHECK_ARG(inbox.data_ptr() == static_cast<void*>(local_inbox(*ws)), "inbox",
                 "the view of this rank's inbox that gather_view() returned (address "
                     << static_cast<const void*>(local_inbox(*ws)) << ")",
                 "a tensor at " << static_cast<const void*>(inbox.data_ptr()));
  return ws;
}

}  // namespace sdcp
