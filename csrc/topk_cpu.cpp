// Top-K boundary, CPU: stable selection over candidate pairs, and the peer
// merge in which every consumer reads the owners' shards in place.

#include "topk.h"

#include "host_signal.h"
#include "semantics.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace sdcp {

void check_topk_inputs(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
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
}

void check_topk_workspace(const Workspace& ws, const at::Tensor& scores, int64_t k) {
  const auto& p = ws.params;  // max_rows, candidates_per_rank, k
  SDCP_CHECK_ARG(scores.size(0) <= p[0], "scores", "at most max_rows = " << p[0] << " rows",
                 scores.size(0) << " (larger batches take the collective path)");
  SDCP_CHECK_ARG(scores.size(1) == p[1], "scores", "candidates_per_rank = " << p[1] << " columns",
                 scores.size(1));
  SDCP_CHECK_ARG(k == p[2], "k", "the workspace's k = " << p[2], k);
}

namespace {

// Selects the k largest keys in `keys` (clobbered) and writes their ids in
// selection order, -1 for the positions no valid candidate fills.
void select_row(std::vector<uint64_t>& keys, int64_t k, int32_t* out) {
  const int64_t m = static_cast<int64_t>(keys.size());
  const int64_t take = std::min(k, m);
  std::partial_sort(keys.begin(), keys.begin() + take, keys.end(), std::greater<uint64_t>());
  for (int64_t i = 0; i < take; ++i) out[i] = topk_key_id(keys[i]);
  for (int64_t i = take; i < k; ++i) out[i] = -1;
}

at::Tensor topk_select_cpu(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const int64_t rows = scores.size(0), m = scores.size(1);
  auto out = at::empty({rows, k}, ids.options());
  const float* s = scores.data_ptr<float>();
  const int32_t* id = ids.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> keys(m);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < m; ++j)
        keys[j] = topk_key(s[t * scores.stride(0) + j], id[t * ids.stride(0) + j]);
      select_row(keys, k, o + t * k);
    }
  });
  return out;
}

at::Tensor topk_merge_cpu(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k) {
  check_topk_inputs(scores, ids, k);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kTopK, scores);
  const Workspace& ws = *ws_ptr;
  check_topk_workspace(ws, scores, k);
  const int64_t rows = scores.size(0), c = scores.size(1), n = ws.world_size;
  const int64_t kk = ws.layout.part_offset[1];  // keys per row in a shard: min(c, k)
  auto shard = [&](int64_t r) {
    return reinterpret_cast<uint64_t*>(ws.slot_data(r, 0) + ws.layout.part_offset[0]);
  };
  const uint64_t epoch = host_next_epoch(ws);
  // One slot: every consumer must have finished reading the previous epoch.
  for (int64_t r = 0; r < n; ++r) host_wait_ack(ws, r, epoch);
  // The owner writes its best kk keys per row once, sorted, into its own shard.
  std::vector<uint64_t> keys(std::max(c, n * kk));
  uint64_t* own = shard(ws.rank);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < c; ++j)
      keys[j] = topk_key(scores.data_ptr<float>()[t * scores.stride(0) + j], ids.data_ptr<int32_t>()[t * ids.stride(0) + j]);
    std::partial_sort(keys.begin(), keys.begin() + kk, keys.begin() + c, std::greater<uint64_t>());
    std::copy(keys.begin(), keys.begin() + kk, own + t * kk);
  }
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  for (int64_t r = 0; r < n; ++r) host_wait(ws, r, epoch);
  // Every consumer reads every owner's sorted shard in place and keeps the best k.
  auto out = at::empty({rows, k}, ids.options());
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t r = 0; r < n; ++r) std::copy(shard(r) + t * kk, shard(r) + (t + 1) * kk, keys.begin() + r * kk);
    std::partial_sort(keys.begin(), keys.begin() + k, keys.begin() + n * kk, std::greater<uint64_t>());
    for (int64_t i = 0; i < k; ++i) o[t * k + i] = topk_key_id(keys[i]);
  }
  for (int64_t d = 0; d < n; ++d) host_ack(ws, d, epoch);
  host_commit_epoch(ws, epoch);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("topk_select", &topk_select_cpu);
  m.impl("topk_merge", &topk_merge_cpu);
}

}  // namespace sdcp
