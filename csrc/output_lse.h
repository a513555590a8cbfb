// Output/LSE boundary: what the CPU and CUDA kernels share (argument checks,
// typed workspace geometry, output allocation).
#pragma once

#include "sdcp.h"

namespace sdcp {

// Workspace params [max_rows, total_heads, head_dim, elem_bytes] and the inbox
// layout of one data-as-flag buffer, decoded once (one entry per peer,
// peer_slot(src, dst)): payload [peer][max_rows][local_heads][head_dim],
// LSE [peer][max_rows][local_heads], then the call headers [peer][16 bytes].
struct OutputLSEGeometry {
  int64_t max_rows, total_heads, head_dim, elem_bytes;
  int64_t local_heads;
  int64_t out_inbox_offset;  // inside a slot
  int64_t lse_inbox_offset;
  int64_t header_offset;     // call headers [peer][kHeaderFields words] (dataflag.h)
  static OutputLSEGeometry of(const Workspace& ws);
};

void output_lse_layout(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);

// partial_out [T, H, D] (bf16/fp16/fp32, packed) and partial_lse [T, H] fp32.
void check_partial_inputs(const at::Tensor& partial_out, const at::Tensor& partial_lse);

// Stacked partials of lse_combine: partial_out [N, T, H, D], partial_lse [N, T, H].
void check_stacked_partials(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t max_shards);

// lse_correct: partial_out [T, H, D], gathered_lse [N, T, H] fp32, 0 <= rank < N.
void check_lse_correct_inputs(const at::Tensor& partial_out, const at::Tensor& gathered_lse, int64_t rank);

// One output_lse_combine_out call, checked against its workspace.
struct CombineCall {
  std::shared_ptr<const Workspace> ws;
  OutputLSEGeometry geo;
  int64_t rows;
  CallHeader header;  // what this call is (rows, dtype, lse base, geometry; dataflag.h)
};

CombineCall prepare_combine_out(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t workspace,
                                const at::Tensor& out, const at::Tensor& out_lse);

// The ops of one backend, written once on top of its launchers:
//   StackedLaunch(partial_out, partial_lse, base2, out, lse)         (lse_combine)
//   CombineLaunch(call, partial_out, partial_lse, base2, out, out_lse) (output_lse_combine_out)
// `output_lse_combine` is registered once for both backends (output_lse.cpp).
template <auto StackedLaunch, int64_t kMaxShards>
std::tuple<at::Tensor, at::Tensor> lse_combine_op(const at::Tensor& partial_out, const at::Tensor& partial_lse,
                                                  bool base2) {
  check_stacked_partials(partial_out, partial_lse, kMaxShards);
  auto out = at::empty({partial_out.size(1), partial_out.size(2), partial_out.size(3)}, partial_out.options());
  auto lse = at::empty({partial_out.size(1), partial_out.size(2)}, partial_lse.options());
  if (out.numel() > 0) StackedLaunch(partial_out, partial_lse, base2, out, lse);
  return {out, lse};
}

// CorrectLaunch(partial_out, gathered_lse, rank, base2, out [H, T, D], lse [T, H]) (lse_correct)
template <auto CorrectLaunch>
std::tuple<at::Tensor, at::Tensor> lse_correct_op(const at::Tensor& partial_out, const at::Tensor& gathered_lse,
                                                  int64_t rank, bool base2) {
  check_lse_correct_inputs(partial_out, gathered_lse, rank);
  auto out = at::empty({partial_out.size(1), partial_out.size(0), partial_out.size(2)}, partial_out.options());
  auto lse = at::empty({partial_out.size(0), partial_out.size(1)}, gathered_lse.options());
  if (partial_out.numel() > 0) CorrectLaunch(partial_out, gathered_lse, rank, base2, out, lse);
  return {out, lse};
}

template <auto CombineLaunch>
void output_lse_combine_out_op(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t workspace,
                               bool base2, at::Tensor& out, at::Tensor& out_lse) {
  CombineCall c = prepare_combine_out(partial_out, partial_lse, workspace, out, out_lse);
  c.header = make_call_header(c.rows, static_cast<int64_t>(partial_out.scalar_type()), base2 ? 1u : 0u,
                              c.ws->geometry_hash);
  CombineLaunch(c, partial_out, partial_lse, base2, out, out_lse);
}

}  // namespace sdcp
