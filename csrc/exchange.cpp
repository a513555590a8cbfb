// Exchange: argument checks, the inbox layout and output allocation shared by
// the CPU and CUDA kernels.

#include "exchange.h"

namespace sdcp {

void exchange_layout(const std::vector<int64_t>& p, int64_t n, WorkspaceLayout& l) {
  check_params(p, 1, "max_bytes_per_rank");
  l.slots = kDataFlagBuffers;
  // Buffer [peer slot][word]: tagged 64-bit words of kTaggedPayload bytes.
  const int64_t words = (p[0] + kTaggedPayload - 1) / kTaggedPayload;
  const int64_t per_src = align_up(checked_mul({words, 8}, "max_bytes"), kAlign);
  const int64_t payload = checked_mul({n - 1, per_src}, "max_bytes");
  // Then the call headers [peer slot][kHeaderFields tagged words] (dataflag.h).
  l.slot_bytes = payload + align_up((n - 1) * kHeaderFields * 8, kAlign);
  l.part_values[0] = 0;
  l.part_values[1] = per_src;
  l.part_values[2] = payload;
}

ExchangeGeometry ExchangeGeometry::of(const Workspace& ws) {
  return {ws.params[0], ws.layout.part_values[1], ws.layout.part_values[2]};
}

AllGatherCall prepare_all_gather(const at::Tensor& x, int64_t workspace, int64_t tag) {
  check_call_tag(tag);
  check_contiguous(x, "x");
  AllGatherCall c{resolve_workspace(workspace, WorkspaceKind::kExchange, x), {}, 0, {}};
  c.geo = ExchangeGeometry::of(*c.ws);
  c.nbytes = x.numel() * x.element_size();
  SDCP_CHECK_ARG(c.nbytes <= c.geo.max_bytes, "x", "at most " << c.geo.max_bytes << " bytes (the workspace capacity)",
                 c.nbytes << " bytes");
  std::vector<int64_t> shape{c.ws->world_size};
  for (auto s : x.sizes()) shape.push_back(s);
  c.out = at::empty(shape, x.options());
  // The header: bytes, dtype and call tag, a hash of the shape, the geometry.
  uint32_t shape_hash = 2166136261u;
  for (auto s : x.sizes()) shape_hash = (shape_hash ^ static_cast<uint32_t>(s)) * 16777619u;
  c.header = call_header(*c.ws, c.nbytes, static_cast<int64_t>(x.scalar_type()), shape_hash, tag);
  check_workspace_health(*c.ws);
  return c;
}

// A call header's flags word: a hash of x's shape.
namespace {
std::string exchange_flags_text(uint32_t v) { return cat("x of shape hash ", hex32(v)); }

const uint64_t* exchange_header_entry(const Workspace& ws, int64_t src, uint64_t call) {
  return reinterpret_cast<const uint64_t*>(ws.slot_data(ws.rank, static_cast<int64_t>(call % kDataFlagBuffers)) +
                                           ExchangeGeometry::of(ws).header_offset) +
         peer_slot(src, ws.rank, ws.world_size) * kHeaderFields;
}
}  // namespace

const FamilyInfo kExchangeFamily = {
    .name = "exchange",
    .layout = exchange_layout,
    .rows_unit = " bytes",
    .flags_text = exchange_flags_text,
    .tagged_header_entry = exchange_header_entry,
};

}  // namespace sdcp
