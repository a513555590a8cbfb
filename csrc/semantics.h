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
SDCP_HD c10::Float8_e4m3fn quantize_e4m3(float x, float scale) {
  float v = div_rn(x, scale);
  if (v != v) return c10::Float8_e4m3fn(kE4M3NaN, c10::Float8_e4m3fn::from_bits());
  v = v > kE4M3Max ? kE4M3Max : (v < -kE4M3Max ? -kE4M3Max : v);
  return c10::Float8_e4m3fn(v);
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
