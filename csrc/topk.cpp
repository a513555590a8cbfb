// Top-K boundary: argument checks, the shard layout and output allocation
// shared by the CPU and CUDA kernels.

#include "topk.h"

#include <algorithm>

namespace sdcp {

void topk_layout(const std::vector<int64_t>& p, int64_t n, WorkspaceLayout& l) {
  check_params(p, 3, "max_rows, candidates_per_rank, k");
  const int64_t rows = p[0], c = p[1], k = p[2];
  TORCH_CHECK_VALUE(k <= checked_mul({n, c}, "candidates_per_rank"),
                    cat("torch_sdcp: argument 'k': expected at most world_size * candidates_per_rank = ", n * c,
                        ", got ", k));
  // Data-as-flag: each owner pushes its best min(C, k) keys per row into
  // every peer's buffer; its own list never travels.
  l.slots = kDataFlagBuffers;
  const int64_t inbox = align_up(checked_mul({n - 1, rows, std::min(c, k), 8}, "max_rows"), kAlign);
  l.part_values[0] = 0;                 // inbox [peer][row][keys_per_row]
  l.part_values[1] = std::min(c, k);    // keys per row
  l.part_values[2] = inbox;             // call headers [peer][16 bytes] (dataflag.h)
  l.slot_bytes = inbox + align_up((n - 1) * kHeaderFields * 4, kAlign);
}

TopKGeometry TopKGeometry::of(const Workspace& ws) {
  const auto& p = ws.params;
  return {p[0], p[1], p[2], ws.layout.part_values[1], ws.layout.part_values[0], ws.layout.part_values[2]};
}

at::Tensor prepare_topk_select(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
  check_dim(scores, "scores", 2);
  check_dim(ids, "ids", 2);
  check_dtype(scores, "scores", at::kFloat);
  check_dtype(ids, "ids", at::kInt);
  check_size(ids, "ids", 0, scores.size(0));
  check_size(ids, "ids", 1, scores.size(1));
  check_same_device(ids, "ids", scores, "scores");
  SDCP_CHECK_ARG(scores.size(1) == 0 || scores.stride(1) == 1, "scores", "unit stride in the last dimension",
                 "strides " << scores.strides());
  SDCP_CHECK_ARG(ids.size(1) == 0 || ids.stride(1) == 1, "ids", "unit stride in the last dimension",
                 "strides " << ids.strides());
  SDCP_CHECK_ARG(k >= 1, "k", "k >= 1", k);
  return at::empty({scores.size(0), k}, ids.options());
}

TopKMergeCall prepare_topk_merge(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k,
                                 int64_t tag) {
  check_call_tag(tag);
  TopKMergeCall c;
  c.out = prepare_topk_select(scores, ids, k);
  c.rows = scores.size(0);
  c.ws = resolve_workspace(workspace, WorkspaceKind::kTopK, scores);
  c.geo = TopKGeometry::of(*c.ws);
  SDCP_CHECK_ARG(c.rows <= c.geo.max_rows, "scores", "at most max_rows = " << c.geo.max_rows << " rows",
                 c.rows << " (larger batches take the collective path)");
  SDCP_CHECK_ARG(scores.size(1) == c.geo.candidates_per_rank, "scores",
                 "candidates_per_rank = " << c.geo.candidates_per_rank << " columns", scores.size(1));
  SDCP_CHECK_ARG(k == c.geo.k, "k", "the workspace's k = " << c.geo.k, k);
  // The flags word is unused: k and C are parameters, in the geometry hash.
  c.header = call_header(*c.ws, c.rows, static_cast<int64_t>(scores.scalar_type()), 0u, tag);
  check_workspace_health(*c.ws);
  return c;
}

// The flags word is unused (k and C are in the geometry hash).
namespace {

const uint32_t* topk_header_entry(const Workspace& ws, int64_t src, uint64_t call, bool) {
  return buffer_header(ws, TopKGeometry::of(ws).header_offset, ws.rank, src,
                       static_cast<int64_t>(call % kDataFlagBuffers));
}

}  // namespace

const FamilyInfo kTopKFamily = {
    .name = "topk",
    .layout = topk_layout,
    .rows_unit = " rows",
    .header_entry = topk_header_entry,
};

}  // namespace sdcp
