// Signalling primitive, CPU: peer all-gather through a host workspace. Every
// rank stores its tensor into every inbox, publishes, waits for all peers.

#include "host_signal.h"

#include <torch/library.h>

#include <cstring>

namespace sdcp {
namespace {

at::Tensor peer_all_gather_cpu(const at::Tensor& x, int64_t workspace) {
  check_contiguous(x, "x");
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kExchange, x);
  const Workspace& ws = *ws_ptr;
  const int64_t nbytes = x.numel() * x.element_size(), cap = ws.params[0];
  SDCP_CHECK_ARG(nbytes <= cap, "x", "at most " << cap << " bytes (the workspace capacity)", nbytes << " bytes");
  const int64_t n = ws.world_size, per_src = ws.layout.part_offset[1];
  const uint64_t epoch = host_next_epoch(ws);
  const int64_t slot = epoch & 1;
  for (int64_t d = 0; d < n; ++d)
    std::memcpy(ws.slot_data(d, slot) + ws.rank * per_src, x.data_ptr(), nbytes);
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  std::vector<int64_t> shape{n};
  for (auto s : x.sizes()) shape.push_back(s);
  auto out = at::empty(shape, x.options());
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t r = 0; r < n; ++r) {
    host_wait(ws, r, epoch);
    std::memcpy(o + r * nbytes, ws.slot_data(ws.rank, slot) + r * per_src, nbytes);
  }
  host_commit_epoch(ws, epoch);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("peer_all_gather", &peer_all_gather_cpu);
}

}  // namespace sdcp
