// The top-K owner sort: a block of kThreads threads sorts a row of up to
// kChunk 64-bit keys (semantics.h, larger = selected first) descending, and
// merges two sorted lists. Used by topk_cuda.cu and measured alone by
// tools/sort_lab/lab.cu (no torch needed).
//   - bucket rank (rank_sort): a chunk of up to 2048 keys gets one pass of
//     kBucketsPerKey buckets per key on the float score between the row's
//     finite min and max (on the id when every finite score is equal;
//     shared-memory histogram whose atomic gives each key its slot, one block
//     scan); a key alone in its bucket is placed, the others are ranked by
//     counting (full 64-bit compare) inside buckets of at most kRankMax keys.
//     A larger bucket (many equal scores, or scores squeezed by an outlier)
//     is split again on the 64-bit key between its min and max, every pass
//     shrinking its range at least (kFinal + 1)-fold, so ties (equal scores,
//     ordered by id) stay bounded too (split_large_buckets);
//   - merge path (merge_path): two sorted lists merge in one pass, each thread
//     finding its diagonal by binary search and writing its outputs.
#pragma once

#include "semantics.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace sdcp {
// Internal linkage, as when the sort lived in topk_cuda.cu: each including
// translation unit compiles its own copy, so the kernels' code does not change.
namespace {

constexpr int kThreads = 1024;  // 512 measured slower for the sort and the merge alike
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 2048;              // keys ranked together
constexpr int kPer = kChunk / kThreads;  // positions per thread in rank_sort
constexpr int kFinal = 32;               // the splitting passes rank a bucket this small by counting
constexpr int kRankMax = 128;            // rank_sort's float pass ranks a bucket this small by counting
constexpr int kMergePer = 4;             // merge_path's outputs per thread, at least: fewer binary searches
                                         // share the shared-memory pipe (2 measured 0.1 us slower)
constexpr int kBucketsPerKey = 2;        // float buckets per key in rank_sort's pass
constexpr int kMaxPasses = 24;           // splitting passes: 64 bits / log2(kFinal + 1), with room

// ---------------------------------------------------------------------------
// Shared memory. rank_sort over n <= kChunk keys uses
//   keys[2][n] u64 (ping-pong), bmin[n], bmax[n] u64 (a bucket's key range,
//   at its first position), seg[2][n] u32 (the bucket of each position:
//   start << 16 | size), cnt[n + 1], pos[n + 1] i32 (histogram / cursor, scan).
// The float pass keeps its kBucketsPerKey * n counts in cnt/pos and starts in
// bmin/bmax (static_asserts below).
// ---------------------------------------------------------------------------

constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// cnt starts 16-byte aligned (rank_sort accesses a thread's counts as one vector).
int64_t rank_sort_bytes(int64_t n) { return align16(4 * n * 8 + 2 * n * 4) + 2 * align16((n + 1) * 4); }
static_assert(kBucketsPerKey * 4 <= 2 * 4, "the float pass's counts fit in cnt and pos");
static_assert(kBucketsPerKey * kChunk <= 4096, "a bucket and a slot pack into 12 bits each");
static_assert(kBucketsPerKey * 4 <= 2 * 8, "the float pass's bucket starts fit in bmin and bmax");

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
  s.cnt = reinterpret_cast<int*>(base + align16(4 * n * 8 + 2 * n * 4));
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
__device__ void block_exclusive_scan(const int* in, int* out, int n) {
  __shared__ int warp_sums[kWarps];
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
    int w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;
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

// Block-wide min and max of a 64-bit value per thread into *lo / *hi, for
// keys whose bucket `st` is the same across the warp (positions of one bucket
// are contiguous, so a large bucket usually fills whole warps): one atomic
// pair per warp instead of one per key (a 64-bit shared atomic min/max is a
// compare-and-swap loop).
__device__ __forceinline__ void bucket_range_atomic(const SortSmem& m, bool active, int st, uint64_t x) {
  const unsigned mask = __ballot_sync(0xffffffffu, active);
  if (mask == 0xffffffffu && __all_sync(0xffffffffu, st == __shfl_sync(0xffffffffu, st, 0))) {
    const uint64_t lo = warp_min(x), hi = warp_max(x);
    if ((threadIdx.x & 31) == 0) {
      atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[st]), static_cast<unsigned long long>(lo));
      atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[st]), static_cast<unsigned long long>(hi));
    }
  } else if (active) {
    atomicMin(reinterpret_cast<unsigned long long*>(&m.bmin[st]), static_cast<unsigned long long>(x));
    atomicMax(reinterpret_cast<unsigned long long*>(&m.bmax[st]), static_cast<unsigned long long>(x));
  }
}

