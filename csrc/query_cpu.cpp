// Query boundary, CPU: the fused RoPE / concatenation / quantisation producer
// and the data-as-flag fan-out of a rank's heads through a host workspace
// (the protocol of the CUDA kernels, docs/PROTOCOL.md version 4).

#include "query.h"

#include "host_signal.h"
#include "semantics.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

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

// Stores `count` payload words with plain (relaxed) stores, rewriting the
// sentinel to the workspace's canonical word.
void store_words(uint32_t* dst, const uint32_t* src, int64_t count, uint32_t canonical) {
  for (int64_t i = 0; i < count; ++i) __atomic_store_n(dst + i, canonical_word(src[i], canonical), __ATOMIC_RELAXED);
}

// Takes peer `src`'s header of this call from `p` (written back to the
// sentinel) and compares it with `mine`. `other` is src's header entry of
// the other kind of call (the view's for a copying call, and the reverse): a
// header there while none arrived here means that src made the other kind of
// call (gather against gather_view), a mismatch of the op named on both
// ranks instead of a timeout. In step, src's header of this call is stored
// before its header of any later call of the other kind, so it is seen first.
void take_query_header(const Workspace& ws, int64_t src, uint64_t call, uint32_t* p, const uint32_t* other,
                       const CallHeader& mine, uint32_t wait) {
  auto landed = [](const uint32_t* h) {
    for (uint32_t f = 0; f < kHeaderFields; ++f)
      if (__atomic_load_n(h + f, __ATOMIC_ACQUIRE) == kSentinel) return false;
    return true;
  };
  bool crossed = false;
  host_spin(ws, src, call, [&] { return landed(p) || (crossed = landed(other)); }, wait);
  if (crossed && !landed(p))  // the op of the other kind, in its flags word
    host_fail_mismatch(ws, src, call, kHeaderFlags, mine.w[kHeaderFlags],
                       __atomic_load_n(other + kHeaderFlags, __ATOMIC_RELAXED), wait);
  CallHeader theirs;
  for (uint32_t f = 0; f < kHeaderFields; ++f) {
    theirs.w[f] = __atomic_load_n(p + f, __ATOMIC_RELAXED);
    __atomic_store_n(p + f, kSentinel, __ATOMIC_RELAXED);
  }
  host_compare_call_header(ws, src, call, mine, theirs, wait, kQueryOpBits);
}

// The items [rows][H_loc][W] of this rank, as 32-bit words, into the
// destinations of one call (docs/PROTOCOL.md, version 4). Every destination
// gets this rank's call header before the payload, and every peer's header is
// taken and compared before its payload (a mismatch raises on both sides,
// naming both; the rank with more rows does not wait for rows never sent).
//  copy (query_gather, query_all_gather_heads_out): every peer's entry in the
//    rotating buffer of this call and this rank's heads of `out`; then each
//    peer's entry is taken from the local buffer as it lands (re-filling the
//    sentinel) into `out`.
//  view (query_publish): once every peer has released the last view call,
//    this rank's heads of every rank's view (its own included); then wait
//    until every peer's heads have landed in the local view.
// Every wait is host_spin's: bounded, honouring the abort word, and a failure
// aborts the workspace on every rank.
void fan_out(const Workspace& ws, const QueryGeometry& g, const CallHeader& header, int64_t rows, const uint32_t* src,
             uint32_t* out, bool view) {
  const int64_t n = ws.world_size, me = ws.rank;
  const int64_t row_words = g.local_heads * g.item_bytes() / 4;  // one rank's heads of one row
  auto at_row = [&](uint8_t* base, int64_t t, int64_t s) {  // [row][src*H_loc + h] layout
    return reinterpret_cast<uint32_t*>(base) + (t * n + s) * row_words;
  };
  if (!view) {
    const uint64_t call = host_call_index(ws);
    const int64_t set = static_cast<int64_t>(call % kDataFlagBuffers);
    for (int64_t d = 0; d < n; ++d) {
      if (d == me) continue;
      host_store_call_header(query_header(ws, g, d, me, set), header);  // before the data it describes
      auto* entry = reinterpret_cast<uint32_t*>(query_entry(ws, g, d, me, call));
      store_words(entry, src, rows * row_words, g.canonical);
    }
    for (int64_t t = 0; t < rows; ++t)
      store_words(out + (t * n + me) * row_words, src + t * row_words, row_words, g.canonical);
    for (int64_t s = 0; s < n; ++s) {
      if (s == me) continue;
      take_query_header(ws, s, call, query_header(ws, g, me, s, set), query_header(ws, g, me, s, kQueryViewHeaders),
                        header, kWaitHeader);
      auto* entry = reinterpret_cast<uint32_t*>(query_entry(ws, g, me, s, call));
      for (int64_t t = 0; t < rows; ++t)
        host_take_payload(ws, s, call, entry + t * row_words, row_words, out + (t * n + s) * row_words);
    }
    host_finish_call(ws, call);
    return;
  }
  QueryControl* mine = query_control(ws, me);
  const uint64_t call = __atomic_load_n(&mine->view_call, __ATOMIC_RELAXED);
  for (int64_t d = 0; d < n; ++d) {
    if (d == me) continue;
    host_spin(ws, d, call, [&] { return __atomic_load_n(&mine->released[d], __ATOMIC_ACQUIRE) >= call; },
              kWaitViewRelease);
  }
  for (int64_t d = 0; d < n; ++d) {
    if (d != me) host_store_call_header(query_header(ws, g, d, me, kQueryViewHeaders), header);
    for (int64_t t = 0; t < rows; ++t)
      store_words(at_row(query_view(ws, g, d), t, me), src + t * row_words, row_words, g.canonical);
  }
  for (int64_t s = 0; s < n; ++s) {
    if (s == me) continue;
    // The other kind: src's header of this rank's next copying call.
    const int64_t copying = static_cast<int64_t>(host_call_index(ws) % kDataFlagBuffers);
    take_query_header(ws, s, call, query_header(ws, g, me, s, kQueryViewHeaders), query_header(ws, g, me, s, copying),
                      header, kWaitViewHeader);  // names the view buffer and call
    for (int64_t t = 0; t < rows; ++t) {
      const uint32_t* w = at_row(query_view(ws, g, me), t, s);
      for (int64_t i = 0; i < row_words; ++i)
        host_spin(ws, s, call, [&] { return __atomic_load_n(w + i, __ATOMIC_ACQUIRE) != kSentinel; }, kWaitViewData);
    }
  }
}

