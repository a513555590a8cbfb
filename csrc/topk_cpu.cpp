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

void select_cpu(const at::Tensor& scores, const at::Tensor& ids, int64_t k, at::Tensor& out) {
  const int64_t rows = scores.size(0), m = scores.size(1);
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
}

void merge_cpu(const TopKMergeCall& c, const at::Tensor& scores, const at::Tensor& ids) {
  const Workspace& ws = *c.ws;
  const int64_t rows = c.rows, cand = c.geo.candidates_per_rank, n = ws.world_size, k = c.geo.k;
  const int64_t kk = c.geo.keys_per_row;
  auto shard = [&](int64_t r) { return reinterpret_cast<uint64_t*>(ws.slot_data(r, 0) + c.geo.shard_offset); };
  const uint64_t epoch = host_next_epoch(ws);
  // One slot: every consumer must have finished reading the previous epoch.
  for (int64_t r = 0; r < n; ++r) host_wait_ack(ws, r, epoch);
  // The owner writes its best kk keys per row once, sorted, into its own shard.
  std::vector<uint64_t> keys(std::max(cand, n * kk));
  uint64_t* own = shard(ws.rank);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < cand; ++j)
      keys[j] = topk_key(scores.data_ptr<float>()[t * scores.stride(0) + j], ids.data_ptr<int32_t>()[t * ids.stride(0) + j]);
    std::partial_sort(keys.begin(), keys.begin() + kk, keys.begin() + cand, std::greater<uint64_t>());
    std::copy(keys.begin(), keys.begin() + kk, own + t * kk);
  }
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  for (int64_t r = 0; r < n; ++r) host_wait(ws, r, epoch);
  // Every consumer reads every owner's sorted shard in place and keeps the best k.
  int32_t* o = c.out.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t r = 0; r < n; ++r) std::copy(shard(r) + t * kk, shard(r) + (t + 1) * kk, keys.begin() + r * kk);
    std::partial_sort(keys.begin(), keys.begin() + k, keys.begin() + n * kk, std::greater<uint64_t>());
    for (int64_t i = 0; i < k; ++i) o[t * k + i] = topk_key_id(keys[i]);
  }
  for (int64_t d = 0; d < n; ++d) host_ack(ws, d, epoch);
  host_commit_epoch(ws, epoch);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("topk_select", &topk_select_op<select_cpu>);
  m.impl("topk_merge", &topk_merge_op<merge_cpu>);
}

}  // namespace sdcp
