// The exact semantics shared by the CPU and CUDA kernels (docs/DESIGN.md section 2),
// written once so that both backends select and weigh identically.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define SDCP_HD __host__ __device__ __forceinline__
#else
#define SDCP_HD inline
#endif

namespace sdcp {

SDCP_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

// Top-K order as one unsigned 64-bit key, larger = selected first:
//   high 32 bits: the score mapped to an order-preserving unsigned integer,
//                 -0.0 folded onto +0.0, NaN mapped below -inf;
//   low 32 bits:  bit 31 set for a valid id, then 0x7fffffff - id so that
//                 the lower id wins a tie.
// An id < 0 gives key 0, below every valid candidate (even a NaN one).
SDCP_HD uint64_t topk_key(float score, int32_t id) {
  if (id < 0) return 0;
  uint32_t hi;
  if (score != score) {
    hi = 0;
  } else {
    uint32_t b = (score == 0.0f) ? 0u : float_bits(score);
    hi = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  const uint32_t lo = 0x80000000u | static_cast<uint32_t>(0x7fffffff - id);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

SDCP_HD int32_t topk_key_id(uint64_t key) {
  if (key == 0) return -1;
  return 0x7fffffff - static_cast<int32_t>(static_cast<uint32_t>(key) & 0x7fffffffu);
}

// LSE sanitisation: NaN and +inf mean "empty shard".
SDCP_HD float lse_sanitize(float l) {
  return (l != l || l == INFINITY) ? -INFINITY : l;
}

}  // namespace sdcp

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

namespace sdcp {

// Round-to-nearest fp32 arithmetic with no FMA contraction, so that the CPU
// kernels, the CUDA kernels and the PyTorch reference agree bit for bit.
SDCP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SDCP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SDCP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SDCP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// RoPE of one pair (x0, x1) with (cos, sin):
//   first  = x0 * cos - x1 * sin,   second = x1 * cos + x0 * sin.
SDCP_HD float rope_first(float x0, float x1, float c, float s) {
  return sub_rn(mul_rn(x0, c), mul_rn(x1, s));
}
SDCP_HD float rope_second(float x0, float x1, float c, float s) {
  return add_rn(mul_rn(x1, c), mul_rn(x0, s));
}

// float8_e4m3fn quantisation: saturate(x / scale), round to nearest even;
// every NaN becomes 0x7F. The sign of a NaN is dropped so that no output word
// is four 0xFF bytes (the data-as-flag sentinel, which the gather rewrites to
// 0x7F7F7F7F): the gathered query stays bit-identical to the local one.
constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;

// Every e4m3fn NaN (x111'1111) among the bytes of `w` as 0x7F: a byte's low
// 7 bits plus 1 carry into its bit 7 only when they are all ones.
SDCP_HD uint32_t e4m3_nan_canonical(uint32_t w) {
  return w & ~(((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Compute capability 8.9 and later convert a pair in one instruction that
// rounds to nearest even and saturates finite and infinite values at +-448,
// as the clamp of the portable path does (a value from 448 to 464 rounds to
// 448; one above rounds past the largest finite value and saturates). Its
// NaN has no defined sign: canonicalised as any byte. v0 in the low byte.
#define SDCP_E4M3_CVT 1
__device__ __forceinline__ uint16_t e4m3x2_bits(float v0, float v1) {
  uint16_t w;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(w) : "f"(v1), "f"(v0));
  return static_cast<uint16_t>(e4m3_nan_canonical(w));
}
#endif

// The float8 byte of a quotient v = x / scale, already divided.
SDCP_HD uint8_t e4m3_of_quotient(float v) {
#if defined(SDCP_E4M3_CVT)
  return static_cast<uint8_t>(e4m3x2_bits(v, 0.0f));
#else
  if (v != v) return kE4M3NaN;
  v = v > kE4M3Max ? kE4M3Max : (v < -kE4M3Max ? -kE4M3Max : v);
  return c10::Float8_e4m3fn(v).x;
#endif
}

SDCP_HD c10::Float8_e4m3fn quantize_e4m3(float x, float scale) {
  return c10::Float8_e4m3fn(e4m3_of_quotient(div_rn(x, scale)), c10::Float8_e4m3fn::from_bits());
}

// The float8 bytes of two quotients, v0 in the low byte.
SDCP_HD uint16_t e4m3x2_of_quotients(float v0, float v1) {
#if defined(SDCP_E4M3_CVT)
  return e4m3x2_bits(v0, v1);
#else
  return static_cast<uint16_t>(e4m3_of_quotient(v0) | (e4m3_of_quotient(v1) << 8));
#endif
}

// Two values quantised as quantize_e4m3 does, x0 in the low byte.
SDCP_HD uint16_t quantize_e4m3x2(float x0, float x1, float scale) {
  return e4m3x2_of_quotients(div_rn(x0, scale), div_rn(x1, scale));
}

}  // namespace sdcp

namespace sdcp {

// LSE combine weights for one (row, head) over n shards (docs/DESIGN.md section 2):
// sanitise, m = max (0 when every shard is empty), L = m + log(sum exp(l - m)),
// w = exp(l - L), all weights 0 and L = -inf when the sum is 0. `lse(i)`
// returns shard i's raw LSE; `w` receives n weights. Returns L.
template <typename LseAt>
SDCP_HD float lse_weights(int n, LseAt lse, bool base2, float* w) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    w[i] = lse_sanitize(lse(i));
    m = w[i] > m ? w[i] : m;
  }
  if (m == -INFINITY) m = 0.0f;
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += base2 ? exp2f(w[i] - m) : expf(w[i] - m);
  if (sum == 0.0f) {
    for (int i = 0; i < n; ++i) w[i] = 0.0f;
    return -INFINITY;
  }
  const float L = m + (base2 ? log2f(sum) : logf(sum));
  for (int i = 0; i < n; ++i) w[i] = base2 ? exp2f(w[i] - L) : expf(w[i] - L);
  return L;
}

}  // namespace sdcp
