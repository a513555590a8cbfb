// Output/LSE boundary: argument checks, the inbox layout and the allocating
// op, shared by the CPU and CUDA kernels. `output_lse_combine` is registered
// once for both backends, on top of `output_lse_combine_out`.

#include "output_lse.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace sdcp {

void output_lse_layout(const std::vector<int64_t>& p, int64_t n, WorkspaceLayout& l) {
  check_params(p, 4, "max_rows, total_heads, head_dim, elem_bytes");
  const int64_t rows = p[0], heads = p[1], dim = p[2], eb = p[3];
  TORCH_CHECK_VALUE(heads % n == 0, cat("torch_sdcp: argument 'total_heads': expected a multiple of the world size ",
                    n, ", got ", heads));
  const int64_t hl = heads / n;
  l.slots = kDataFlagBuffers;
  // One entry per peer: this rank's own shard is read in place from partial_out.
  const int64_t out_bytes = align_up(checked_mul({n - 1, rows, hl, dim, eb}, "max_rows"), kAlign);
  const int64_t lse_bytes = align_up(checked_mul({n - 1, rows, hl, 4}, "max_rows"), kAlign);
  l.part_values[0] = 0;          // payload inbox
  l.part_values[1] = out_bytes;  // LSE inbox
  l.part_values[2] = out_bytes + lse_bytes;  // call headers [peer][16 bytes] (dataflag.h)
  l.slot_bytes = out_bytes + lse_bytes + align_up((n - 1) * kHeaderFields * 4, kAlign);
}

OutputLSEGeometry OutputLSEGeometry::of(const Workspace& ws) {
  const auto& p = ws.params;
  return {p[0], p[1], p[2], p[3], p[1] / ws.world_size, ws.layout.part_values[0], ws.layout.part_values[1],
          ws.layout.part_values[2]};
}

namespace {

// A payload `out` [*lead, H, D] (float, packed) and its LSE `lse` [*lead', H]
// fp32 (packed) on one device, where lse's leading dims are out's after the
// first `skip` of lse (lse_correct's gathered LSE has one more, the shard).
void check_payload_and_lse(const at::Tensor& out, const at::Tensor& lse, const char* lse_name, int64_t out_dims,
                           int64_t skip) {
  check_dim(out, "partial_out", out_dims);
  check_dim(lse, lse_name, out_dims - 1 + skip);
  check_float_dtype(out, "partial_out");
  check_dtype(lse, lse_name, at::kFloat);
  check_contiguous(out, "partial_out");
  check_contiguous(lse, lse_name);
  for (int64_t d = 0; d < out_dims - 1; ++d) check_size(lse, lse_name, d + skip, out.size(d));
  check_same_device(lse, lse_name, out, "partial_out");
}

}  // namespace

void check_partial_inputs(const at::Tensor& partial_out, const at::Tensor& partial_lse) {
  check_payload_and_lse(partial_out, partial_lse, "partial_lse", 3, 0);
}

void check_stacked_partials(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t max_shards) {
  check_payload_and_lse(partial_out, partial_lse, "partial_lse", 4, 0);
  const int64_t n = partial_out.size(0);
  SDCP_CHECK_ARG(n >= 1 && n <= max_shards, "partial_out", "1.." << max_shards << " shards at dim 0", n);
}

void check_lse_correct_inputs(const at::Tensor& partial_out, const at::Tensor& gathered_lse, int64_t rank) {
  check_payload_and_lse(partial_out, gathered_lse, "gathered_lse", 3, 1);
  const int64_t n = gathered_lse.size(0);
  SDCP_CHECK_ARG(n >= 1, "gathered_lse", "at least one shard at dim 0", n);
  SDCP_CHECK_ARG(rank >= 0 && rank < n, "rank", "a rank in [0, " << n << ")", rank);
}

namespace {

void check_index_tensor(const at::Tensor& t, const char* name, const at::Tensor& partial_out) {
  SDCP_CHECK_ARG(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, "dtype int32 or int64",
                 t.scalar_type());
  check_contiguous(t, name);
  check_same_device(t, name, partial_out, "partial_out");
}

}  // namespace

RowMask check_row_mask(const c10::optional<at::Tensor>& seq_lens, const c10::optional<at::Tensor>& query_start_loc,
                       const at::Tensor& partial_out) {
  const bool has_seq = seq_lens.has_value(), has_qsl = query_start_loc.has_value();
  SDCP_CHECK_ARG(has_seq == has_qsl, (has_seq ? "query_start_loc" : "seq_lens"),
                 "a tensor, as 'seq_lens' and 'query_start_loc' are given both or neither",
                 "None beside a given '" << (has_seq ? "seq_lens" : "query_start_loc") << "'");
  if (!has_seq) return {};
  const at::Tensor& s = *seq_lens;
  const at::Tensor& q = *query_start_loc;
  check_dim(s, "seq_lens", 1);
  check_dim(q, "query_start_loc", 1);
  SDCP_CHECK_ARG(q.size(0) == s.size(0) + 1, "query_start_loc",
                 s.size(0) + 1 << " entries (len(seq_lens) + 1)", q.size(0));
  // The CUDA kernel's row lookup indexes requests in 32 bits, with headroom for its steps.
  SDCP_CHECK_ARG(s.size(0) < (int64_t{1} << 30), "seq_lens", "fewer than 2**30 requests", s.size(0));
  check_index_tensor(s, "seq_lens", partial_out);
  check_index_tensor(q, "query_start_loc", partial_out);
  return {true, s.data_ptr(), q.data_ptr(), s.size(0), s.scalar_type() == at::kLong, q.scalar_type() == at::kLong};
}

