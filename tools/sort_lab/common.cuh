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

// Phase stamps: thread 0 of block 0 writes clock64 into g_stamps[i] (lab.cu).
#define STAMP(i)                                                        \
  do {                                                                  \
    if (TRACE && threadIdx.x == 0 && blockIdx.x == 0) g_stamps[i] = clock64(); \
  } while (0)
