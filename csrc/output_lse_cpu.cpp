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

void combine_out_cpu(const CombineCall& c, const at::Tensor& partial_out, const at::Tensor& partial_lse, bool base2,
                     at::Tensor& out, at::Tensor& out_lse) {
  const Workspace& ws = *c.ws;
  const OutputLSEGeometry& g = c.geo;
  const int64_t n = ws.world_size, rows = c.rows, heads = g.total_heads, dim = g.head_dim;
  const int64_t hl = g.local_heads, max_rows = g.max_rows, eb = g.elem_bytes;
  const uint64_t epoch = host_next_epoch(ws);
  const int64_t slot = ws.slot_of(epoch);
  // Inbox of rank d: out [src][row][h_loc][dim], lse [src][row][h_loc].
  auto inbox_out = [&](int64_t d, int64_t src) {
    return ws.slot_data(d, slot) + g.out_inbox_offset + src * max_rows * hl * dim * eb;
  };
  auto inbox_lse = [&](int64_t d, int64_t src) {
    return reinterpret_cast<float*>(ws.slot_data(d, slot) + g.lse_inbox_offset) + src * max_rows * hl;
  };
  const auto* po = static_cast<const uint8_t*>(partial_out.data_ptr());
  const float* pl = partial_lse.data_ptr<float>();
  for (int64_t d = 0; d < n; ++d) {
    uint8_t* dst = inbox_out(d, ws.rank);
    float* dl = inbox_lse(d, ws.rank);
    for (int64_t t = 0; t < rows; ++t) {
      std::memcpy(dst + t * hl * dim * eb, po + (t * heads + d * hl) * dim * eb, hl * dim * eb);
      std::memcpy(dl + t * hl, pl + t * heads + d * hl, hl * 4);
    }
  }
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  for (int64_t r = 0; r < n; ++r) host_wait(ws, r, epoch);
  float* lo = out_lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "output_lse_combine", [&] {
    scalar_t* oo = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * hl, 16, [&](int64_t begin, int64_t end) {
      float w[kMaxWorld];
      for (int64_t i = begin; i < end; ++i) {
        lo[i] = lse_weights(static_cast<int>(n), [&](int s) { return inbox_lse(ws.rank, s)[i]; }, base2, w);
        weighted_sum<scalar_t>(
            static_cast<int>(n), w,
            [&](int s) { return reinterpret_cast<const scalar_t*>(inbox_out(ws.rank, s)) + i * dim; }, dim,
            oo + i * dim);
      }
    });
  });
  host_commit_epoch(ws, epoch);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("lse_combine", &lse_combine_op<lse_combine_cpu, kMaxWorld>);
  m.impl("output_lse_combine_out", &output_lse_combine_out_op<combine_out_cpu>);
}

}  // namespace sdcp
