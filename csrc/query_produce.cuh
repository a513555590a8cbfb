// The query's producer, shared by query_rope_quant and the peer kernels: one
// warp produces one (row, local head) item, RoPE on q_pe (interleaved or NeoX
// pairing), concatenated with ql_nope, then bf16 or saturating
// float8_e4m3fn (semantics.h).
#pragma once

#include "semantics.h"

#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/util/BFloat16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace sdcp {
// Internal linkage, as when the producer lived in query_cuda.cu: each
// including translation unit compiles its own copy.
namespace {

struct ProducerArgs {
  const c10::BFloat16* nope;
  const c10::BFloat16* pe;
  const void* positions;
  const void* cache;
  const float* scale;  // nullptr: 1.0
  int64_t nope_s0, nope_s1, pe_s0, pe_s1, pos_s0;
  int64_t max_pos;
  int rows, heads, nope_dim, rope_dim;  // 32-bit: checked on the host (producer_args)
  at::cuda::detail::IntDivider<unsigned> by_heads;  // item i = t * heads + h: a multiply, not a division
  bool pos64, cache_f32, neox;
  bool vec_nope;  // nope rows are 16-byte aligned and a multiple of 8 elements
  // The item's output vectors are produced in registers (produce_item_direct):
  // every 16-byte output vector is all nope or all rope, at most one rope pair
  // per lane (direct_layout). Float8 then loads a lane's two nope vectors side
  // by side (the 16 elements of its output vector), bf16 32 vectors apart.
  bool direct, nope_pairs;
};

// x / scale for every element of a call, rounded as div_rn (IEEE division)
// rounds it. The reciprocal and its Newton step, which div.rn computes for
// every division, are computed once; each element then takes the multiply and
// the one-FMA correction of that same sequence, which is correctly rounded
// where nothing under- or overflows. Outside: a divisor far from 1 (`fast`
// false, warp-uniform) takes div_rn; a quotient whose first approximation is
// zero, infinite or NaN keeps it (the correction would lose a zero's sign or
// make NaN of an infinity), and one that is not (a value under 2**-11 or over
// 2**10 after scaling) only feeds a float8 conversion that rounds it to a
// signed zero or saturates it, as the correctly rounded quotient would be.
struct ScaleDivider {
  float b, y;
  bool fast;
};

__device__ __forceinline__ ScaleDivider scale_divider(float scale) {
  ScaleDivider d;
  d.b = scale;
  d.y = 0.0f;
  // |scale| in [2**-60, 2**60]: for a quotient in [2**-11, 2**10], the
  // dividend, the reciprocal and the residual are normal floats.
  const uint32_t e = (__float_as_uint(scale) >> 23) & 0xFFu;
  d.fast = e >= 127u - 60u && e <= 127u + 60u;
  if (d.fast) {
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(scale));
    d.y = __fmaf_rn(y0, __fmaf_rn(-scale, y0, 1.0f), y0);
  }
  return d;
}

template <bool kFast>
__device__ __forceinline__ float divide(const ScaleDivider& d, float x) {
  if constexpr (!kFast) return __fdiv_rn(x, d.b);
  const float q = __fmul_rn(x, d.y);
  const float corrected = __fmaf_rn(__fmaf_rn(-d.b, q, x), d.y, q);
  return (fabsf(q) < INFINITY && q != 0.0f) ? corrected : q;
}

// Two float8 bytes: (x0, x1) / scale, x0 in the low byte (quantize_e4m3x2's).
template <bool kFast>
__device__ __forceinline__ uint32_t e4m3x2(const ScaleDivider& d, float x0, float x1) {
  return e4m3x2_of_quotients(divide<kFast>(d, x0), divide<kFast>(d, x1));
}

// Four float8 bytes: (x0 .. x3) / scale, x0 in the low byte, NaNs canonical
// (quantize_e4m3's bytes). Not two e4m3x2: the NaN rewrite runs once on the
// word, not once per half.
template <bool kFast>
__device__ __forceinline__ uint32_t e4m3x4(const ScaleDivider& d, float x0, float x1, float x2, float x3) {
#if defined(SDCP_E4M3_CVT)
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(divide<kFast>(d, x1)), "f"(divide<kFast>(d, x0)));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(divide<kFast>(d, x3)), "f"(divide<kFast>(d, x2)));
  return e4m3_nan_canonical(static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16));
