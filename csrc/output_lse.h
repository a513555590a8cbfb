// Output/LSE boundary: what the CPU and CUDA kernels share (argument checks,
// typed workspace geometry, output allocation).
#pragma once

#include "sdcp.h"
#include "semantics.h"

namespace sdcp {

// vLLM's empty-shard mask (mask_dcp_empty_shards_; torch_sdcp.reference.
// mask_empty_shards): row t gets LSE -inf (no weight) when it is CUDA-graph
// padding (t >= query_start_loc[R]) or its request's local seq_len is 0; the
// request of row t is the number of request ends query_start_loc[1..R] at or
// before t, clamped to R - 1; with no request (R = 0) every row is empty. Each
// producer masks its own LSE (its seq_lens are local). `enabled` false: no
// mask (an empty seq_lens may have a null data pointer, so that cannot say it).
// The indices are int32 or int64 (`wide`), each tensor on its own.
struct RowMask {
  bool enabled = false;
  const void* seq_lens = nullptr;         // [R]
  const void* query_start_loc = nullptr;  // [R + 1], ascending
  int64_t requests = 0;                   // R
  bool seq_lens_wide = false, query_start_loc_wide = false;

  SDCP_HD int64_t seq_len(int64_t r) const {
    return seq_lens_wide ? static_cast<const int64_t*>(seq_lens)[r] : static_cast<const int32_t*>(seq_lens)[r];
  }
  SDCP_HD int64_t boundary(int64_t r) const {
    return query_start_loc_wide ? static_cast<const int64_t*>(query_start_loc)[r]
                                : static_cast<const int32_t*>(query_start_loc)[r];
  }
  // Binary search: the number of ends boundary(1..R) <= t, over ascending ends.
  SDCP_HD bool row_empty(int64_t t) const {
    if (requests == 0) return true;
    if (t >= boundary(requests)) return true;  // padding
    int64_t lo = 0, hi = requests;               // answer in [lo, hi]
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;         // is end mid + 1 <= t?
      if (boundary(mid + 1) <= t) lo = mid + 1;
      else hi = mid;
    }
    const int64_t r = lo < requests - 1 ? lo : requests - 1;
    return seq_len(r) == 0;
  }
};

// seq_lens [R] and query_start_loc [R + 1], both or neither, 1-D int32/int64,
// on partial_out's device; an empty RowMask for neither.
RowMask check_row_mask(const c10::optional<at::Tensor>& seq_lens, const c10::optional<at::Tensor>& query_start_loc,
                       const at::Tensor& partial_out);

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
  RowMask mask;       // this producer's empty rows (none without seq_lens)
};

CombineCall prepare_combine_out(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t workspace,
                                const at::Tensor& out, const at::Tensor& out_lse);

// The ops of one backend, written once on top of its launchers:
//   StackedLaunch(partial_out, partial_lse, base2, out, lse)         (lse_combine)
//   CombineLaunch(call, partial_out, partial_lse, base2, out, out_lse) (output_lse_combine_out; call.mask)
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
                               bool base2, at::Tensor& out, at::Tensor& out_lse,
                               const c10::optional<at::Tensor>& seq_lens,
                               const c10::optional<at::Tensor>& query_start_loc, int64_t tag) {
  check_call_tag(tag);
  CombineCall c = prepare_combine_out(partial_out, partial_lse, workspace, out, out_lse);
  c.mask = check_row_mask(seq_lens, query_start_loc, partial_out);
  check_workspace_health(*c.ws);
  c.header = call_header(*c.ws, c.rows, static_cast<int64_t>(partial_out.scalar_type()), base2 ? 1u : 0u, tag);
  CombineLaunch(c, partial_out, partial_lse, base2, out, out_lse);
}

}  // namespace sdcp