// Produces this rank's head shard once, then fans it out.
void gather_cpu(const QueryCall& c, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                at::ScalarType out_dtype, bool view) {
  const QueryShape& s = c.shape;
  auto local = at::empty({s.rows, s.heads, s.width()}, ql_nope.options().dtype(out_dtype));
  rope_quant_cpu(s, ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype, local);
  fan_out(*c.ws, c.geo, c.header, s.rows, static_cast<const uint32_t*>(local.data_ptr()),
          view ? nullptr : static_cast<uint32_t*>(c.out->data_ptr()), view);
}

void all_gather_heads_cpu(const HeadsCall& c, const at::Tensor& q, at::Tensor& out) {
  fan_out(*c.ws, c.geo, c.header, c.rows, static_cast<const uint32_t*>(q.data_ptr()),
          static_cast<uint32_t*>(out.data_ptr()), false);
}

// The reader of the view is done: re-fill the peers' heads of its rows with
// the sentinel, then tell every producer (a release store, after the
// re-fill) and advance the view call.
void release_cpu(const ReleaseCall& c, const at::Tensor&) {
  const Workspace& ws = *c.ws;
  const QueryGeometry& g = c.geo;
  const int64_t n = ws.world_size, me = ws.rank;
  const int64_t row_words = g.local_heads * g.item_bytes() / 4;
  auto* view = reinterpret_cast<uint32_t*>(query_view(ws, g, me));
  for (int64_t t = 0; t < c.rows; ++t)
    for (int64_t s = 0; s < n; ++s) {
      if (s == me) continue;
      uint32_t* w = view + (t * n + s) * row_words;
      for (int64_t i = 0; i < row_words; ++i) __atomic_store_n(w + i, kSentinel, __ATOMIC_RELAXED);
    }
  QueryControl* mine = query_control(ws, me);
  const uint64_t call = __atomic_load_n(&mine->view_call, __ATOMIC_RELAXED);
  for (int64_t d = 0; d < n; ++d)
    if (d != me) __atomic_store_n(&query_control(ws, d)->released[me], call + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&mine->view_call, call + 1, __ATOMIC_RELAXED);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CPU, m) {
  m.impl("query_rope_quant", &query_rope_quant_op<rope_quant_cpu>);
  m.impl("query_gather", &query_gather_op<gather_cpu>);
  m.impl("query_publish", &query_publish_op<gather_cpu>);
  m.impl("query_release", &query_release_op<release_cpu>);
  m.impl("query_all_gather_heads_out", &query_all_gather_heads_out_op<all_gather_heads_cpu>);
}

}  // namespace sdcp
