// Scratch harness for the top-K owner sort (not part of the library).
#pragma once
#include <cstdint>
#include <cstdio>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

__host__ __device__ __forceinline__ uint64_t topk_key(float score, int32_t id) {
  if (id < 0) return 0;
  uint32_t hi;
  if (score != score) {
    hi = 0;
  } else {
#ifdef __CUDA_ARCH__
    uint32_t b = (score == 0.0f) ? 0u : __float_as_uint(score);
#else
    uint32_t b;
    memcpy(&b, &score, 4);
    if (score == 0.0f) b = 0;
#endif
    hi = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  const uint32_t lo = 0x80000000u | static_cast<uint32_t>(0x7fffffff - id);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

__host__ __device__ __forceinline__ int32_t topk_key_id(uint64_t key) {
  if (key == 0) return -1;
  return 0x7fffffff - static_cast<int32_t>(static_cast<uint32_t>(key) & 0x7fffffffu);
}

// Phase stamps: thread 0 of block 0 writes clock64 into stamps[i].
#define STAMP(i)                                                        \
  do {                                                                  \
    if (TRACE && threadIdx.x == 0 && blockIdx.x == 0) stamps[i] = clock64(); \
  } while (0)
