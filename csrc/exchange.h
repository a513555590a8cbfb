// Exchange (the signalling primitive, a peer all-gather): what the CPU and
// CUDA kernels share.
#pragma once

#include "sdcp.h"

namespace sdcp {

// Workspace params [max_bytes] and the inbox layout, decoded once.
struct ExchangeGeometry {
  int64_t max_bytes;     // capacity per source
  int64_t source_bytes;  // distance between two peer slots of a buffer (tagged words)
  int64_t header_offset; // call headers [peer slot][kHeaderFields tagged words], inside a buffer
  static ExchangeGeometry of(const Workspace& ws);
};

void exchange_layout(const std::vector<int64_t>& params, int64_t world_size, WorkspaceLayout& l);

// One peer_all_gather call, checked, with its output allocated.
struct AllGatherCall {
  std::shared_ptr<const Workspace> ws;
  ExchangeGeometry geo;
  int64_t nbytes;  // bytes of x
  at::Tensor out;  // [N, *x.shape]
  CallHeader header;  // what this call is (dataflag.h): every peer compares it with its own
};

AllGatherCall prepare_all_gather(const at::Tensor& x, int64_t workspace, int64_t tag);

// The op of one backend, written once on top of its launcher Launch(call, x).
template <auto Launch>
at::Tensor peer_all_gather_op(const at::Tensor& x, int64_t workspace, int64_t tag) {
  const AllGatherCall c = prepare_all_gather(x, workspace, tag);
  Launch(c, x);
  return c.out;
}

}  // namespace sdcp
