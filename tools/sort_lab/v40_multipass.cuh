// The top-K owner sort as shipped in version 4.0 (commit dc63f22), kept for
// tools/sort_lab/lab.cu: phase stamps (STAMP) added, the block scan templated.
#pragma once
#include "common.cuh"
namespace cur {
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 2 * kThreads;     // keys ranked together, 2 per thread
constexpr int kPer = kChunk / kThreads;  // positions per thread in rank_sort
constexpr int kFinal = 32;               // a bucket this small is ranked by counting
constexpr int kMaxPasses = 24;           // 64 bits / log2(kFinal + 1) + the float pass, with room

// ---------------------------------------------------------------------------
// Shared memory. rank_sort over n <= kChunk keys uses
//   keys[2][n] u64 (ping-pong), bmin[n], bmax[n] u64 (a bucket's key range,
//   at its first position), seg[2][n] u32 (the bucket of each position:
//   start << 16 | size), cnt[n + 1], pos[n + 1] i32 (histogram / cursor, scan).
// A selection adds acc and tmp (the merged best keys so far), a chunk's
// sorted output when there is more than one chunk, and the peer merge a
// staging list for one peer's keys.
// ---------------------------------------------------------------------------

__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

__host__ __device__ constexpr int64_t rank_sort_bytes(int64_t n) { return 4 * n * 8 + 2 * n * 4 + 2 * align16((n + 1) * 4); }

// Byte offsets into dynamic shared memory (host and device agree).
struct SmemPlan {
  int acc = 0, tmp = 0, chunk_out = 0, stage = 0, sort = 0;
  int sort_n = 0;  // rank_sort capacity (keys)
  int64_t total = 0;
};

// m candidates per row, the best `keep` are kept (acc and tmp hold `acc_keys`),
// `stage_keys` for one peer's list (0 in topk_select).
SmemPlan plan_smem(int64_t m, int64_t keep, int64_t acc_keys, int64_t stage_keys) {
  SmemPlan p;
  const int64_t chunks = (m + kChunk - 1) / kChunk;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += align16(bytes);
    return static_cast<int>(at);
  };
  p.acc = take(acc_keys * 8);
  p.tmp = take(acc_keys * 8);
  p.chunk_out = take(chunks > 1 ? std::min<int64_t>(kChunk, keep) * 8 : 0);
  p.stage = take(stage_keys * 8);
  p.sort_n = static_cast<int>(std::min<int64_t>(m, kChunk));
  p.sort = take(rank_sort_bytes(p.sort_n));
  p.total = off;
  return p;
}

struct SortSmem {
  uint64_t* keys[2];
  uint64_t* bmin;
  uint64_t* bmax;
  uint32_t* seg[2];
  int* cnt;
  int* pos;
};

__device__ __forceinline__ SortSmem sort_smem(uint8_t* base, int n) {
  SortSmem s;
  auto* k = reinterpret_cast<uint64_t*>(base);
  s.keys[0] = k;
  s.keys[1] = k + n;
  s.bmin = k + 2 * n;
  s.bmax = k + 3 * n;
  auto* g = reinterpret_cast<uint32_t*>(k + 4 * n);
  s.seg[0] = g;
  s.seg[1] = g + n;
  s.cnt = reinterpret_cast<int*>(base + 4 * n * 8 + 2 * n * 4);
  s.pos = reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(s.cnt) + align16((n + 1) * 4));
  return s;
}

__device__ __forceinline__ uint32_t pack_seg(int start, int size) {
  return (static_cast<uint32_t>(start) << 16) | static_cast<uint32_t>(size);
}
__device__ __forceinline__ int seg_start(uint32_t s) { return static_cast<int>(s >> 16); }
__device__ __forceinline__ int seg_size(uint32_t s) { return static_cast<int>(s & 0xFFFFu); }

// The score of a key's high half (finite scores only: 0x00800000 <= hi < 0xFF800000).
__device__ __forceinline__ float key_score(uint32_t hi) {
  return __uint_as_float((hi & 0x80000000u) ? (hi & 0x7FFFFFFFu) : ~hi);
}
__device__ __forceinline__ bool finite_hi(uint32_t hi) { return hi >= 0x00800000u && hi < 0xFF800000u; }

// Exclusive scan of in[0..n) into out[0..n], out[n] = the total. Ends with a barrier.
template <int T = kThreads>
__device__ void block_exclusive_scan_t(const int* in, int* out, int n) {
  constexpr int kThreads = T;
  __shared__ int warp_sums[T / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = (n + kThreads - 1) / kThreads;
  const int b = min(n, static_cast<int>(threadIdx.x) * per), e = min(n, b + per);
  int s = 0;
  for (int i = b; i < e; ++i) s += in[i];
  int x = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < T / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < T / 32) warp_sums[lane] = w;
  }
  __syncthreads();
  int run = x - s + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = b; i < e; ++i) {
    out[i] = run;
    run += in[i];
  }
  if (threadIdx.x == kThreads - 1) out[n] = run;
  __syncthreads();
}