// The rank of key v at position me inside the bucket [st, st + sz) of K:
// the larger keys, plus the equal ones before it.
__device__ __forceinline__ int rank_in_bucket(const uint64_t* K, int st, int sz, uint64_t v, int me) {
  int r = 0;
  for (int q = st; q < st + sz; ++q) {
    const uint64_t y = K[q];
    r += (y > v) || (y == v && q < me);
  }
  return r;
}

// The slow path of rank_sort: buckets above kFinal keys (ties, or scores
// squeezed together by an outlier) are split again on the 64-bit key between
// the bucket's min and max, each pass shrinking a bucket's range at least
// (kFinal + 1)-fold, until every bucket is small or holds equal keys. Expects
// keys[0] and seg[0] to hold every position and bmin/bmax the range of every
// bucket above kFinal. Writes the first `limit` positions of out.
__device__ void split_large_buckets(const SortSmem& m, int n, int limit, uint64_t* out) {
  const int tid = threadIdx.x;
  int cur = 0;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    const uint64_t* K = (cur ? m.keys[1] : m.keys[0]);  // constant indices: m stays out of local memory
    const uint32_t* S = (cur ? m.seg[1] : m.seg[0]);
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
    // 2. Histogram: a splitting bucket [st, st + sz) counts its sz sub-buckets
    //    in cnt[st .. st + sz), larger keys in lower sub-buckets (the map is
    //    monotone in the key, so order-preserving).
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (!split[i]) continue;
      const int st = seg_start(sg[i]), sz = seg_size(sg[i]);
      const uint64_t lo = m.bmin[st];
      const double f = static_cast<double>(x[i] - lo) / (static_cast<double>(m.bmax[st] - lo) + 1.0) * sz;
      idx[i] = st + sz - 1 - min(sz - 1, static_cast<int>(f));
      atomicAdd(&m.cnt[idx[i]], 1);
    }
    __syncthreads();
    for (int j = tid; j < n; j += kThreads) {
      m.bmin[j] = ~uint64_t{0};
      m.bmax[j] = 0;
    }
    block_exclusive_scan(m.cnt, m.pos, n);
    // 3. Scatter into the other buffer; sub-bucket idx starts at pos[idx] and
    //    holds pos[idx + 1] - pos[idx] keys (cnt is the cursor, counting down).
    uint64_t* K2 = (cur ? m.keys[0] : m.keys[1]);
    uint32_t* S2 = (cur ? m.seg[0] : m.seg[1]);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = tid + i * kThreads;
      int dst = j;
      uint32_t s2 = j < n ? sg[i] : 0;
      if (j < n && split[i]) {
        const int st = m.pos[idx[i]];
        dst = st + atomicSub(&m.cnt[idx[i]], 1) - 1;
        s2 = pack_seg(st, m.pos[idx[i] + 1] - st);
      }
      if (j < n) {
        K2[dst] = x[i];
        S2[dst] = s2;
      }
      bucket_range_atomic(m, j < n && seg_size(s2) > kFinal, seg_start(s2), j < n ? x[i] : 0);
    }
    __syncthreads();
    cur ^= 1;
  }
  // 4. Rank inside each bucket. A bucket still larger than kFinal holds equal
  //    keys (or, past kMaxPasses, is counted all the same).
  const uint64_t* K = (cur ? m.keys[1] : m.keys[0]);
  const uint32_t* S = (cur ? m.seg[1] : m.seg[0]);
  for (int j = tid; j < n; j += kThreads) {
    const uint32_t sg = S[j];
    const int st = seg_start(sg), sz = seg_size(sg);
    if (st >= limit) continue;
    const uint64_t x = K[j];
    const int r = (sz > 1 && (sz <= kFinal || m.bmin[st] != m.bmax[st])) ? rank_in_bucket(K, st, sz, x, j) : j - st;
    if (st + r < limit) out[st + r] = x;
  }
}

