// Output/LSE boundary, CPU: the LSE-weighted combine of stacked partials, and
// the peer path in which each producer stores every destination's head shard
// into that owner's inbox and the owner combines locally.

#include "output_lse.h"

#include "host_signal.h"
#include "semantics.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace sdcp {

namespace {

// out[d] = sum_i w_i * src_i[d] over the shards with w_i != 0, fp32, one rounding.
template <typename scalar_t, typename SrcAt>
void weighted_sum(int n, const float* w, SrcAt src, int64_t dim, scalar_t* out) {
  std::vector<float> acc(dim, 0.0f);
  for (int i = 0; i < n; ++i) {
    if (w[i] == 0.0f) continue;  // a zero-weight payload is never read
    const scalar_t* s = src(i);
    for (int64_t d = 0; d < dim; ++d) acc[d] += w[i] * static_cast<float>(s[d]);
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<scalar_t>(acc[d]);
}

void lse_combine_cpu(const at::Tensor& partial_out, const at::Tensor& partial_lse, bool base2, at::Tensor& out,
                     at::Tensor& lse) {
  const int64_t n = partial_out.size(0), rows = partial_out.size(1), heads = partial_out.size(2);
  const int64_t dim = partial_out.size(3);
  const float* l = partial_lse.data_ptr<float>();
  float* lo = lse.data_ptr<float>();
  const int64_t plane = rows * heads;  // (row, head) pairs per shard
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_combine", [&] {
    const scalar_t* o = partial_out.data_ptr<scalar_t>();
    scalar_t* oo = out.data_ptr<scalar_t>();
    at::parallel_for(0, plane, 16, [&](int64_t begin, int64_t end) {
      float w[kMaxWorld];
      for (int64_t i = begin; i < end; ++i) {
        lo[i] = lse_weights(static_cast<int>(n), [&](int s) { return l[s * plane + i]; }, base2, w);
        weighted_sum<scalar_t>(static_cast<int>(n), w, [&](int s) { return o + (s * plane + i) * dim; }, dim,
                               oo + i * dim);
      }
    });
  });
}

// Data-as-flag (dataflag.h): push every peer's head shard and LSE into its
// buffer, take the peers' shards from the local buffer as they land (writing
// the sentinel back), read this rank's own shard in place, then combine.
void combine_out_cpu(const CombineCall& c, const at::Tensor& partial_out, const at::Tensor& partial_lse, bool base2,
                     at::Tensor& out, at::Tensor& out_lse) {
  const Workspace& ws = *c.ws;
  const OutputLSEGeometry& g = c.geo;
  const int64_t n = ws.world_size, rows = c.rows, heads = g.total_heads, dim = g.head_dim;
  const int64_t hl = g.local_heads, max_rows = g.max_rows, eb = g.elem_bytes;
  SDCP_CHECK_ARG(dim * eb % 4 == 0, "partial_out", "a last dimension of a multiple of 4 bytes",
                 dim << " elements of " << eb << " bytes");
  const int64_t item_words = dim * eb / 4;
  const uint64_t call = host_call_index(ws);
  const int64_t buf = call % kDataFlagBuffers;
  // Buffer of rank d, entry of source s: payload [row][h_loc][dim], LSE [row][h_loc].
  auto inbox_out = [&](int64_t d, int64_t s) {
    return reinterpret_cast<uint32_t*>(ws.slot_data(d, buf) + g.out_inbox_offset) +
           peer_slot(s, d, n) * max_rows * hl * item_words;
  };
  auto inbox_lse = [&](int64_t d, int64_t s) {
    return reinterpret_cast<uint32_t*>(ws.slot_data(d, buf) + g.lse_inbox_offset) + peer_slot(s, d, n) * max_rows * hl;
  };
  auto header = [&](int64_t d, int64_t s) { return buffer_header(ws, g.header_offset, d, s, buf); };
  const auto* po = static_cast<const uint32_t*>(partial_out.data_ptr());
  const auto* pl = reinterpret_cast<const uint32_t*>(partial_lse.data_ptr<float>());
  // This producer's LSE words of row t, heads [h0, h0 + hl): -inf for an empty row (call.mask).
  const std::vector<uint32_t> neg_inf(hl, float_bits(-INFINITY));
  std::vector<char> empty(rows, 0);
  if (c.mask.enabled)
    for (int64_t t = 0; t < rows; ++t) empty[t] = c.mask.row_empty(t);
  auto lse_words = [&](int64_t t, int64_t h0) { return empty[t] ? neg_inf.data() : pl + t * heads + h0; };
  for (int64_t d = 0; d < n; ++d) {
    if (d == ws.rank) continue;
    host_store_call_header(header(d, ws.rank), c.header);  // before the data it describes
    for (int64_t t = 0; t < rows; ++t) {
      host_store_payload(inbox_out(d, ws.rank) + t * hl * item_words, po + (t * heads + d * hl) * item_words,
                         hl * item_words, false);
      host_store_payload(inbox_lse(d, ws.rank) + t * hl, lse_words(t, d * hl), hl, true);
    }
  }
  // Gather the shards [N][rows][h_loc] (own one copied from partial_out), then combine.
  auto shards = at::empty({n, rows, hl, dim}, partial_out.options());
  auto lses = at::empty({n, rows, hl}, partial_lse.options());
  auto* so = static_cast<uint32_t*>(shards.data_ptr());
  auto* sl = reinterpret_cast<uint32_t*>(lses.data_ptr<float>());
  for (int64_t s = 0; s < n; ++s) {
    uint32_t* to = so + s * rows * hl * item_words;
    uint32_t* tl = sl + s * rows * hl;
    if (s == ws.rank) {
      for (int64_t t = 0; t < rows; ++t) {
        std::memcpy(to + t * hl * item_words, po + (t * heads + s * hl) * item_words, hl * item_words * 4);
        std::memcpy(tl + t * hl, lse_words(t, s * hl), hl * 4);
      }
    } else {
      // The header first: a mismatch fails here, before waiting for rows the peer may not send.
      host_check_call_header(ws, s, call, header(ws.rank, s), c.header);
      host_take_payload(ws, s, call, inbox_lse(ws.rank, s), rows * hl, tl);
      host_take_payload(ws, s, call, inbox_out(ws.rank, s), rows * hl * item_words, to);
    }
  }
  host_finish_call(ws, call);
  if (rows > 0) lse_combine_cpu(shards, lses, base2, out, out_lse);
}

}  // namespace

