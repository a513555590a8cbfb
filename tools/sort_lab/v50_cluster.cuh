// Version 5.0: one row over a thread-block cluster of CL CTAs (CL SMs), the
// one-pass bucket rank of v42 (counting limit KF) spread through distributed
// shared memory.
// CTA r holds the keys [r * S, (r + 1) * S) of the row (S = kN / CL) and owns
// the buckets [r * NB * S, (r + 1) * NB * S) and the bucket-ordered positions
// [r * S, (r + 1) * S):
//   1. load, the CTA's finite range, cluster barrier, every CTA's range;
//   2. histogram: a remote shared-memory atomic on the bucket's owner gives
//      each key its slot; cluster barrier;
//   3. each owner scans its buckets (count and local start packed in one
//      word) and sends its total to every CTA; cluster barrier;
//   4. a key alone in its bucket is placed, the others are stored at their
//      position on its owner; cluster barrier; ranked by counting among the
//      <= KF keys of their bucket (remote loads where a bucket straddles CTAs);
//   5. a cluster barrier before exit (no CTA leaves while a peer reads it).
// A bucket above KF keys (ties): CTA 0 sorts the whole row with v42 (the
// others leave after step 3).
#pragma once
#include <cooperative_groups.h>

#include "v42_one_pass.cuh"