// Sorts the n <= kChunk keys topk_key(scores[j], ids[j]) descending and
// writes the first min(n, limit) into out[]; ends with a barrier.
// Deterministic: equal keys are bitwise identical, so their order among
// themselves cannot show.
//
// One pass of a bucket rank: kBucketsPerKey buckets per key between the
// row's finite min and max score (+inf first, -inf / NaN / invalid last), or,
// when every finite score is the same, between the min and max id; the slot
// inside a bucket from the histogram atomic, one block scan; then a key alone
// in its bucket is placed, and the others are ranked by counting among the
// <= kRankMax keys of their bucket. Uniform, clustered, tied (80 values) and
// all-equal scores stay on this path. A larger bucket (many equal scores, or
// scores squeezed together by an outlier) sends the whole row through
// split_large_buckets.
//
// The rank by counting goes by position in the bucket order: a warp covers 32
// neighbouring positions, mostly of one bucket, so its probes are broadcasts
// (ranking by input key, every lane probes another bucket: bank conflicts).
// Shared memory: the bucket counts live in cnt/pos and the bucket starts in
// bmin/bmax (both free until the slow path, which reads the bucket starts
// before it overwrites them).
__device__ __forceinline__ void rank_sort(const SortSmem m, const float* scores, const int32_t* ids, int n, int limit,
                                       uint64_t* out) {
  constexpr int kB = kPer * kBucketsPerKey;  // buckets per thread in the scan
  static_assert(kB == 4, "a thread's bucket counts are one 16-byte vector");
  __shared__ uint32_t warp_lo[kWarps], warp_hi[kWarps];
  __shared__ int warp_sum[kWarps];
  int* bcnt = m.cnt;                             // [n * kBucketsPerKey]
  int* bstart = reinterpret_cast<int*>(m.bmin);  // [n * kBucketsPerKey]
  uint64_t* K = m.keys[0];                       // the bucket order
  uint32_t* S = m.seg[0];                        // each position's bucket (size 0: placed)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nb = n * kBucketsPerKey;
  // 1. Load every input first (independent loads in flight together); while
  //    they fly, clear the counts and the positions' sizes. A thread's counts
  //    are accessed as one vector (single words at a 4-word stride are 4-way
  //    bank conflicts).
  float sc[kPer];
  int32_t id[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int j = tid + i * kThreads;
    sc[i] = j < n ? scores[j] : 0.f;
    id[i] = j < n ? ids[j] : -1;
  }
  const bool whole = (tid + 1) * kB <= nb;
  if (whole) {
    reinterpret_cast<int4*>(bcnt)[tid] = make_int4(0, 0, 0, 0);
  } else {
#pragma unroll
    for (int i = 0; i < kB; ++i)
      if (tid * kB + i < nb) bcnt[tid * kB + i] = 0;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (tid + i * kThreads < n) S[tid + i * kThreads] = 0;
  // 2. The finite score range, as key high halves (and the id range, as key
  //    low halves, when that range is one value).
  uint64_t x[kPer];
  uint32_t lo = 0xFFFFFFFFu, hi = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    x[i] = topk_key(sc[i], id[i]);
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    if (tid + i * kThreads < n && finite_hi(h)) {
      lo = min(lo, h);
      hi = max(hi, h);
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    warp_lo[warp] = lo;
    warp_hi[warp] = hi;
  }
  __syncthreads();
  lo = __reduce_min_sync(0xffffffffu, lane < kWarps ? warp_lo[lane] : 0xFFFFFFFFu);
  hi = __reduce_max_sync(0xffffffffu, lane < kWarps ? warp_hi[lane] : 0u);
  const bool by_id = lo == hi;  // the same in every thread
  uint32_t id_lo = 0xFFFFFFFFu, id_hi = 0;
  if (by_id) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (tid + i * kThreads < n && finite_hi(static_cast<uint32_t>(x[i] >> 32))) {
        id_lo = min(id_lo, static_cast<uint32_t>(x[i]));
        id_hi = max(id_hi, static_cast<uint32_t>(x[i]));
      }
    }
    id_lo = __reduce_min_sync(0xffffffffu, id_lo);
    id_hi = __reduce_max_sync(0xffffffffu, id_hi);
    __syncthreads();  // every warp has read warp_lo / warp_hi
    if (lane == 0) {
      warp_lo[warp] = id_lo;
      warp_hi[warp] = id_hi;
    }
    __syncthreads();
    id_lo = __reduce_min_sync(0xffffffffu, lane < kWarps ? warp_lo[lane] : 0xFFFFFFFFu);
    id_hi = __reduce_max_sync(0xffffffffu, lane < kWarps ? warp_hi[lane] : 0u);
  }
  // 3. Histogram. The bucket map is monotone (larger key, lower bucket): fp32
  //    subtraction, conversion and scaling round monotonically, and an
  //    overflow to +inf lands in the last finite bucket. A row of <= kRankMax
  //    keys is one bucket.
  const bool one_bucket = n <= kRankMax;
  const float top = key_score(hi);
  const float scale = lo < hi ? static_cast<float>(static_cast<double>(nb - 2) /
                                                   (static_cast<double>(top) - static_cast<double>(key_score(lo))))
                      : id_lo < id_hi ? static_cast<float>(static_cast<double>(nb - 2) / (id_hi - id_lo))
                                      : 0.f;
  // Each key's bucket and slot, packed (bucket << 12 | slot: both < 4096).
  int bs[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (tid + i * kThreads >= n) continue;
    const uint32_t h = static_cast<uint32_t>(x[i] >> 32);
    const float d = by_id ? static_cast<float>(id_hi - static_cast<uint32_t>(x[i])) : top - key_score(h);
    int b;
    if (one_bucket || h >= 0xFF800000u) b = 0;  // +inf first
    else if (!finite_hi(h)) b = nb - 1;         // -inf, NaN, invalid
    else b = 1 + min(nb - 3, static_cast<int>(d * scale));
    bs[i] = (b << 12) | atomicAdd(&bcnt[b], 1);
  }
  __syncthreads();
  // 4. Exclusive scan of the counts into bstart (thread tid owns buckets tid * kB ..).
  {
    int c[kB];
    if (whole) {
      const int4 v = reinterpret_cast<const int4*>(bcnt)[tid];
      c[0] = v.x, c[1] = v.y, c[2] = v.z, c[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < kB; ++i) c[i] = tid * kB + i < nb ? bcnt[tid * kB + i] : 0;
    }
    const int sum = c[0] + c[1] + c[2] + c[3];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sum[warp] = incl;
    __syncthreads();
    int w = lane < kWarps ? warp_sum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    const int before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);
    int4 st;
    st.x = (warp > 0 ? before : 0) + incl - sum;
    st.y = st.x + c[0];
    st.z = st.y + c[1];
    st.w = st.z + c[2];
    if (whole) {
      reinterpret_cast<int4*>(bstart)[tid] = st;
    } else {
      const int v[kB] = {st.x, st.y, st.z, st.w};
#pragma unroll
      for (int i = 0; i < kB; ++i)
        if (tid * kB + i < nb) bstart[tid * kB + i] = v[i];
    }
  }
  __syncthreads();
  // 5. A key alone in its bucket is placed; the others go to their position
  //    in the bucket order.
  bool large = false;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (tid + i * kThreads >= n) continue;
    const int st = bstart[bs[i] >> 12], sz = bcnt[bs[i] >> 12];
    if (sz == 1) {
      if (st < limit) out[st] = x[i];
    } else {
      K[st + (bs[i] & 4095)] = x[i];
      S[st + (bs[i] & 4095)] = pack_seg(st, sz);
      large |= sz > kRankMax;
    }
  }
  if (!__syncthreads_or(large)) {
    // 6. Rank by position inside buckets of 2 .. kRankMax keys.
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = tid + i * kThreads;
      if (j >= n) continue;
      const uint32_t sg = S[j];
      const int st = seg_start(sg), sz = seg_size(sg);
      if (sz < 2 || st >= limit) continue;
      const uint64_t v = K[j];
      const int r = rank_in_bucket(K, st, sz, v, j);
      if (st + r < limit) out[st + r] = v;
    }
    __syncthreads();
    return;
  }
  // Slow path: the placed keys into keys[0] / seg[0] too, the range of every
  // bucket above kFinal, then the splitting passes.
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (tid + i * kThreads >= n) continue;
    if (bcnt[bs[i] >> 12] == 1) {
      const int st = bstart[bs[i] >> 12];
      K[st] = x[i];
      S[st] = pack_seg(st, 1);
    }
  }
  __syncthreads();  // bstart (in bmin) is read; bmin/bmax become the bucket ranges
  for (int j = tid; j < n; j += kThreads) {
    m.bmin[j] = ~uint64_t{0};
    m.bmax[j] = 0;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int j = tid + i * kThreads;
    const uint32_t sg = j < n ? S[j] : 0;
    bucket_range_atomic(m, j < n && seg_size(sg) > kFinal, seg_start(sg), j < n ? K[j] : 0);
  }
  __syncthreads();
  split_large_buckets(m, n, limit, out);
  __syncthreads();
}

