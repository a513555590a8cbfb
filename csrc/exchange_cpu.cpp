// Signalling primitive, CPU: peer all-gather through a host workspace. Every
// rank stores its tensor as tagged words into every peer's buffer and waits
// until each peer's words carry this call's tag (dataflag.h).

#include "exchange.h"
#include "host_signal.h"

#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace sdcp {
namespace {

// Tagged words: a peer's data has landed when its word carries this call's tag.
// Each peer's call header is compared before its data is awaited.
void all_gather_cpu(const AllGatherCall& c, const at::Tensor& x) {
  const Workspace& ws = *c.ws;
  const int64_t n = ws.world_size, nbytes = c.nbytes, words = (nbytes + 3) / 4;
  const uint64_t call = host_call_index(ws);
  const int64_t buf = call % kDataFlagBuffers;
  const uint64_t tag = static_cast<uint64_t>(call_tag(call)) << 32;
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto entry = [&](int64_t dst, int64_t from) {
    return reinterpret_cast<uint64_t*>(ws.slot_data(dst, buf) + peer_slot(from, dst, n) * c.geo.source_bytes);
  };
  auto header = [&](int64_t dst, int64_t from) {
    return reinterpret_cast<uint64_t*>(ws.slot_data(dst, buf) + c.geo.header_offset) +
           peer_slot(from, dst, n) * kHeaderFields;
  };
  for (int64_t d = 0; d < n; ++d) {
    if (d == ws.rank) continue;
    host_store_call_header_tagged(header(d, ws.rank), tag, c.header);  // before the data it describes
    uint64_t* dst = entry(d, ws.rank);
    for (int64_t w = 0; w < words; ++w) {
      uint32_t v = 0;
      std::memcpy(&v, src + 4 * w, std::min<int64_t>(4, nbytes - 4 * w));
      __atomic_store_n(dst + w, tag | v, __ATOMIC_RELAXED);
    }
  }
  auto* o = static_cast<uint8_t*>(c.out.data_ptr());
  std::memcpy(o + ws.rank * nbytes, src, nbytes);
  for (int64_t s = 0; s < n; ++s) {
    if (s == ws.rank) continue;
    host_check_call_header_tagged(ws, s, call, header(ws.rank, s), tag, c.header);
    const uint64_t* in = entry(ws.rank, s);
    for (int64_t w = 0; w < words; ++w) {
      uint64_t v = 0;
      host_spin(ws, s, call, [&] { return ((v = __atomic_load_n(in + w, __ATOMIC_ACQUIRE)) & ~0xFFFFFFFFull) == tag; });
      const uint32_t payload = static_cast<uint32_t>(v);
      std::memcpy(o + s * nbytes + 4 * w, &payload, std::min<int64_t>(4, nbytes - 4 * w));
    }
  }
  host_finish_call(ws, call);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("peer_all_gather", &peer_all_gather_op<all_gather_cpu>);
}

}  // namespace sdcp
