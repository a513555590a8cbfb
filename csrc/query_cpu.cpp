// Query boundary, CPU: the fused RoPE / concatenation / quantisation producer
// and its fan-out into every consumer's inbox through a host workspace.

#include "query.h"

#include "host_signal.h"
#include "semantics.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace sdcp {

namespace {

int64_t position_at(const at::Tensor& positions, int64_t t) {
  return positions.scalar_type() == at::kLong ? positions.data_ptr<int64_t>()[t * positions.stride(0)]
                                              : positions.data_ptr<int32_t>()[t * positions.stride(0)];
}

// Writes the produced [rows, heads, nope + rope] into `out`, whose rows are
// `row_stride` elements apart (heads are packed).
template <typename cache_t, typename out_t>
void produce_cpu(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                 const at::Tensor& cache, float scale, bool neox, out_t* out, int64_t row_stride,
                 const QueryShape& s) {
  const auto* nope = ql_nope.data_ptr<c10::BFloat16>();
  const auto* pe = q_pe.data_ptr<c10::BFloat16>();
  const auto* c = cache.data_ptr<cache_t>();
  const int64_t half = s.rope / 2, width = s.width(), max_pos = cache.size(0);
  for (int64_t t = 0; t < s.rows; ++t) {
    const int64_t p = position_at(positions, t);
    SDCP_CHECK_ARG(p >= 0 && p < max_pos, "positions", "values in [0, " << max_pos << ")",
                   p << " at row " << t);
  }
  auto store = [scale](float v) -> out_t {
    if constexpr (std::is_same<out_t, c10::Float8_e4m3fn>::value) return quantize_e4m3(v, scale);
    else return static_cast<out_t>(v);
  };
  at::parallel_for(0, s.rows * s.heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(s.rope);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / s.heads, h = i % s.heads;
      const c10::BFloat16* n = nope + t * ql_nope.stride(0) + h * ql_nope.stride(1);
      const c10::BFloat16* q = pe + t * q_pe.stride(0) + h * q_pe.stride(1);
      out_t* dst = out + t * row_stride + h * width;
      for (int64_t d = 0; d < s.nope; ++d) dst[d] = store(static_cast<float>(n[d]));
      const cache_t* cs = c + position_at(positions, t) * s.rope;
      for (int64_t j = 0; j < half; ++j) {
        const float co = static_cast<float>(cs[j]), si = static_cast<float>(cs[half + j]);
        const int64_t i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
        const float x0 = static_cast<float>(q[i0]), x1 = static_cast<float>(q[i1]);
        x[i0] = rope_first(x0, x1, co, si);
        x[i1] = rope_second(x0, x1, co, si);
      }
      for (int64_t d = 0; d < s.rope; ++d) dst[s.nope + d] = store(x[d]);
    }
  });
}

void produce_dispatch(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                      const at::Tensor& cache, const std::optional<at::Tensor>& q_scale, bool neox,
                      at::ScalarType out_dtype, void* out, int64_t row_stride, const QueryShape& s) {
  const float scale = q_scale.has_value() ? q_scale->item<float>() : 1.0f;
  const bool f32 = cache.scalar_type() == at::kFloat;
  if (out_dtype == at::kFloat8_e4m3fn) {
    auto* o = static_cast<c10::Float8_e4m3fn*>(out);
    f32 ? produce_cpu<float>(ql_nope, q_pe, positions, cache, scale, neox, o, row_stride, s)
        : produce_cpu<c10::BFloat16>(ql_nope, q_pe, positions, cache, scale, neox, o, row_stride, s);
  } else {
    auto* o = static_cast<c10::BFloat16*>(out);
    f32 ? produce_cpu<float>(ql_nope, q_pe, positions, cache, scale, neox, o, row_stride, s)
        : produce_cpu<c10::BFloat16>(ql_nope, q_pe, positions, cache, scale, neox, o, row_stride, s);
  }
}

void rope_quant_cpu(const QueryShape& s, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                 at::ScalarType out_dtype, at::Tensor& out) {
  produce_dispatch(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, out.data_ptr(),
                   s.heads * s.width(), s);
}

// Produces this rank's head shard into every inbox, publishes and waits for
// every producer; with an output (query_gather), copies the local inbox out
// and acknowledges.
void gather_cpu(const QueryCall& c, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                at::ScalarType out_dtype) {
  const Workspace& ws = *c.ws;
  const QueryShape& s = c.shape;
  const int64_t n = ws.world_size, eb = c10::elementSize(out_dtype);
  const int64_t row_bytes = n * s.heads * s.width() * eb;  // one inbox row, all sources
  const int64_t shard_bytes = s.heads * s.width() * eb;    // this rank's heads of one row
  // Produce once locally, then store the head shard into every inbox once
  // every consumer has finished reading the previous epoch (one slot).
  auto local = at::empty({s.rows, s.heads, s.width()}, ql_nope.options().dtype(out_dtype));
  rope_quant_cpu(s, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, local);
  const auto* src = static_cast<const uint8_t*>(local.data_ptr());
  const uint64_t epoch = host_next_epoch(ws);
  for (int64_t r = 0; r < n; ++r) host_wait_ack(ws, r, epoch);
  for (int64_t d = 0; d < n; ++d) {
    uint8_t* inbox = ws.slot_data(d, 0) + c.geo.inbox_offset;
    for (int64_t t = 0; t < s.rows; ++t)
      std::memcpy(inbox + t * row_bytes + ws.rank * shard_bytes, src + t * shard_bytes, shard_bytes);
  }
  for (int64_t d = 0; d < n; ++d) host_publish(ws, d, epoch);
  for (int64_t r = 0; r < n; ++r) host_wait(ws, r, epoch);
  if (c.out) {
    std::memcpy(c.out->data_ptr(), local_inbox(ws), s.rows * row_bytes);
    for (int64_t d = 0; d < n; ++d) host_ack(ws, d, epoch);
  }
  host_commit_epoch(ws, epoch);
}

void release_cpu(const Workspace& ws, const at::Tensor&) {
  const uint64_t last = ws.epochs(ws.rank)[0];
  for (int64_t d = 0; d < ws.world_size; ++d) host_ack(ws, d, last);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("query_rope_quant", &query_rope_quant_op<rope_quant_cpu>);
  m.impl("query_gather", &query_gather_op<gather_cpu>);
  m.impl("query_publish", &query_publish_op<gather_cpu>);
  m.impl("query_release", &query_release_op<release_cpu>);
}

}  // namespace sdcp
