// Query boundary: what the CPU and CUDA kernels share (argument checks, typed
// workspace geometry, output allocation).
#pragma once

#include "sdcp.h"

#include <optional>

namespace sdcp {

struct QueryShape {
  int64_t rows, heads, nope, rope;
  int64_t width() const { return nope + rope; }
};

// Workspace params [max_rows, local_heads, head_dim, elem_bytes] and the inbox
// layout, decoded once: inbox [row][src * local_heads + h][head_dim].
struct QueryGeometry {
  int64_t max_rows, local_heads, head_dim, elem_bytes;
  int64_t inbox_offset;  // inside the slot
  static QueryGeometry of(const Workspace& ws);
};

void query_layout(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);

QueryShape check_query_inputs(const at::Tensor& ql_nope, const at::Tensor& q_pe,
                              const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const std::optional<at::Tensor>& q_scale, at::ScalarType out_dtype);

// One query_gather / query_publish call, checked against its workspace; `out`
// ([T, N*H_loc, nope+rope]) is allocated for a gather only.
struct QueryCall {
  std::shared_ptr<const Workspace> ws;
  QueryGeometry geo;
  QueryShape shape;
  std::optional<at::Tensor> out;
};

QueryCall prepare_query_call(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                             const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale,
                             int64_t workspace, at::ScalarType out_dtype, bool allocate_out);

// The workspace of a query_release call, with `inbox` checked to be the view
// of this rank's inbox.
std::shared_ptr<const Workspace> prepare_query_release(const at::Tensor& inbox, int64_t workspace);

// The ops of one backend, written once on top of its launchers:
//   ProduceLaunch(shape, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, out)
//   GatherLaunch(call, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype)
//   ReleaseLaunch(workspace)
template <auto ProduceLaunch>
at::Tensor query_rope_quant_op(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                               const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                               at::ScalarType out_dtype) {
  const QueryShape s = check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype);
  auto out = at::empty({s.rows, s.heads, s.width()}, ql_nope.options().dtype(out_dtype));
  if (s.rows * s.heads > 0) ProduceLaunch(s, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, out);
  return out;
}

template <auto GatherLaunch>
at::Tensor query_gather_op(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                           const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale,
                           int64_t workspace, bool neox, at::ScalarType out_dtype) {
  const QueryCall c = prepare_query_call(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype, true);
  GatherLaunch(c, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype);
  return *c.out;
}

template <auto GatherLaunch>
void query_publish_op(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                      const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, int64_t workspace,
                      bool neox, at::ScalarType out_dtype) {
  const QueryCall c = prepare_query_call(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype, false);
  GatherLaunch(c, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype);
}

template <auto ReleaseLaunch>
void query_release_op(const at::Tensor& inbox, int64_t workspace) {
  ReleaseLaunch(*prepare_query_release(inbox, workspace), inbox);
}

// This rank's inbox in `ws`.
inline uint8_t* local_inbox(const Workspace& ws) {
  return ws.slot_data(ws.rank, 0) + QueryGeometry::of(ws).inbox_offset;
}

}  // namespace sdcp
