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
};

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
// MLA's 512 (32 lanes x 8 elements x 2); a wider nope loads the rest in the loop.
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
    const int d = lane * 8 + u * 32 * 8;
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
    if (!good) return;
    if (a.cache_f32) {
      const float* c = static_cast<const float*>(a.cache) + pos * a.rope_dim;
      co = c[j];
      si = c[half + j];
    } else {
      const c10::BFloat16* c = static_cast<const c10::BFloat16*>(a.cache) + pos * a.rope_dim;
      co = static_cast<float>(c[j]);
      si = static_cast<float>(c[half + j]);
    }
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

}  // namespace
}  // namespace sdcp
