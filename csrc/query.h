// Query boundary: what the CPU and CUDA kernels share (argument checks, typed
// workspace geometry, output allocation). Data-as-flag signalling
// (docs/PROTOCOL.md, version 4): two rotating buffers for the copying ops,
// one fixed view buffer with a release acknowledgement for the zero-copy view.
#pragma once

#include "sdcp.h"

#include <optional>

namespace sdcp {

struct QueryShape {
  int64_t rows, heads, nope, rope;
  int64_t width() const { return nope + rope; }
};

// The view's part of each rank's control region (after its DataFlagControl).
// `released[src]` is written by rank src only: the number of view calls src
// has released (its reader finished and its view rows are sentinel again).
struct QueryControl {
  uint64_t view_call;        // view calls this rank has released (its next view call)
  uint32_t release_arrived;  // blocks of the running release that have finished
  uint32_t pad;
  uint64_t released[kMaxWorld];
};
// After the DataFlagControl (its call counters fill most of the 4 KiB).
constexpr int64_t kQueryControlOffset = (sizeof(DataFlagControl) + 63) / 64 * 64;
// compute_layout gives a data-as-flag workspace 4 KiB of control.
static_assert(kQueryControlOffset + sizeof(QueryControl) <= 4096, "QueryControl must fit in the control region");

// Workspace params [max_rows, local_heads, head_dim, elem_bytes], decoded once.
// One slot holds
//   the view       [max_rows][src * local_heads + h][head_dim] (final layout, fixed address)
//   two buffers    [peer_slot(src, dst)][max_rows][local_heads][head_dim] each
//                  (peer entries only: a rank's own heads never travel)
//   call headers   [buffer 0, buffer 1, view][peer_slot(src, dst)][16 bytes] (dataflag.h)
struct QueryGeometry {
  int64_t max_rows, local_heads, head_dim, elem_bytes;
  int64_t view_offset;     // inside the slot
  int64_t buffers_offset;  // buffer 0; buffer 1 follows at buffer_bytes
  int64_t buffer_bytes;
  int64_t header_offset;   // the call headers, inside the slot
  uint32_t canonical;      // what a sentinel word of the payload is rewritten to
  int64_t item_bytes() const { return head_dim * elem_bytes; }
  int64_t entry_bytes() const { return max_rows * local_heads * item_bytes(); }  // one peer's entry
  static QueryGeometry of(const Workspace& ws);
};

void query_layout(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);

// The rewrite of a sentinel word for elements of `elem_bytes` (1: float8 NaN
// bytes, 2 or 4: bf16/fp16 NaN pair or fp32 NaN).
inline uint32_t query_canonical(int64_t elem_bytes) {
  return elem_bytes == 1 ? kCanonicalNaNQuad : kCanonicalNaNPair;
}

inline QueryControl* query_control(const Workspace& ws, int64_t r) {
  return reinterpret_cast<QueryControl*>(ws.region(r) + kQueryControlOffset);
}
inline uint8_t* query_view(const Workspace& ws, const QueryGeometry& g, int64_t r) {
  return ws.slot_data(r, 0) + g.view_offset;
}
// The header set of the view (after the two rotating buffers' sets).
constexpr int64_t kQueryViewHeaders = kDataFlagBuffers;
// Rank dst's header entry for source src: set `which` is call % 2 for the
// copying calls, kQueryViewHeaders for the view.
inline uint32_t* query_header(const Workspace& ws, const QueryGeometry& g, int64_t dst, int64_t src, int64_t which) {
  return reinterpret_cast<uint32_t*>(ws.slot_data(dst, 0) + g.header_offset) +
         (which * (ws.world_size - 1) + peer_slot(src, dst, ws.world_size)) * kHeaderFields;
}

// The header flags of a query call: the op (1 query_gather, 2
// query_all_gather_heads, 3 query_publish), then for the producer bit 2 neox
// RoPE and bit 3 a q_scale (query_flags_text in query.cpp names them in a mismatch).
enum QueryOp : uint32_t { kQueryGatherOp = 1, kQueryHeadsOp = 2, kQueryPublishOp = 3 };
inline uint32_t query_call_flags(QueryOp op, bool neox = false, bool scaled = false) {
  return op | (neox ? 4u : 0u) | (scaled ? 8u : 0u);
}
// The flags bits that name the op: compared against a void header too (a
// void gather is still not an all_gather_heads), unlike the options
// (call_header_mismatch in dataflag.h).
constexpr uint32_t kQueryOpBits = 3u;

// Rank dst's entry for source src in the rotating buffer of call `call`.
inline uint8_t* query_entry(const Workspace& ws, const QueryGeometry& g, int64_t dst, int64_t src, uint64_t call) {
  return ws.slot_data(dst, 0) + g.buffers_offset + static_cast<int64_t>(call % kDataFlagBuffers) * g.buffer_bytes +
         peer_slot(src, dst, ws.world_size) * g.entry_bytes();
}

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
  CallHeader header;  // rows, the output dtype, query_call_flags, the geometry hash
};

