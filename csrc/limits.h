// Limits and constants every op family shares, in one place.
#pragma once

#include <cstdint>

namespace sdcp {

// Ranks a workspace layout and the host backend accept.
constexpr int64_t kMaxWorld = 64;
// Ranks the CUDA kernels accept: per-thread arrays hold one weight or list
// head per rank.
constexpr int kMaxDeviceWorld = 16;
// Alignment of every part of a workspace region.
constexpr int64_t kAlign = 256;
// Library kernels (cuBLAS) may read up to 64 KiB past a buffer they are given.
constexpr int64_t kTailPad = 64 * 1024;

}  // namespace sdcp