#else
  return static_cast<uint32_t>(e4m3_of_quotient(divide<kFast>(d, x0))) |
         (static_cast<uint32_t>(e4m3_of_quotient(divide<kFast>(d, x1))) << 8) |
         (static_cast<uint32_t>(e4m3_of_quotient(divide<kFast>(d, x2))) << 16) |
         (static_cast<uint32_t>(e4m3_of_quotient(divide<kFast>(d, x3))) << 24);
#endif
}

template <typename out_t>
__device__ __forceinline__ out_t convert_out(float v, float scale) {
  if constexpr (std::is_same<out_t, c10::Float8_e4m3fn>::value) return quantize_e4m3(v, scale);
  else return static_cast<out_t>(v);
}

// Eight bf16 elements converted and stored as one shared-memory store (8 or
// 16 bytes); float8 converts them in pairs.
template <typename out_t>
__device__ __forceinline__ void convert8(out_t* dst, const uint4& raw, float scale) {
  const c10::BFloat16* x = reinterpret_cast<const c10::BFloat16*>(&raw);
  if constexpr (std::is_same<out_t, c10::Float8_e4m3fn>::value) {
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      w[e] = quantize_e4m3x2(static_cast<float>(x[2 * e]), static_cast<float>(x[2 * e + 1]), scale);
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
  } else {
    out_t v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = convert_out<out_t>(static_cast<float>(x[e]), scale);
    uint4 w;
    memcpy(&w, v, 16);
    *reinterpret_cast<uint4*>(dst) = w;
  }
}

// Nope vectors per lane loaded together before any is converted: 2 cover
// MLA's 512 (32 lanes x 8 elements x 2); a wider nope loads the rest in the
// loop. Lane l loads elements 8l and 256 + 8l, or 16l and 16l + 8 (nope_pairs).
constexpr int kNopePrefetch = 2;

// What a lane loads of item (t, h) before the item's position is known: the
// position, its first nope vectors and its first rope pair (j = lane). One
// round of loads, which a warp issues for its next item before it converts
// the current one. Kept as loaded (raw bits, both position widths) so that
// nothing waits for them until the item is produced.
struct ItemInputs {
  int64_t pos64;
  int32_t pos32;
  uint4 nope[kNopePrefetch];
  // bf16 bits, one per 32-bit register: two 16-bit fields would be packed
  // into one register, and the packing waits for the loads.
  uint32_t x0, x1;
};

__device__ __forceinline__ float bf16_bits_to_float(uint32_t b) { return __uint_as_float(b << 16); }

__device__ __forceinline__ void rope_pair_index(const ProducerArgs& a, int j, int& i0, int& i1) {
  i0 = a.neox ? j : 2 * j;
  i1 = a.neox ? j + a.rope_dim / 2 : 2 * j + 1;
}

// cos and sin of rope pair j at position `pos` (inside the cache) from the
// cos/sin cache [max_pos, rope_dim] (fp32 or bf16).
__device__ __forceinline__ void cache_cos_sin(const ProducerArgs& a, int64_t pos, int j, float& co, float& si) {
  const int half = a.rope_dim / 2;
  if (a.cache_f32) {
    const float* c = static_cast<const float*>(a.cache) + pos * a.rope_dim;
    co = c[j];
    si = c[half + j];
  } else {
    const c10::BFloat16* c = static_cast<const c10::BFloat16*>(a.cache) + pos * a.rope_dim;
    co = static_cast<float>(c[j]);
    si = static_cast<float>(c[half + j]);
  }
}

__device__ __forceinline__ ItemInputs load_item(const ProducerArgs& a, int t, int h) {
  const int lane = threadIdx.x & 31;
  ItemInputs in;
  in.pos64 = 0;
  in.pos32 = 0;
  if (a.pos64) in.pos64 = static_cast<const int64_t*>(a.positions)[t * a.pos_s0];
  else in.pos32 = static_cast<const int32_t*>(a.positions)[t * a.pos_s0];
  const c10::BFloat16* n = a.nope + t * a.nope_s0 + h * a.nope_s1;
#pragma unroll
  for (int u = 0; u < kNopePrefetch; ++u) {
    const int d = a.nope_pairs ? lane * 16 + u * 8 : lane * 8 + u * 32 * 8;
    in.nope[u] = make_uint4(0, 0, 0, 0);
    if (a.vec_nope && d < a.nope_dim) in.nope[u] = *reinterpret_cast<const uint4*>(n + d);
  }
  in.x0 = in.x1 = 0;
  if (lane < a.rope_dim / 2) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(a.pe + t * a.pe_s0 + h * a.pe_s1);
    int i0, i1;
    rope_pair_index(a, lane, i0, i1);
    in.x0 = q[i0];
    in.x1 = q[i1];
  }
  return in;
}

