// Top-K boundary: what the CPU and CUDA kernels share (argument checks, typed
// workspace geometry, output allocation).
#pragma once

#include "sdcp.h"

namespace sdcp {

// Workspace params [max_rows, candidates_per_rank, k] and the inbox layout of
// one data-as-flag buffer, decoded once: one entry per peer (peer_slot(src,
// dst)), each the peer's best min(C, k) candidates per row as sorted 64-bit
// selection keys (semantics.h), [peer][max_rows][keys_per_row], then the call
// headers [peer][16 bytes] (dataflag.h).
struct TopKGeometry {
  int64_t max_rows = 0, candidates_per_rank = 0, k = 0;
  int64_t keys_per_row = 0;   // min(candidates_per_rank, k)
  int64_t inbox_offset = 0;   // inside a buffer
  int64_t header_offset = 0;  // call headers [peer][kHeaderFields words], inside a buffer
  static TopKGeometry of(const Workspace& ws);
};

// The sentinel of a top-K inbox word: every byte 0xFF, as the buffers are
// filled. No key can take it: a key's high half is at most 0xFF800000 (+inf,
// topk_key in semantics.h maps NaN to 0) and an invalid candidate's key is 0,
// so a producer stores its keys unchanged. The low half alone can be
// 0xFFFFFFFF (id 0), so a key is polled as one 64-bit word, never in halves.
constexpr uint64_t kTopKSentinel = ~uint64_t{0};

void topk_layout(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);

// scores [T, C] fp32 / ids [T, C] int32 (unit stride in the last dimension),
// k >= 1; returns the [T, k] int32 output.
at::Tensor prepare_topk_select(const at::Tensor& scores, const at::Tensor& ids, int64_t k);

// One topk_merge call, checked against its workspace, with its output.
struct TopKMergeCall {
  std::shared_ptr<const Workspace> ws;
  TopKGeometry geo;
  int64_t rows = 0;
  at::Tensor out;     // [T, k] int32
  CallHeader header;  // what this call is (rows, scores dtype, geometry; dataflag.h)
};

TopKMergeCall prepare_topk_merge(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k,
                                 int64_t tag);

// The ops of one backend, written once on top of its launchers:
//   SelectLaunch(scores, ids, k, out)      MergeLaunch(call, scores, ids)
template <auto SelectLaunch>
at::Tensor topk_select_op(const at::Tensor& scores, const at::Tensor& ids, int64_t k) {
  at::Tensor out = prepare_topk_select(scores, ids, k);
  if (scores.size(0) > 0) SelectLaunch(scores, ids, k, out);
  return out;
}

template <auto MergeLaunch>
at::Tensor topk_merge_op(const at::Tensor& scores, const at::Tensor& ids, int64_t workspace, int64_t k,
                         int64_t tag) {
  const TopKMergeCall c = prepare_topk_merge(scores, ids, workspace, k, tag);
  // A call without rows runs too: it stores and checks the call headers, so
  // it still waits for each peer's call of the same index (the buffer-reuse
  // argument, docs/PROTOCOL.md) and a peer with rows sees the difference.
  MergeLaunch(c, scores, ids);
  return c.out;
}

}  // namespace sdcp