__device__ __forceinline__ uint64_t kmin(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t kmax(uint64_t a, uint64_t b) { return a > b ? a : b; }

__device__ __forceinline__ uint64_t warp_min(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = kmin(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = kmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sorts the n <= kChunk keys key_at(0..n) descending and writes the first
// min(n, limit) into out[]. Deterministic: equal keys are bitwise identical,
// so their order among themselves cannot show.
template <typename KeyAt>
__device__ void rank_sort(const SortSmem& m, KeyAt key_at, int n, int limit, uint64_t* out) {
  __shared__ uint32_t fin_min, fin_max;  // finite score range, as key high halves
  const int tid = threadIdx.x;
  if (tid == 0) {
    fin_min = 0xFFFFFFFFu;
    fin_max = 0;
    m.bmin[0] = ~uint64_t{0};
    m.bmax[0] = 0;
  }
  __syncthreads();
  {
    uint64_t lo = ~uint64_t{0}, hi = 0;
    uint32_t flo = 0xFFFFFFFFu, fhi = 0;
    for (int j = tid; j < n; j += kThreads) {
      const uint64_t x = key_at(j);
      m.keys[0][j] = x;
      m.seg[0][j] = pack_seg(0, n);
      lo = kmin(lo, x);
      hi = kmax(hi, x);
      const uint32_t h = static_cast<uint32_t>(x >> 32);
      if (finite_hi(h)) {
        flo = flo < h ? flo : h;
        fhi = fhi > h ? fhi : h;
      }
    }
    lo = warp_min(lo);
    hi = warp_max(hi);
    flo = static_cast<uint32_t>(warp_min(flo));
    fhi = static_cast<uint32_t>(warp_max(fhi));
    if ((tid & 31) == 0) {
      atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[0]), static_cast<unsigned long long>(lo));
      atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[0]), static_cast<unsigned long long>(hi));
      atomicMin(&fin_min, flo);
      atomicMax(&fin_max, fhi);
    }
  }
  __syncthreads();
  const double fmax = fin_min <= fin_max ? static_cast<double>(key_score(fin_max)) : 0.0;
  const double fmin = fin_min <= fin_max ? static_cast<double>(key_score(fin_min)) : 0.0;
  STAMP(1);
  int cur = 0;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    const uint64_t* K = m.keys[cur];
    const uint32_t* S = m.seg[cur];
    uint64_t x[kPer];
    uint32_t sg[kPer];
    int idx[kPer];
    bool split[kPer];
    bool any = false;
    // 1. Which buckets split: larger than kFinal, not all equal, and needed.
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = tid + i * kThreads;
      split[i] = false;
      if (j < n) {
        x[i] = K[j];
        sg[i] = S[j];
        const int st = seg_start(sg[i]);
        split[i] = seg_size(sg[i]) > kFinal && st < limit && m.bmin[st] != m.bmax[st];
        m.cnt[j] = split[i] ? 0 : 1;  // a final position keeps its place in the scan
        any |= split[i];
      }
    }
    if (!__syncthreads_or(any)) break;
    if (pass == 0) STAMP(2);
    // 2. Histogram: a splitting bucket [st, st + sz) counts its sz sub-buckets
    //    in cnt[st .. st + sz), larger keys in lower sub-buckets.
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (!split[i]) continue;
      const int st = seg_start(sg[i]), sz = seg_size(sg[i]);
      int b;
      if (pass == 0) {  // on the float score: uniform and clustered scores spread alike
        const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
        if (h >= 0xFF800000u) {
          b = 0;  // +inf
        } else if (!finite_hi(h)) {
          b = sz - 1;  // -inf, NaN, invalid
        } else if (fmax == fmin) {
          b = 1;
        } else {
          const double f = (fmax - static_cast<double>(key_score(h))) / (fmax - fmin) * (sz - 2);
          b = 1 + min(sz - 3, static_cast<int>(f));
        }
      } else {  // on the 64-bit key inside the bucket's range (monotone, so order-preserving)
        const uint64_t lo = m.bmin[st];
        const double f = static_cast<double>(x[i] - lo) / (static_cast<double>(m.bmax[st] - lo) + 1.0) * sz;
        b = sz - 1 - min(sz - 1, static_cast<int>(f));
      }
      idx[i] = st + b;
      atomicAdd(&m.cnt[idx[i]], 1);
    }
    __syncthreads();
    for (int j = tid; j < n; j += kThreads) {
      m.bmin[j] = ~uint64_t{0};
      m.bmax[j] = 0;
    }
    if (pass == 0) STAMP(3);
    block_exclusive_scan_t<>(m.cnt, m.pos, n);
    if (pass == 0) STAMP(4);
    // 3. Scatter into the other buffer; sub-bucket idx starts at pos[idx] and
    //    holds pos[idx + 1] - pos[idx] keys (cnt is the cursor, counting down).
    uint64_t* K2 = m.keys[cur ^ 1];
    uint32_t* S2 = m.seg[cur ^ 1];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = tid + i * kThreads;
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
    if (pass == 0) STAMP(5);
    cur ^= 1;
  }
  STAMP(6);
  // 4. Rank inside each bucket: the keys of the bucket above mine, plus the
  //    equal ones before me. A bucket still larger than kFinal holds equal
  //    keys (or, past kMaxPasses, is counted all the same).
  const uint64_t* K = m.keys[cur];
  const uint32_t* S = m.seg[cur];
  for (int j = tid; j < n; j += kThreads) {
    const uint32_t sg = S[j];
    const int st = seg_start(sg), sz = seg_size(sg);
    if (st >= limit) continue;
    const uint64_t x = K[j];
    int r = j - st;
    if (sz > 1 && (sz <= kFinal || m.bmin[st] != m.bmax[st])) {
      r = 0;
      for (int q = st; q < st + sz; ++q) {
        const uint64_t y = K[q];
        r += (y > x) || (y == x && q < j);
      }
    }
    if (st + r < limit) out[st + r] = x;
  }
  __syncthreads();
}

}  // namespace cur