namespace clu {
namespace cg = cooperative_groups;
using cur::finite_hi;
using cur::key_score;
constexpr int kN = 2048;

template <typename T>
__device__ __forceinline__ T* remote(T* p, int rank) {
  return cg::this_cluster().map_shared_rank(p, rank);
}

// Sorts the row and writes out[pos] = id of the pos-th key (pos < n).
template <int CL, int T, int NB, int KF>
__device__ void cluster_sort(const float* scores, const int* ids, int n, int* out, uint8_t* dyn) {
  constexpr int S = kN / CL, P = (S + T - 1) / T, NBC = NB * S, PB = (NBC + T - 1) / T, W = T / 32;
  static_assert(NBC <= 4096 && kN <= 4096, "bucket start and count pack into 12 bits each");
  __shared__ int hist[NBC];
  __shared__ uint32_t startcnt[NBC];  // local start << 12 | count
  __shared__ uint64_t K[S];           // positions r * S .. of the bucket order
  __shared__ uint32_t range[2];
  __shared__ int totals[CL];          // every CTA's key count | large << 30
  __shared__ uint32_t wlo[W], whi[W];
  __shared__ int wsum[W];
  cg::cluster_group cluster = cg::this_cluster();
  const int r = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // 1. Load (every load first), zero the own histogram.
  float sc[P];
  int idv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int l = tid + i * T, j = r * S + l;
    const bool in = l < S && j < n;
    sc[i] = in ? scores[j] : 0.f;
    idv[i] = in ? ids[j] : -1;
  }
#pragma unroll
  for (int i = 0; i < PB; ++i)
    if (tid * PB + i < NBC) hist[tid * PB + i] = 0;
  uint64_t x[P];
  uint32_t lo = 0xFFFFFFFFu, hi = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    x[i] = topk_key(sc[i], idv[i]);
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    const int l = tid + i * T;
    if (l < S && r * S + l < n && finite_hi(h)) {
      lo = min(lo, h);
      hi = max(hi, h);
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    wlo[warp] = lo;
    whi[warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = __reduce_min_sync(0xffffffffu, lane < W ? wlo[lane] : 0xFFFFFFFFu);
    hi = __reduce_max_sync(0xffffffffu, lane < W ? whi[lane] : 0u);
    if (lane == 0) {
      range[0] = lo;
      range[1] = hi;
    }
  }
  STAMP(1);
  cluster.sync();  // ranges visible, histograms zeroed
  STAMP(2);
  lo = __reduce_min_sync(0xffffffffu, lane < CL ? remote(range, lane)[0] : 0xFFFFFFFFu);
  hi = __reduce_max_sync(0xffffffffu, lane < CL ? remote(range, lane)[1] : 0u);
  // 2. Histogram on the owners.
  const int nb = n * NB;
  const bool one_bucket = n <= KF;
  const float top = key_score(hi);
  const float scale = lo < hi ? static_cast<float>(static_cast<double>(nb - 2) /
                                                   (static_cast<double>(top) - static_cast<double>(key_score(lo))))
                              : 0.f;
  int bs[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int l = tid + i * T;
    if (l >= S || r * S + l >= n) continue;
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    int b;
    if (one_bucket || h >= 0xFF800000u) b = 0;
    else if (!finite_hi(h)) b = nb - 1;
    else b = 1 + min(nb - 3, static_cast<int>((top - key_score(h)) * scale));
    const int owner = b / NBC;
    bs[i] = (b << 12) | atomicAdd(remote(&hist[b - owner * NBC], owner), 1);
  }
  cluster.sync();  // histograms complete
  STAMP(3);
  // 3. Scan the own buckets.
  {
    int c[PB], sum = 0;
    bool large = false;
#pragma unroll
    for (int i = 0; i < PB; ++i) {
      c[i] = tid * PB + i < NBC ? hist[tid * PB + i] : 0;
      sum += c[i];
      large |= c[i] > KF;
    }
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) wsum[warp] = incl;
    large = __syncthreads_or(large);
    int w = lane < W ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    const int before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    const int total = __shfl_sync(0xffffffffu, w, W - 1);
    int run = (warp > 0 ? before : 0) + incl - sum;
#pragma unroll
    for (int i = 0; i < PB; ++i) {
      if (tid * PB + i < NBC) startcnt[tid * PB + i] = (static_cast<uint32_t>(run) << 12) | c[i];
      run += c[i];
    }
    if (tid < CL) remote(totals, tid)[r] = total | (large ? 1 << 30 : 0);
  }
  cluster.sync();  // starts and totals complete
  STAMP(4);
  bool large = false;
#pragma unroll
  for (int q = 0; q < CL; ++q) large |= (totals[q] >> 30) != 0;
  if (large) {  // ties: CTA 0 sorts the row alone
    if (r == 0) {
      const cur::SortSmem m = cur::sort_smem(dyn, kN);
      uint64_t* res = reinterpret_cast<uint64_t*>(dyn + cur::rank_sort_bytes(kN));
      bk2::rank_sort<T, NB, KF>(m, [&](int j) { return scores[j]; }, [&](int j) { return ids[j]; }, n, n, res);
      for (int j = tid; j < n; j += T) out[j] = topk_key_id(res[j]);
    }
    return;
  }
  // 4. Place the singletons, store the others at their position.
  int st[P], sz[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int l = tid + i * T;
    sz[i] = 0;
    if (l >= S || r * S + l >= n) continue;
    const int b = bs[i] >> 12, owner = b / NBC;
    const uint32_t sc2 = *remote(&startcnt[b - owner * NBC], owner);
    int base = 0;
#pragma unroll
    for (int q = 0; q < CL; ++q) base += q < owner ? totals[q] : 0;
    st[i] = base + static_cast<int>(sc2 >> 12);
    sz[i] = static_cast<int>(sc2 & 4095u);
    if (sz[i] == 1) {
      out[st[i]] = topk_key_id(x[i]);
    } else {
      const int p = st[i] + (bs[i] & 4095);
      *remote(&K[p % S], p / S) = x[i];
    }
  }
  cluster.sync();  // bucket contents complete
  STAMP(5);
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (sz[i] <= 1) continue;
    const uint64_t v = x[i];
    const int me = st[i] + (bs[i] & 4095);
    int rk = 0;
    for (int q = st[i]; q < st[i] + sz[i]; ++q) {
      const uint64_t y = *remote(&K[q % S], q / S);
      rk += (y > v) || (y == v && q < me);
    }
    out[st[i] + rk] = topk_key_id(v);
  }
  cluster.sync();  // no CTA leaves while a peer reads its keys
  STAMP(6);
}
}  // namespace clu