// Merge path: the first nout keys of the merge of a[0..la) and b[0..lb), both
// descending, handed to store(position, key) (a wins ties). Each thread finds
// its diagonal by binary search and stores its run of outputs. The caller
// synchronises after. By default the whole block merges; the top-K merge
// tree gives each of its merges a group of `group` threads (lane < group).
template <typename Store>
__device__ __forceinline__ void merge_path(const uint64_t* a, int la, const uint64_t* b, int lb, int nout,
                                           Store store, int lane = static_cast<int>(threadIdx.x),
                                           int group = kThreads) {
  const int per = max(kMergePer, (nout + group - 1) / group);
  const int q = lane * per;
  if (q >= nout) return;
  int lo = max(0, q - lb), hi = min(q, la);
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] >= b[q - 1 - mid]) lo = mid + 1; else hi = mid;
  }
  int i = lo, j = q - lo;
  const int cnt = min(per, nout - q);
  for (int x = 0; x < cnt; ++x) {
    const bool take_a = j >= lb || (i < la && a[i] >= b[j]);
    store(q + x, take_a ? a[i++] : b[j++]);
  }
}

// The merged keys into out[0..nout).
__device__ void merge_two(const uint64_t* a, int la, const uint64_t* b, int lb, uint64_t* out, int nout) {
  merge_path(a, la, b, lb, nout, [out](int pos, uint64_t key) { out[pos] = key; });
}

}  // namespace
}  // namespace sdcp