// ---------------------------------------------------------------------------
// lse_correct: the local kernel of the collective Output/LSE path (LSE
// all_gather -> this kernel -> reduce_scatter on heads). Per (t, h) it forms
// the global LSE from the gathered shard LSEs and scales this rank's partial
// output by its weight, writing head-major [H, T, D] so that reduce_scatter on
// dim 0 splits heads with no transpose copy.
// ---------------------------------------------------------------------------

namespace {

// Weight of shard `rank` and the global LSE of one (t, h), with the arithmetic
// of lse_weights (semantics.h) in the same order, without a per-shard array.
template <typename LseAt>
inline float lse_weight_of(int64_t n, LseAt lse, int64_t rank, bool base2, float* L_out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse(i));
    m = l > m ? l : m;
  }
  if (m == -INFINITY) m = 0.0f;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse(i));
    sum += base2 ? exp2f(l - m) : expf(l - m);
  }
  if (sum == 0.0f) {
    *L_out = -INFINITY;
    return 0.0f;
  }
  const float L = m + (base2 ? log2f(sum) : logf(sum));
  *L_out = L;
  const float l = lse_sanitize(lse(rank));
  return base2 ? exp2f(l - L) : expf(l - L);
}

void lse_correct_cpu(const at::Tensor& partial_out, const at::Tensor& gathered_lse, int64_t rank, bool base2,
                     at::Tensor& out, at::Tensor& lse) {
  const int64_t n = gathered_lse.size(0), rows = partial_out.size(0), heads = partial_out.size(1);
  const int64_t dim = partial_out.size(2), items = rows * heads;
  const float* l = gathered_lse.data_ptr<float>();
  float* lo = lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_correct", [&] {
    const scalar_t* o = partial_out.data_ptr<scalar_t>();
    scalar_t* oo = out.data_ptr<scalar_t>();
    at::parallel_for(0, items, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float w = lse_weight_of(n, [&](int64_t s) { return l[s * items + i]; }, rank, base2, lo + i);
        const int64_t t = i / heads, h = i % heads;
        scalar_t* dst = oo + (h * rows + t) * dim;
        if (w == 0.0f) {  // exactly 0, and the payload (maybe NaN) is never read
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(0.0f);
          continue;
        }
        const scalar_t* src = o + i * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(w * static_cast<float>(src[d]));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("lse_correct", &lse_correct_op<lse_correct_cpu>);
  m.impl("lse_combine", &lse_combine_op<lse_combine_cpu, kMaxWorld>);
  m.impl("output_lse_combine_out", &output_lse_combine_out_op<combine_out_cpu>);
}

}  // namespace sdcp