QueryCall prepare_query_call(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                             const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale,
                             int64_t workspace, at::ScalarType out_dtype, bool allocate_out);

// One query_all_gather_heads_out call: q [T, H_loc, W] and out [T, N*H_loc, W]
// checked against the workspace.
struct HeadsCall {
  std::shared_ptr<const Workspace> ws;
  QueryGeometry geo;
  int64_t rows;
  CallHeader header;  // rows, q's dtype, query_call_flags, the geometry hash
};

HeadsCall prepare_all_gather_heads(const at::Tensor& q, int64_t workspace, const at::Tensor& out);

// One query_release call: `view` checked to be the first rows of this rank's view.
struct ReleaseCall {
  std::shared_ptr<const Workspace> ws;
  QueryGeometry geo;
  int64_t rows;
};

ReleaseCall prepare_query_release(const at::Tensor& view, int64_t workspace);

// The ops of one backend, written once on top of its launchers:
//   ProduceLaunch(shape, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, out)
//   GatherLaunch(call, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, view)
//   HeadsLaunch(call, q, out)
//   ReleaseLaunch(call, view)
// Every call carries a call header (dataflag.h), compared by each consumer. A
// call of 0 rows is still a call: its kernel (one block) exchanges the
// headers and advances the index, so a peer with rows meets a named rows
// mismatch and the next calls stay paired.
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
                           int64_t workspace, bool neox, at::ScalarType out_dtype, int64_t tag) {
  check_call_tag(tag);
  QueryCall c = prepare_query_call(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype, true);
  c.header = call_header(*c.ws, c.shape.rows, static_cast<int64_t>(out_dtype),
                         query_call_flags(kQueryGatherOp, neox, q_scale.has_value()), tag);
  GatherLaunch(c, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, false);
  return *c.out;
}

template <auto GatherLaunch>
void query_publish_op(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                      const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, int64_t workspace,
                      bool neox, at::ScalarType out_dtype, int64_t tag) {
  check_call_tag(tag);
  QueryCall c = prepare_query_call(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype, false);
  c.header = call_header(*c.ws, c.shape.rows, static_cast<int64_t>(out_dtype),
                         query_call_flags(kQueryPublishOp, neox, q_scale.has_value()), tag);
  GatherLaunch(c, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, true);
}

template <auto HeadsLaunch>
void query_all_gather_heads_out_op(const at::Tensor& q, int64_t workspace, at::Tensor& out, int64_t tag) {
  check_call_tag(tag);
  HeadsCall c = prepare_all_gather_heads(q, workspace, out);
  c.header = call_header(*c.ws, c.rows, static_cast<int64_t>(q.scalar_type()), query_call_flags(kQueryHeadsOp), tag);
  HeadsLaunch(c, q, out);
}

template <auto ReleaseLaunch>
void query_release_op(const at::Tensor& view, int64_t workspace) {
  const ReleaseCall c = prepare_query_release(view, workspace);
  ReleaseLaunch(c, view);
}

}  // namespace sdcp
