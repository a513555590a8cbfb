// Version 4.1's splitting passes (64-bit range passes over buckets above
// kFinal keys), the slow path of v42 and v45 (the 4.1 one-pass rank itself,
// superseded by v42, is in the repository's history).
#pragma once
#include "v40_multipass.cuh"

namespace bk {
using cur::SortSmem;
using cur::pack_seg;
using cur::seg_start;
using cur::seg_size;
using cur::key_score;
using cur::finite_hi;
using cur::kmin;
using cur::kmax;

constexpr int kN = 2048;
constexpr int kFinal = 32;

// Keys of the 64-bit range passes (same as cur's loop, from pass 1).
template <int T>
__device__ void split_passes(const SortSmem& m, int n, int limit, int cur_buf, uint64_t* out) {
  constexpr int P = kN / T;
  const int tid = threadIdx.x;
  int cur = cur_buf;
  for (int pass = 1; pass < 24; ++pass) {
    const uint64_t* K = m.keys[cur];
    const uint32_t* S = m.seg[cur];
    uint64_t x[P];
    uint32_t sg[P];
    int idx[P];
    bool split[P];
    bool any = false;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = tid + i * T;
      split[i] = false;
      if (j < n) {
        x[i] = K[j];
        sg[i] = S[j];
        const int st = seg_start(sg[i]);
        split[i] = seg_size(sg[i]) > kFinal && st < limit && m.bmin[st] != m.bmax[st];
        m.cnt[j] = split[i] ? 0 : 1;
        any |= split[i];
      }
    }
    if (!__syncthreads_or(any)) break;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (!split[i]) continue;
      const int st = seg_start(sg[i]), sz = seg_size(sg[i]);
      const uint64_t lo = m.bmin[st];
      const double f = static_cast<double>(x[i] - lo) / (static_cast<double>(m.bmax[st] - lo) + 1.0) * sz;
      const int bb = sz - 1 - min(sz - 1, static_cast<int>(f));
      idx[i] = st + bb;
      atomicAdd(&m.cnt[idx[i]], 1);
    }
    __syncthreads();
    for (int j = tid; j < n; j += T) {
      m.bmin[j] = ~uint64_t{0};
      m.bmax[j] = 0;
    }
    cur::block_exclusive_scan_t<T>(m.cnt, m.pos, n);
    uint64_t* K2 = m.keys[cur ^ 1];
    uint32_t* S2 = m.seg[cur ^ 1];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = tid + i * T;
      if (j >= n) continue;
      int dst = j;
      uint32_t s2 = sg[i];
      if (split[i]) {
        const int st = m.pos[idx[i]];
        dst = st + atomicSub(&m.cnt[idx[i]], 1) - 1;
        s2 = pack_seg(st, m.pos[idx[i] + 1] - st);
      }
      K2[dst] = x[i];
      S2[dst] = s2;
      if (seg_size(s2) > kFinal) {
        atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[seg_start(s2)]), static_cast<unsigned long long>(x[i]));
        atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[seg_start(s2)]), static_cast<unsigned long long>(x[i]));
      }
    }
    __syncthreads();
    cur ^= 1;
  }
  const uint64_t* K = m.keys[cur];
  const uint32_t* S = m.seg[cur];
  for (int j = tid; j < n; j += T) {
    const uint32_t sg = S[j];
    const int st = seg_start(sg), sz = seg_size(sg);
    if (st >= limit || sz <= kFinal) continue;  // small buckets are already placed
    const uint64_t v = K[j];
    int r = j - st;
    if (m.bmin[st] != m.bmax[st]) {
      r = 0;
      for (int q = st; q < st + sz; ++q) {
        const uint64_t y = K[q];
        r += (y > v) || (y == v && q < j);
      }
    }
    if (st + r < limit) out[st + r] = v;
  }
  // Buckets that became small in these passes.
  for (int j = tid; j < n; j += T) {
    const uint32_t sg = S[j];
    const int st = seg_start(sg), sz = seg_size(sg);
    if (st >= limit || sz > kFinal) continue;
    const uint64_t v = K[j];
    int r = 0;
    for (int q = st; q < st + sz; ++q) {
      const uint64_t y = K[q];
      r += (y > v) || (y == v && q < j);
    }
    if (st + r < limit) out[st + r] = v;
  }
  __syncthreads();
}

}  // namespace bk
