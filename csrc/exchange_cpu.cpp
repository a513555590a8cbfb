// Signalling primitive, CPU: peer all-gather through a host workspace. Every
// rank stores its tensor into every inbox, publishes, waits for all peers.

#include "exchange.h"
#include "host_signal.h"

#include <torch/library.h>

#include <cstring>

namespace sdcp {
namespace {

void all_gather_cpu(const AllGatherCall& c, const at::Tensor& x) {
  const Workspace& ws = *c.ws;
  const int64_t n = ws.world_size, nbytes = c.nbytes, per_src = c.geo.source_bytes;
  const uint64_t epoch = host_next_epoch(ws);
  const int64_t slot = ws.slot_of(epoch);
  for (int64_t d = 0; d < n; ++d)
    std::memcpy(ws.slot_data(d, slot) + ws.rank * per_src, x.data_ptr(), nbytes);
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  auto* o = static_cast<uint8_t*>(c.out.data_ptr());
  for (int64_t r = 0; r < n; ++r) {
    host_wait(ws, r, epoch);
    std::memcpy(o + r * nbytes, ws.slot_data(ws.rank, slot) + r * per_src, nbytes);
  }
  host_commit_epoch(ws, epoch);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("peer_all_gather", &peer_all_gather_op<all_gather_cpu>);
}

}  // namespace sdcp
