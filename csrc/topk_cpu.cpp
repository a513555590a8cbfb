// Top-K boundary, CPU: stable selection over candidate pairs, and the peer
// merge in which every owner pushes its sorted best keys to every consumer.

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

// Data-as-flag (dataflag.h): each owner stores its call header into every
// peer's buffer, sorts its rows once and pushes its best kk keys per row
// after it; each consumer checks a peer's header, then takes its lists from
// the local buffer as they land (writing the sentinel back) and merges them
// with its own.
void merge_cpu(const TopKMergeCall& c, const at::Tensor& scores, const at::Tensor& ids) {
  const Workspace& ws = *c.ws;
  const TopKGeometry& g = c.geo;
  const int64_t rows = c.rows, cand = g.candidates_per_rank, n = ws.world_size, me = ws.rank, k = g.k;
  const int64_t kk = g.keys_per_row;
  const uint64_t call = host_call_index(ws);
  const int64_t buf = call % kDataFlagBuffers;
  // Buffer of rank d, entry of source s: [row][kk] keys.
  auto inbox = [&](int64_t d, int64_t s) {
    return reinterpret_cast<uint64_t*>(ws.slot_data(d, buf) + g.inbox_offset) + peer_slot(s, d, n) * g.max_rows * kk;
  };
  auto header = [&](int64_t d, int64_t s) { return buffer_header(ws, g.header_offset, d, s, buf); };
  for (int64_t d = 0; d < n; ++d)  // before the keys it describes
    if (d != me) host_store_call_header(header(d, me), c.header);
  // 1. Owner: the best kk keys of every row, in order, pushed to every peer.
  std::vector<uint64_t> own(rows * kk), keys(cand);
  const float* s = scores.data_ptr<float>();
  const int32_t* id = ids.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < cand; ++j) keys[j] = topk_key(s[t * scores.stride(0) + j], id[t * ids.stride(0) + j]);
    std::partial_sort(keys.begin(), keys.begin() + kk, keys.end(), std::greater<uint64_t>());
    std::copy(keys.begin(), keys.begin() + kk, own.begin() + t * kk);
  }
  for (int64_t d = 0; d < n; ++d) {
    if (d == me) continue;
    uint64_t* dst = inbox(d, me);
    for (int64_t i = 0; i < rows * kk; ++i) __atomic_store_n(dst + i, own[i], __ATOMIC_RELAXED);
  }
  // 2. Consumer: merge each peer's sorted list as it lands, nearest peer first.
  std::vector<uint64_t> acc(own), peer(rows * kk), merged(rows * std::max(k, kk));
  int64_t len = kk;  // keys per row in acc
  for (int64_t step = 1; step < n; ++step) {
    const int64_t src = (me + step) % n;
    // The header first: a mismatch fails here, before waiting for rows the peer may not send.
    host_check_call_header(ws, src, call, header(me, src), c.header);
    uint64_t* in = inbox(me, src);
    for (int64_t i = 0; i < rows * kk; ++i) {
      host_spin(ws, src, call, [&] { return __atomic_load_n(in + i, __ATOMIC_ACQUIRE) != kTopKSentinel; });
      peer[i] = __atomic_load_n(in + i, __ATOMIC_RELAXED);
      __atomic_store_n(in + i, kTopKSentinel, __ATOMIC_RELAXED);
    }
    const int64_t out_len = std::min(k, len + kk);
    for (int64_t t = 0; t < rows; ++t) {
      std::vector<uint64_t> both(len + kk);
      std::merge(acc.begin() + t * len, acc.begin() + (t + 1) * len, peer.begin() + t * kk,
                 peer.begin() + (t + 1) * kk, both.begin(), std::greater<uint64_t>());
      std::copy(both.begin(), both.begin() + out_len, merged.begin() + t * out_len);
    }
    acc.assign(merged.begin(), merged.begin() + rows * out_len);
    len = out_len;
  }
  host_finish_call(ws, call);
  // k <= N * kk (the layout checks it), so every row holds k keys (invalid ones are 0: id -1).
  int32_t* o = c.out.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < k; ++i) o[t * k + i] = topk_key_id(acc[t * len + i]);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("topk_select", &topk_select_op<select_cpu>);
  m.impl("topk_merge", &topk_merge_op<merge_cpu>);
}

}  // namespace sdcp
