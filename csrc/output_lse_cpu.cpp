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

void check_partial_inputs(const at::Tensor& partial_out, const at::Tensor& partial_lse) {
  check_dim(partial_out, "partial_out", 3);
  check_dim(partial_lse, "partial_lse", 2);
  check_float_dtype(partial_out, "partial_out");
  check_dtype(partial_lse, "partial_lse", at::kFloat);
  check_contiguous(partial_out, "partial_out");
  check_contiguous(partial_lse, "partial_lse");
  check_size(partial_lse, "partial_lse", 0, partial_out.size(0));
  check_size(partial_lse, "partial_lse", 1, partial_out.size(1));
  check_same_device(partial_lse, "partial_lse", partial_out, "partial_out");
}

void check_output_lse_workspace(const Workspace& ws, const at::Tensor& partial_out) {
  const auto& p = ws.params;  // max_rows, total_heads, head_dim, elem_bytes
  SDCP_CHECK_ARG(partial_out.size(0) <= p[0], "partial_out", "at most max_rows = " << p[0] << " rows",
                 partial_out.size(0) << " (larger batches take the collective path)");
  check_size(partial_out, "partial_out", 1, p[1]);
  check_size(partial_out, "partial_out", 2, p[2]);
  SDCP_CHECK_ARG(static_cast<int64_t>(partial_out.element_size()) == p[3], "partial_out",
                 "elements of " << p[3] << " bytes (the workspace dtype)", partial_out.scalar_type());
}

void check_combine_outputs(const Workspace& ws, const at::Tensor& partial_out, const at::Tensor& out,
                           const at::Tensor& out_lse) {
  const int64_t rows = partial_out.size(0), hl = partial_out.size(1) / ws.world_size;
  const int64_t d = partial_out.size(2);
  SDCP_CHECK_ARG(out.sizes() == at::IntArrayRef({rows, hl, d}), "out",
                 "shape [" << rows << ", " << hl << ", " << d << "]", "shape " << out.sizes());
  SDCP_CHECK_ARG(out_lse.sizes() == at::IntArrayRef({rows, hl}), "out_lse",
                 "shape [" << rows << ", " << hl << "]", "shape " << out_lse.sizes());
  check_dtype(out, "out", partial_out.scalar_type());
  check_dtype(out_lse, "out_lse", at::kFloat);
  check_contiguous(out, "out");
  check_contiguous(out_lse, "out_lse");
  check_same_device(out, "out", partial_out, "partial_out");
  check_same_device(out_lse, "out_lse", partial_out, "partial_out");
}

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

std::tuple<at::Tensor, at::Tensor> lse_combine_cpu(const at::Tensor& partial_out,
                                                   const at::Tensor& partial_lse, bool base2) {
  check_dim(partial_out, "partial_out", 4);
  check_dim(partial_lse, "partial_lse", 3);
  check_float_dtype(partial_out, "partial_out");
  check_dtype(partial_lse, "partial_lse", at::kFloat);
  check_contiguous(partial_out, "partial_out");
  check_contiguous(partial_lse, "partial_lse");
  for (int d = 0; d < 3; ++d) check_size(partial_lse, "partial_lse", d, partial_out.size(d));
  check_same_device(partial_lse, "partial_lse", partial_out, "partial_out");
  const int64_t n = partial_out.size(0), rows = partial_out.size(1), heads = partial_out.size(2);
  const int64_t dim = partial_out.size(3);
  SDCP_CHECK_ARG(n >= 1 && n <= kMaxWorld, "partial_out", "1.." << kMaxWorld << " shards in dim 0", n);
  auto out = at::empty({rows, heads, dim}, partial_out.options());
  auto lse = at::empty({rows, heads}, partial_lse.options());
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
  return {out, lse};
}

void output_lse_combine_out_cpu(const at::Tensor& partial_out, const at::Tensor& partial_lse,
                                int64_t workspace, bool base2, at::Tensor& out, at::Tensor& out_lse) {
  check_partial_inputs(partial_out, partial_lse);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out);
  const Workspace& ws = *ws_ptr;
  check_output_lse_workspace(ws, partial_out);
  check_combine_outputs(ws, partial_out, out, out_lse);
  const int64_t n = ws.world_size, rows = partial_out.size(0), heads = partial_out.size(1);
  const int64_t dim = partial_out.size(2), hl = heads / n, max_rows = ws.params[0];
  const int64_t eb = partial_out.element_size();
  const uint64_t epoch = host_next_epoch(ws);
  const int64_t slot = epoch & 1;
  // Inbox of rank d: out [src][row][h_loc][dim], lse [src][row][h_loc].
  auto inbox_out = [&](int64_t d, int64_t src) {
    return ws.slot_data(d, slot) + ws.layout.part_offset[0] + src * max_rows * hl * dim * eb;
  };
  auto inbox_lse = [&](int64_t d, int64_t src) {
    return reinterpret_cast<float*>(ws.slot_data(d, slot) + ws.layout.part_offset[1]) + src * max_rows * hl;
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

std::tuple<at::Tensor, at::Tensor> output_lse_combine_cpu(const at::Tensor& partial_out,
                                                          const at::Tensor& partial_lse, int64_t workspace,
                                                          bool base2) {
  check_partial_inputs(partial_out, partial_lse);
  const auto ws_ptr = resolve_workspace(workspace, WorkspaceKind::kOutputLSE, partial_out);
  const int64_t n = ws_ptr->world_size;
  SDCP_CHECK_ARG(partial_out.size(1) % n == 0, "partial_out", "heads divisible by the world size " << n,
                 partial_out.size(1));
  auto out = at::empty({partial_out.size(0), partial_out.size(1) / n, partial_out.size(2)}, partial_out.options());
  auto lse = at::empty({partial_out.size(0), partial_out.size(1) / n}, partial_lse.options());
  output_lse_combine_out_cpu(partial_out, partial_lse, workspace, base2, out, lse);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("lse_combine", &lse_combine_cpu);
  m.impl("output_lse_combine", &output_lse_combine_cpu);
  m.impl("output_lse_combine_out", &output_lse_combine_out_cpu);
}

}  // namespace sdcp