// Produces item (t, h), whose first inputs `in` were loaded (load_item), into
// `dst` (its first element). Called by a whole warp (convergent). `loaded()`
// runs first (the call index: its load overlaps theirs); the cache row, which
// depends on the position, is loaded next and lands while the nope part is
// converted. A position outside the cache goes to `bad_position(pos)`
// (warp-uniform) and the item is produced unrotated (no row of the cache is
// read).
template <typename out_t, typename Loaded, typename BadPosition>
__device__ __forceinline__ void produce_item(const ProducerArgs& a, int t, int h, const ItemInputs& in, out_t* dst,
                                             Loaded&& loaded, BadPosition&& bad_position) {
  const int lane = threadIdx.x & 31;
  const int64_t pos = a.pos64 ? in.pos64 : in.pos32;
  const c10::BFloat16* n = a.nope + t * a.nope_s0 + h * a.nope_s1;
  const int d0 = lane * 8;
  const int half = a.rope_dim / 2;
  const c10::BFloat16* q = a.pe + t * a.pe_s0 + h * a.pe_s1;
  const float scale = a.scale ? *a.scale : 1.0f;
  loaded();
  const bool good = pos >= 0 && pos < a.max_pos;
  auto cos_sin = [&](int j, float& co, float& si) {
    co = 1.0f;
    si = 0.0f;
    if (good) cache_cos_sin(a, pos, j, co, si);
  };
  float co0 = 1.0f, si0 = 0.0f;
  if (lane < half) cos_sin(lane, co0, si0);  // in flight while the nope part is converted
  if (a.vec_nope) {  // 8 elements per lane step: one 16-byte load, one 8- or 16-byte shared store
    int u = 0;
    for (int d = d0; d < a.nope_dim; d += 32 * 8, ++u) {
      uint4 raw;
      if (u < kNopePrefetch) {
        raw = in.nope[0];
#pragma unroll
        for (int k = 1; k < kNopePrefetch; ++k)
          if (u == k) raw = in.nope[k];  // selected, not indexed: an indexed array would live in local memory
      } else {
        raw = *reinterpret_cast<const uint4*>(n + d);
      }
      convert8(dst + d, raw, scale);
    }
  } else {
    for (int d = lane; d < a.nope_dim; d += 32) dst[d] = convert_out<out_t>(static_cast<float>(n[d]), scale);
  }
  if (!good) bad_position(pos);
  for (int j = lane; j < half; j += 32) {
    float co = co0, si = si0, x0 = bf16_bits_to_float(in.x0), x1 = bf16_bits_to_float(in.x1);
    int i0, i1;
    rope_pair_index(a, j, i0, i1);
    if (j != lane) {
      cos_sin(j, co, si);
      x0 = static_cast<float>(q[i0]);
      x1 = static_cast<float>(q[i1]);
    }
    dst[a.nope_dim + i0] = convert_out<out_t>(rope_first(x0, x1, co, si), scale);
    dst[a.nope_dim + i1] = convert_out<out_t>(rope_second(x0, x1, co, si), scale);
  }
}

// Whether the direct producer can make an item of this shape: every 16-byte
// output vector all nope or all rope, the nope rows loadable as 16-byte
// vectors, and at most one rope pair per lane (the rope stage of a warp holds
// kMaxRopeBytes).
constexpr int kMaxRopeBytes = 128;
inline bool direct_layout(const ProducerArgs& a, int out_bytes) {
  return a.vec_nope && (a.nope_dim * out_bytes) % 16 == 0 && (a.rope_dim * out_bytes) % 16 == 0 &&
         a.rope_dim % 2 == 0 && a.rope_dim <= 64 && a.rope_dim * out_bytes <= kMaxRopeBytes;
}

