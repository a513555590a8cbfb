// One-pass bucket rank: a float-value bucket per key, the slot inside the
// bucket from the histogram atomic, one scan, one scatter, a rank by counting
// inside buckets of <= kFinal keys. Larger buckets (ties, skew) fall back to
// the generic splitting passes of cur::.
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
__device__ void split_passes(const SortSmem& m, int n, int limit, int cur_buf, uint64_t* out);

template <int T, typename KeyAt>
__device__ void rank_sort(const SortSmem& m, KeyAt key_at, int n, int limit, uint64_t* out) {
  constexpr int P = kN / T, W = T / 32;
  __shared__ uint32_t wmin[W], wmax[W];
  __shared__ int wsum[W];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint64_t x[P];
  int b[P], slot[P];
  uint32_t flo = 0xFFFFFFFFu, fhi = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int j = tid + i * T;
    x[i] = j < n ? key_at(j) : 0;
    m.cnt[j] = 0;
  }
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    if (tid + i * T < n && finite_hi(h)) {
      flo = min(flo, h);
      fhi = max(fhi, h);
    }
  }
  flo = __reduce_min_sync(0xffffffffu, flo);
  fhi = __reduce_max_sync(0xffffffffu, fhi);
  if (lane == 0) {
    wmin[warp] = flo;
    wmax[warp] = fhi;
  }
  __syncthreads();
  flo = __reduce_min_sync(0xffffffffu, lane < W ? wmin[lane] : 0xFFFFFFFFu);
  fhi = __reduce_max_sync(0xffffffffu, lane < W ? wmax[lane] : 0u);
  STAMP(1);
  // Buckets: 0 = +inf, nb - 1 = -inf / NaN / invalid, 1 .. nb - 2 finite by value.
  const int nb = n;
  const bool few = n <= kFinal;  // one bucket, ranked by counting
  const bool range = flo < fhi;
  const double fmax = static_cast<double>(key_score(fhi));
  const double scale = range ? static_cast<double>(nb - 2) / (fmax - static_cast<double>(key_score(flo))) : 0.0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    int bb;
    if (few) bb = 0;
    else if (h >= 0xFF800000u) bb = 0;
    else if (!finite_hi(h)) bb = nb - 1;
    else bb = 1 + min(nb - 3, static_cast<int>((fmax - static_cast<double>(key_score(h))) * scale));
    b[i] = bb;
    slot[i] = atomicAdd(&m.cnt[bb], 1);
  }
  __syncthreads();
  STAMP(2);
  // Exclusive scan of cnt[0 .. kN) into pos (thread tid owns buckets tid * P ..).
  {
    int c[P], s = 0;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      c[i] = m.cnt[tid * P + i];
      s += c[i];
    }
    int incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int w = lane < W ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    const int before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    int run = (warp > 0 ? before : 0) + incl - s;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      m.pos[tid * P + i] = run;
      run += c[i];
    }
  }
  __syncthreads();
  STAMP(3);
  // Scatter: keys and the bucket of each position.
  uint64_t* K = m.keys[0];
  uint32_t* S = m.seg[0];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const int st = m.pos[b[i]];
    K[st + slot[i]] = x[i];
    S[st + slot[i]] = pack_seg(st, m.cnt[b[i]]);
  }
  __syncthreads();
  STAMP(4);
  // Rank inside buckets of <= kFinal keys.
  bool large = false;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int j = tid + i * T;
    if (j >= n) continue;
    const uint32_t sg = S[j];
    const int st = seg_start(sg), sz = seg_size(sg);
    if (st >= limit) continue;
    const uint64_t v = K[j];
    if (sz == 1) {
      out[st] = v;
    } else if (sz <= kFinal) {
      int r = 0;
      for (int q = st; q < st + sz; ++q) {
        const uint64_t y = K[q];
        r += (y > v) || (y == v && q < j);
      }
      if (st + r < limit) out[st + r] = v;
    } else {
      large = true;
    }
  }
  if (!__syncthreads_or(large)) {
    STAMP(5);
    return;
  }
  // Larger buckets: their 64-bit key range, then the generic splitting passes.
  for (int j = tid; j < n; j += T) {
    m.bmin[j] = ~uint64_t{0};
    m.bmax[j] = 0;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int j = tid + i * T;
    if (j >= n) continue;
    const uint32_t sg = S[j];
    if (seg_size(sg) <= kFinal) continue;
    atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[seg_start(sg)]), static_cast<unsigned long long>(K[j]));
    atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[seg_start(sg)]), static_cast<unsigned long long>(K[j]));
  }
  __syncthreads();
  split_passes<T>(m, n, limit, 0, out);
  STAMP(5);
}

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
