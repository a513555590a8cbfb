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

void check_lse_correct_inputs(const at::Tensor& partial_out, const at::Tensor& gathered_lse, int64_t rank) {
  check_dim(partial_out, "partial_out", 3);
  check_dim(gathered_lse, "gathered_lse", 3);
  check_float_dtype(partial_out, "partial_out");
  check_dtype(gathered_lse, "gathered_lse", at::kFloat);
  check_contiguous(partial_out, "partial_out");
  check_contiguous(gathered_lse, "gathered_lse");
  check_size(gathered_lse, "gathered_lse", 1, partial_out.size(0));
  check_size(gathered_lse, "gathered_lse", 2, partial_out.size(1));
  check_same_device(gathered_lse, "gathered_lse", partial_out, "partial_out");
  const int64_t n = gathered_lse.size(0);
  SDCP_CHECK_ARG(n >= 1, "gathered_lse", "at least one shard in dimension 0", n);
  SDCP_CHECK_ARG(rank >= 0 && rank < n, "rank", "a rank in [0, " << n << ")", rank);
}

std::tuple<at::Tensor, at::Tensor> lse_correct_cpu(const at::Tensor& partial_out, const at::Tensor& gathered_lse,
                                                   int64_t rank, bool base2) {
  check_lse_correct_inputs(partial_out, gathered_lse, rank);
  const int64_t n = gathered_lse.size(0), rows = partial_out.size(0), heads = partial_out.size(1);
  const int64_t dim = partial_out.size(2), items = rows * heads;
  auto out = at::empty({heads, rows, dim}, partial_out.options());  // head-major
  auto lse = at::empty({rows, heads}, gathered_lse.options());
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
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("lse_correct", &lse_correct_cpu);
}

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("lse_combine", &lse_combine_cpu);
  m.impl("output_lse_combine", &output_lse_combine_cpu);
  m.impl("output_lse_combine_out", &output_lse_combine_out_cpu);
}

}  // namespace sdcp