// Produces item (t, h) as produce_item does, without staging it: each lane
// converts the nope elements of output vectors lane, lane + 32, ... in
// registers and hands each to `emit(v, vector)` at once; the rope pairs (pair
// j on lane j) meet in the warp's `rope_stage` (kMaxRopeBytes, 16-byte
// aligned), from which the first lanes emit the rope vectors. Called by a
// whole warp (convergent), with a.direct; `loaded` and `bad_position` as in
// produce_item. Every emitted word is canonical: float8 NaNs are 0x7F and a
// bf16 NaN converted from float is 0x7FC0, so no word is the sentinel.
template <typename out_t, bool kFast, typename Emit, typename Loaded, typename BadPosition>
__device__ __forceinline__ void produce_item_direct_as(const ProducerArgs& a, const ScaleDivider& div, int t, int h,
                                                       const ItemInputs& in, uint4* rope_stage, Emit&& emit,
                                                       Loaded&& loaded, BadPosition&& bad_position) {
  constexpr bool kFp8 = std::is_same<out_t, c10::Float8_e4m3fn>::value;
  constexpr int kPerVec = 16 / sizeof(out_t);  // output elements of one 16-byte vector
  const int lane = threadIdx.x & 31;
  const int64_t pos = a.pos64 ? in.pos64 : in.pos32;
  const int half = a.rope_dim / 2;
  loaded();
  const bool good = pos >= 0 && pos < a.max_pos;
  float co = 1.0f, si = 0.0f;
  if (good && lane < half) cache_cos_sin(a, pos, lane, co, si);  // in flight while the nope part is converted
  const c10::BFloat16* n = a.nope + t * a.nope_s0 + h * a.nope_s1;
  const int nope_vecs = a.nope_dim / kPerVec;
  auto f = [](uint32_t w, int hi) { return hi ? __uint_as_float(w & 0xFFFF0000u) : __uint_as_float(w << 16); };
  for (int u = 0, v = lane; v < nope_vecs; ++u, v += 32) {
    if constexpr (kFp8) {  // 16 elements: two input vectors side by side
      uint4 r0 = in.nope[0], r1 = in.nope[1];
      if (u > 0) {
        r0 = *reinterpret_cast<const uint4*>(n + v * 16);
        r1 = *reinterpret_cast<const uint4*>(n + v * 16 + 8);
      }
      emit(v, make_uint4(e4m3x4<kFast>(div, f(r0.x, 0), f(r0.x, 1), f(r0.y, 0), f(r0.y, 1)),
                         e4m3x4<kFast>(div, f(r0.z, 0), f(r0.z, 1), f(r0.w, 0), f(r0.w, 1)),
                         e4m3x4<kFast>(div, f(r1.x, 0), f(r1.x, 1), f(r1.y, 0), f(r1.y, 1)),
                         e4m3x4<kFast>(div, f(r1.z, 0), f(r1.z, 1), f(r1.w, 0), f(r1.w, 1))));
    } else {  // 8 elements, one input vector; a bf16 value round-trips, a NaN becomes 0x7FC0
      uint4 r = u == 0 ? in.nope[0] : in.nope[1];
      if (u >= kNopePrefetch) r = *reinterpret_cast<const uint4*>(n + v * 8);
      auto pair = [&](uint32_t w) {
        const c10::BFloat16 lo = static_cast<c10::BFloat16>(f(w, 0)), hi = static_cast<c10::BFloat16>(f(w, 1));
        return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
      };
      emit(v, make_uint4(pair(r.x), pair(r.y), pair(r.z), pair(r.w)));
    }
  }
  if (!good) bad_position(pos);
  if (lane < half) {
    const float x0 = bf16_bits_to_float(in.x0), x1 = bf16_bits_to_float(in.x1);
    const float first = rope_first(x0, x1, co, si), second = rope_second(x0, x1, co, si);
    int i0, i1;
    rope_pair_index(a, lane, i0, i1);
    out_t* st = reinterpret_cast<out_t*>(rope_stage);
    if constexpr (kFp8) {
      const uint32_t b = e4m3x2<kFast>(div, first, second);
      st[i0] = c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits());
      st[i1] = c10::Float8_e4m3fn(static_cast<uint8_t>(b >> 8), c10::Float8_e4m3fn::from_bits());
    } else {
      st[i0] = static_cast<c10::BFloat16>(first);
      st[i1] = static_cast<c10::BFloat16>(second);
    }
  }
  __syncwarp();
  const int rope_vecs = a.rope_dim / kPerVec;
  if (lane < rope_vecs) emit(nope_vecs + lane, rope_stage[lane]);
  __syncwarp();  // the stage is rewritten by the next item
}

// Produces item (t, h) directly, with the fast division when `div` allows
// it: one warp-uniform branch per item, not per element.
template <typename out_t, typename Emit, typename Loaded, typename BadPosition>
__device__ __forceinline__ void produce_item_direct(const ProducerArgs& a, const ScaleDivider& div, int t, int h,
                                                    const ItemInputs& in, uint4* rope_stage, Emit&& emit,
                                                    Loaded&& loaded, BadPosition&& bad_position) {
  if (div.fast) produce_item_direct_as<out_t, true>(a, div, t, h, in, rope_stage, emit, loaded, bad_position);
  else produce_item_direct_as<out_t, false>(a, div, t, h, in, rope_stage, emit, loaded, bad_position);
}

}  // namespace
}  // namespace sdcp
