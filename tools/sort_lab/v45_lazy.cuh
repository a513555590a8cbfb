// Version 4.5 (what csrc/topk_cuda.cu runs as STAGE = false, BYPOS = true,
// KF = 128): v42 with
//   - the counting rank by position in the bucket order (BYPOS: a warp covers
//     32 neighbouring positions, mostly one bucket, so its probes are
//     broadcasts; v42 ranked by input key, every lane probing another bucket);
//   - the counting rank taken up to KF keys per bucket (tied scores stay on
//     the fast path);
//   - rows whose finite scores are all equal bucketed on the id (the id range
//     reduced only then);
//   - a thread's 4 bucket counts as one 16-byte vector (per-word accesses at a
//     4-word stride are 4-way bank conflicts).
// The positions of placed keys are marked (size 0) while the loads are in
// flight. STAGE keeps the keys in shared memory across the scan (as the
// library's 4.2 did, for the merge kernel's registers). Version 4.4, measured
// once, stored every key including the placed ones and reduced the id range
// always: 0.7 us slower on uniform rows.
#pragma once
#include "v42_one_pass.cuh"

namespace bk5 {
using namespace bk;

template <int T, int NB, int KF, bool STAGE = true, bool BYPOS = true, typename ScoreAt, typename IdAt>
__device__ void rank_sort(const SortSmem& m, ScoreAt score_at, IdAt id_at, int n, int limit, uint64_t* out) {
  constexpr int P = kN / T, W = T / 32, PB = P * NB;
  __shared__ uint32_t wlo[W], whi[W], wilo[W], wihi[W];
  __shared__ int wsum[W];
  int* bcnt = m.cnt;
  int* bstart = reinterpret_cast<int*>(m.bmin);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nb = n * NB;
  float sc[P];
  int idv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int j = tid + i * T;
    sc[i] = j < n ? score_at(j) : 0.f;
    idv[i] = j < n ? id_at(j) : -1;
  }
  static_assert(PB == 4, "one 16-byte vector of counts per thread");
  // A thread's counts as one 16-byte vector: per-element accesses at a
  // 4-word stride are 4-way bank conflicts.
  const bool whole = (tid + 1) * PB <= nb;
  if (whole) reinterpret_cast<int4*>(bcnt)[tid] = make_int4(0, 0, 0, 0);
  else
#pragma unroll
    for (int i = 0; i < PB; ++i)
      if (tid * PB + i < nb) bcnt[tid * PB + i] = 0;
#pragma unroll
  for (int i = 0; i < P; ++i)
    if (BYPOS && tid + i * T < n) m.seg[0][tid + i * T] = 0;  // size 0: placed, or not a bucket of >= 2
  uint64_t* staged = m.keys[1];
  uint64_t x[P];
  uint32_t lo = 0xFFFFFFFFu, hi = 0, ilo = 0xFFFFFFFFu, ihi = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    x[i] = topk_key(sc[i], idv[i]);
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32), l = static_cast<uint32_t>(x[i]);
    if (tid + i * T < n && finite_hi(h)) {
      lo = min(lo, h);
      hi = max(hi, h);
    }
  }
  STAMP(1);
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    wlo[warp] = lo;
    whi[warp] = hi;
  }
  __syncthreads();
  lo = __reduce_min_sync(0xffffffffu, lane < W ? wlo[lane] : 0xFFFFFFFFu);
  hi = __reduce_max_sync(0xffffffffu, lane < W ? whi[lane] : 0u);
  if (lo == hi) {  // the same for every thread: one finite score value, the id range
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const uint32_t l = static_cast<uint32_t>(x[i]);
      if (tid + i * T < n && finite_hi(static_cast<uint32_t>(x[i] >> 32))) {
        ilo = min(ilo, l);
        ihi = max(ihi, l);
      }
    }
    ilo = __reduce_min_sync(0xffffffffu, ilo);
    ihi = __reduce_max_sync(0xffffffffu, ihi);
    if (lane == 0) {
      wilo[warp] = ilo;
      wihi[warp] = ihi;
    }
    __syncthreads();
    ilo = __reduce_min_sync(0xffffffffu, lane < W ? wilo[lane] : 0xFFFFFFFFu);
    ihi = __reduce_max_sync(0xffffffffu, lane < W ? wihi[lane] : 0u);
  }
  STAMP(2);
  const bool one_bucket = n <= KF;
  // One finite score value: the finite keys differ by id only (key low half).
  const bool by_id = lo == hi;
  const float top = key_score(hi);
  const float scale = lo < hi ? static_cast<float>(static_cast<double>(nb - 2) /
                                                   (static_cast<double>(top) - static_cast<double>(key_score(lo))))
                      : ilo < ihi ? static_cast<float>(static_cast<double>(nb - 2) / static_cast<double>(ihi - ilo))
                                  : 0.f;
  int bs[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    int b;
    if (one_bucket || h >= 0xFF800000u) b = 0;
    else if (!finite_hi(h)) b = nb - 1;
    else if (by_id) b = 1 + min(nb - 3, static_cast<int>(static_cast<float>(ihi - static_cast<uint32_t>(x[i])) * scale));
    else b = 1 + min(nb - 3, static_cast<int>((top - key_score(h)) * scale));
    bs[i] = (b << 12) | atomicAdd(&bcnt[b], 1);
    if (STAGE) staged[tid + i * T] = x[i];
  }
  __syncthreads();
  STAMP(3);
  {
    int c[PB], sum = 0;
    if (whole) {
      const int4 v = reinterpret_cast<const int4*>(bcnt)[tid];
      c[0] = v.x, c[1] = v.y, c[2] = v.z, c[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < PB; ++i) c[i] = tid * PB + i < nb ? bcnt[tid * PB + i] : 0;
    }
#pragma unroll
    for (int i = 0; i < PB; ++i) sum += c[i];
    int incl = sum;
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
    int run = (warp > 0 ? before : 0) + incl - sum;
    int4 st4;
    st4.x = run;
    st4.y = st4.x + c[0];
    st4.z = st4.y + c[1];
    st4.w = st4.z + c[2];
    if (whole) {
      reinterpret_cast<int4*>(bstart)[tid] = st4;
    } else {
      const int v[PB] = {st4.x, st4.y, st4.z, st4.w};
#pragma unroll
      for (int i = 0; i < PB; ++i)
        if (tid * PB + i < nb) bstart[tid * PB + i] = v[i];
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
    const int st = bstart[bs[i] >> 12], sz = bcnt[bs[i] >> 12];
    const uint64_t v = STAGE ? staged[tid + i * T] : x[i];
    if (sz == 1) {
      if (st < limit) out[st] = v;
    } else {
      K[st + (bs[i] & 4095)] = v;
      S[st + (bs[i] & 4095)] = pack_seg(st, sz);
      large |= sz > KF;
    }
  }
  large = __syncthreads_or(large);
  STAMP(5);
  if (!large && !BYPOS) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (tid + i * T >= n) continue;
      const int st = bstart[bs[i] >> 12], sz = bcnt[bs[i] >> 12];
      if (sz == 1 || st >= limit) continue;
      const int me = st + (bs[i] & 4095);
      const uint64_t v = K[me];
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
  if (!large) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int j = tid + i * T;
      if (j >= n) continue;
      const uint32_t sg = S[j];
      const int st = seg_start(sg), sz = seg_size(sg);
      if (sz <= 1 || st >= limit) continue;
      const uint64_t v = K[j];
      int r = 0;
      for (int q = st; q < st + sz; ++q) {
        const uint64_t y = K[q];
        r += (y > v) || (y == v && q < j);
      }
      if (st + r < limit) out[st + r] = v;
    }
    __syncthreads();
    STAMP(6);
    return;
  }
  // Slow path: the singletons into K / S too, then the ranges of the large buckets.
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (tid + i * T >= n) continue;
    const int st = bstart[bs[i] >> 12];
    if (bcnt[bs[i] >> 12] == 1) {
      K[st] = STAGE ? staged[tid + i * T] : x[i];
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
}  // namespace bk5
