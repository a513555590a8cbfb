// Version 4.2 of the owner sort (what csrc/topk_cuda.cu runs, kBucketsPerKey =
// NB = 2): v41 with the loads issued together, an fp32 bucket map, packed seg, counting rank
// only for 2 <= sz <= KF (kFinal as shipped; 64 is version 4.3), and NB
// buckets per key (1 or 2).
#pragma once
#include "v41_one_pass.cuh"

namespace bk2 {
using namespace bk;

template <int T, int NB, int KF = kFinal, typename ScoreAt, typename IdAt>
__device__ void rank_sort(const SortSmem& m, ScoreAt score_at, IdAt id_at, int n, int limit, uint64_t* out) {
  constexpr int P = kN / T, W = T / 32, PB = P * NB;
  __shared__ uint32_t wmin[W], wmax[W];
  __shared__ int wsum[W];
  int* cnt = m.cnt;   // NB * kN ints: cnt then pos live in cnt/pos + bmin area
  int* pos = reinterpret_cast<int*>(m.bmin);  // bmin/bmax unused on the fast path: 2 * kN * 8 bytes
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float sc[P];
  int idv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int j = tid + i * T;
    sc[i] = j < n ? score_at(j) : 0.f;
    idv[i] = j < n ? id_at(j) : -1;
  }
#pragma unroll
  for (int i = 0; i < PB; ++i) cnt[tid * PB + i] = 0;
  uint64_t x[P];
  int b[P], slot[P];
  uint32_t flo = 0xFFFFFFFFu, fhi = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    x[i] = topk_key(sc[i], idv[i]);
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    if (tid + i * T < n && finite_hi(h)) {
      flo = min(flo, h);
      fhi = max(fhi, h);
    }
  }
  STAMP(1);
  flo = __reduce_min_sync(0xffffffffu, flo);
  fhi = __reduce_max_sync(0xffffffffu, fhi);
  if (lane == 0) {
    wmin[warp] = flo;
    wmax[warp] = fhi;
  }
  __syncthreads();
  flo = __reduce_min_sync(0xffffffffu, lane < W ? wmin[lane] : 0xFFFFFFFFu);
  fhi = __reduce_max_sync(0xffffffffu, lane < W ? wmax[lane] : 0u);
  STAMP(2);
  const int nb = n * NB;
  const bool few = n <= KF;
  const float fmax = key_score(fhi);
  const float scale = flo < fhi ? static_cast<float>(static_cast<double>(nb - 2) /
                                                     (static_cast<double>(fmax) - static_cast<double>(key_score(flo))))
                                : 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    int bb;
    if (few || h >= 0xFF800000u) bb = 0;
    else if (!finite_hi(h)) bb = nb - 1;
    else bb = 1 + min(nb - 3, static_cast<int>((fmax - key_score(h)) * scale));
    b[i] = bb;
    slot[i] = atomicAdd(&cnt[bb], 1);
  }
  __syncthreads();
  STAMP(3);
  {
    int c[PB], s = 0;
#pragma unroll
    for (int i = 0; i < PB; ++i) {
      c[i] = cnt[tid * PB + i];
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
    for (int i = 0; i < PB; ++i) {
      pos[tid * PB + i] = run;
      run += c[i];
    }
  }
  __syncthreads();
  STAMP(4);
  uint64_t* K = m.keys[0];
  uint32_t* S = m.seg[0];
  bool large = false;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const int st = pos[b[i]], sz = cnt[b[i]];
    if (sz == 1) {
      if (st < limit) out[st] = x[i];
    } else {
      K[st + slot[i]] = x[i];
      S[st + slot[i]] = pack_seg(st, sz);
      large |= sz > KF;
    }
  }
  large = __syncthreads_or(large);
  STAMP(5);
  if (!large) {
    // Rank inside buckets of 2 .. KF keys (size-1 buckets are placed).
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (tid + i * T >= n) continue;
      const int st = pos[b[i]], sz = cnt[b[i]];
      if (sz == 1 || st >= limit) continue;
      const uint64_t v = x[i];
      const int me = st + slot[i];
      int r = 0;
      for (int q = st; q < st + sz; ++q) {
        const uint64_t y = K[q];
        r += (y > v) || (y == v && q < me);
      }
      if (st + r < limit) out[st + r] = v;
    }
    __syncthreads();
    STAMP(6);
    return;
  }
  // Slow path (a bucket above KF): the generic splitting passes over the
  // whole row, size-1 buckets included.
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const int st = pos[b[i]], sz = cnt[b[i]];
    if (sz == 1) {
      K[st] = x[i];
      S[st] = pack_seg(st, 1);
    }
  }
  __syncthreads();
  for (int j = tid; j < n; j += T) {
    m.bmin[j] = ~uint64_t{0};
    m.bmax[j] = 0;
  }
  __syncthreads();
  for (int j = tid; j < n; j += T) {
    const uint32_t sg = S[j];
    if (seg_size(sg) <= kFinal) continue;
    atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[seg_start(sg)]), static_cast<unsigned long long>(K[j]));
    atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[seg_start(sg)]), static_cast<unsigned long long>(K[j]));
  }
  __syncthreads();
  split_passes<T>(m, n, limit, 0, out);
  STAMP(6);
}
}  // namespace bk2