CombineCall prepare_combine_out(const at::Tensor& partial_out, const at::Tensor& partial_lse, int64_t workspace,
                                const at::Tensor& out, const at::Tensor& out_lse) {
  check_partial_inputs(partial_out, partial_lse);
  CombineCall c{resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out), {}, partial_out.size(0)};
  c.geo = OutputLSEGeometry::of(*c.ws);
  const auto& g = c.geo;
  SDCP_CHECK_ARG(c.rows <= g.max_rows, "partial_out", "at most max_rows = " << g.max_rows << " rows",
                 c.rows << " (larger batches take the collective path)");
  check_size(partial_out, "partial_out", 1, g.total_heads);
  check_size(partial_out, "partial_out", 2, g.head_dim);
  SDCP_CHECK_ARG(static_cast<int64_t>(partial_out.element_size()) == g.elem_bytes, "partial_out",
                 "elements of " << g.elem_bytes << " bytes (the workspace dtype)", partial_out.scalar_type());
  const int64_t hl = g.local_heads, d = g.head_dim;
  SDCP_CHECK_ARG(out.sizes() == at::IntArrayRef({c.rows, hl, d}), "out",
                 "shape [" << c.rows << ", " << hl << ", " << d << "]", "shape " << out.sizes());
  SDCP_CHECK_ARG(out_lse.sizes() == at::IntArrayRef({c.rows, hl}), "out_lse",
                 "shape [" << c.rows << ", " << hl << "]", "shape " << out_lse.sizes());
  check_dtype(out, "out", partial_out.scalar_type());
  check_dtype(out_lse, "out_lse", at::kFloat);
  check_contiguous(out, "out");
  check_contiguous(out_lse, "out_lse");
  check_same_device(out, "out", partial_out, "partial_out");
  check_same_device(out_lse, "out_lse", partial_out, "partial_out");
  return c;
}

namespace {

// Allocates the caller-owned outputs and runs the `_out` op of the inputs'
// backend through the dispatcher.
std::tuple<at::Tensor, at::Tensor> output_lse_combine(const at::Tensor& partial_out, const at::Tensor& partial_lse,
                                                      int64_t workspace, bool base2,
                                                      const c10::optional<at::Tensor>& seq_lens,
                                                      const c10::optional<at::Tensor>& query_start_loc,
                                                      int64_t tag) {
  check_call_tag(tag);  // before the workspace is resolved (which refuses a poisoned one): arguments first
  check_partial_inputs(partial_out, partial_lse);
  const auto ws = resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out);
  const int64_t n = ws->world_size;
  SDCP_CHECK_ARG(partial_out.size(1) % n == 0, "partial_out", "heads divisible by the world size " << n,
                 partial_out.size(1));
  auto out = at::empty({partial_out.size(0), partial_out.size(1) / n, partial_out.size(2)}, partial_out.options());
  auto lse = at::empty({partial_out.size(0), partial_out.size(1) / n}, partial_lse.options());
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sdcp::output_lse_combine_out", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, int64_t, bool, at::Tensor&,
                                         at::Tensor&, const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&, int64_t)>();
  op.call(partial_out, partial_lse, workspace, base2, out, lse, seq_lens, query_start_loc, tag);
  return {out, lse};
}

}  // namespace

// One implementation for both backends (the fake lives in torch_sdcp/fake.py).
TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("output_lse_combine", &output_lse_combine);
}

#ifdef SDCP_WITH_CUDA
TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("output_lse_combine", &output_lse_combine);
}
#endif

// A call header's flags word: the LSE base.
namespace {

std::string output_lse_flags_text(uint32_t v) { return cat("lse base ", v ? "2" : "e"); }

const uint32_t* output_lse_header_entry(const Workspace& ws, int64_t src, uint64_t call, bool) {
  return buffer_header(ws, OutputLSEGeometry::of(ws).header_offset, ws.rank, src,
                       static_cast<int64_t>(call % kDataFlagBuffers));
}

}  // namespace

const FamilyInfo kOutputLSEFamily = {
    .name = "output_lse",
    .layout = output_lse_layout,
    .rows_unit = " rows",
    .flags_text = output_lse_flags_text,
    .header_entry = output_lse_header_entry,
};

}  // namespace sdcp
