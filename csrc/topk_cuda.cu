// Top-K boundary, CUDA. Candidates become 64-bit keys (semantics.h, larger =
// selected first), so a selection is a descending sort and the ids come out in
// selection order. One block of 1024 threads per row:
//   - bucket rank (rank_sort): a chunk of up to 2048 keys gets one pass of
//     kBucketsPerKey buckets per key on the float score between the row's
//     finite min and max (on the id when every finite score is equal;
//     shared-memory histogram whose atomic gives each key its slot, one block
//     scan); a key alone in its bucket is placed, the others are ranked by
//     counting (full 64-bit compare) inside buckets of at most kRankMax keys.
//     A larger bucket (many equal scores, or scores squeezed by an outlier)
//     is split again on the 64-bit key between its min and max, every pass
//     shrinking its range at least (kFinal + 1)-fold, so ties (equal scores,
//     ordered by id) stay bounded too;
//   - merge path (merge_path): two sorted lists merge in one pass, each thread
//     finding its diagonal by binary search and writing its outputs.
// topk_select sorts chunks of 2048 candidates and merges them one at a time.
// The peer merge (protocol version 4, data-as-flag): each owner sorts its row,
// pushes its best min(C, k) keys into every peer's buffer with plain stores,
// then merges each peer's list as it lands in its own buffer, writing the
// sentinel back (kTopKSentinel: no key takes it).

#include "lamport.cuh"
#include "semantics.h"
#include "topk.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <atomic>

namespace sdcp {
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
constexpr int64_t kMaxSortKeys = 16384;  // candidates per row of topk_select

// ---------------------------------------------------------------------------
// Shared memory. rank_sort over n <= kChunk keys uses
//   keys[2][n] u64 (ping-pong), bmin[n], bmax[n] u64 (a bucket's key range,
//   at its first position), seg[2][n] u32 (the bucket of each position:
//   start << 16 | size), cnt[n + 1], pos[n + 1] i32 (histogram / cursor, scan).
// The float pass keeps its kBucketsPerKey * n counts in cnt/pos and starts in
// bmin/bmax (static_asserts below).
// A selection adds acc and tmp (the merged best keys so far), a chunk's
// sorted output when there is more than one chunk, and the peer merge a
// staging list for one peer's keys.
// ---------------------------------------------------------------------------

constexpr int64_t align16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// cnt starts 16-byte aligned (rank_sort accesses a thread's counts as one vector).
int64_t rank_sort_bytes(int64_t n) { return align16(4 * n * 8 + 2 * n * 4) + 2 * align16((n + 1) * 4); }
static_assert(kBucketsPerKey * 4 <= 2 * 4, "the float pass's counts fit in cnt and pos");
static_assert(kBucketsPerKey * kChunk <= 4096, "a bucket and a slot pack into 12 bits each");
static_assert(kBucketsPerKey * 4 <= 2 * 8, "the float pass's bucket starts fit in bmin and bmax");

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
// synchronises after.
template <typename Store>
__device__ __forceinline__ void merge_path(const uint64_t* a, int la, const uint64_t* b, int lb, int nout,
                                           Store store) {
  const int per = max(kMergePer, (nout + kThreads - 1) / kThreads);
  const int q = static_cast<int>(threadIdx.x) * per;
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

// The best min(m, keep) keys of (scores[j], ids[j]), j < m, in order, sorted by chunks of
// kChunk that are merged one at a time. Returns where they are (acc or tmp);
// with ids_out, a last merge (m > kChunk) writes their ids there instead and
// nullptr is returned.
__device__ uint64_t* block_select(uint8_t* smem, const SmemPlan& p, const float* scores, const int32_t* ids, int m,
                                  int keep, int32_t* ids_out = nullptr) {
  uint64_t* acc = reinterpret_cast<uint64_t*>(smem + p.acc);
  uint64_t* tmp = reinterpret_cast<uint64_t*>(smem + p.tmp);
  const SortSmem s = sort_smem(smem + p.sort, p.sort_n);
  const int first = min(m, kChunk);
  rank_sort(s, scores, ids, first, keep, acc);
  int len = min(first, keep);
  for (int base = kChunk; base < m; base += kChunk) {
    uint64_t* chunk = reinterpret_cast<uint64_t*>(smem + p.chunk_out);
    const int c = min(kChunk, m - base);
    rank_sort(s, scores + base, ids + base, c, keep, chunk);
    const int nout = min(len + min(c, keep), keep);
    if (ids_out != nullptr && base + kChunk >= m) {
      merge_path(acc, len, chunk, min(c, keep), nout,
                 [ids_out](int pos, uint64_t key) { ids_out[pos] = topk_key_id(key); });
      return nullptr;
    }
    merge_two(acc, len, chunk, min(c, keep), tmp, nout);
    __syncthreads();
    uint64_t* t = acc;
    acc = tmp;
    tmp = t;
    len = nout;
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads, 1) topk_select_kernel(SmemPlan p, const float* scores, const int32_t* ids,
                                                               int64_t s0, int64_t i0, int m, int k, int32_t* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t t = blockIdx.x;
  int32_t* o = out + t * k;
  const int take = min(m, k);
  if (m > 0) {
    const uint64_t* best = block_select(smem, p, scores + t * s0, ids + t * i0, m, k, o);
    if (best != nullptr)
      for (int pos = threadIdx.x; pos < take; pos += kThreads) o[pos] = topk_key_id(best[pos]);
  }
  for (int pos = take + threadIdx.x; pos < k; pos += kThreads) o[pos] = -1;
}

// ---------------------------------------------------------------------------
// Peer merge, data-as-flag.
// ---------------------------------------------------------------------------

__device__ __forceinline__ ulonglong2 ld_volatile_keys(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

// Polls two keys of a local buffer until neither is the sentinel. Each 64-bit
// element of the vector is single-copy atomic, so a landed key is whole.
__device__ __forceinline__ ulonglong2 poll_keys(const DeviceWorkspace& ws, const ulonglong2* p, int src,
                                                uint64_t call) {
  return poll_until(
      ws, [p] { return ld_volatile_keys(p); },
      [](const ulonglong2& v) { return v.x != kTopKSentinel && v.y != kTopKSentinel; }, src, call, kWaitData);
}

__device__ __forceinline__ uint64_t poll_key(const DeviceWorkspace& ws, const uint64_t* p, int src, uint64_t call) {
  return poll_until(
      ws, [p] { return ld_volatile_u64(p); }, [](uint64_t v) { return v != kTopKSentinel; }, src, call, kWaitData);
}

// Where rank `d` keeps peer `src`'s call header in the buffer of `call`.
__device__ __forceinline__ uint4* topk_header(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call, int d,
                                              int src) {
  return reinterpret_cast<uint4*>(ws.buffer(d, call) + header_offset) + ws.peer_slot(src, d);
}

// This rank's call header into every peer's buffer (before the keys). Out of
// line: one thread runs it, and inlined it costs the owner sort registers.
static __device__ __noinline__ void store_headers(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call,
                                                  CallHeader mine) {
  for (int step = 1; step < ws.world; ++step) {
    const int d = ws.rank + step < ws.world ? ws.rank + step : ws.rank + step - ws.world;
    store_call_header(topk_header(ws, header_offset, call, d, ws.rank), mine);
  }
}

// Every peer's call header of this call: polled, re-filled, compared (a
// mismatch or a wait that gives up is recorded and aborts the workspace on
// every rank). Out of line, for the same reason.
static __device__ __noinline__ void check_headers(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call,
                                                  CallHeader mine) {
  for (int step = 1; step < ws.world; ++step) {
    const int src = ws.rank + step < ws.world ? ws.rank + step : ws.rank + step - ws.world;
    check_call_header(ws, topk_header(ws, header_offset, call, ws.rank, src), mine, src, call);
  }
}

// Grid: one block per row, at most one per SM (block b handles rows b, b +
// gridDim.x, ...). For each row: sort the own candidates, push the best kk
// keys into every peer's buffer (16-byte stores when kk is even), then merge
// each peer's list (polled from the local buffer, the sentinel written back
// at once) into the result, nearest peer first. A block waits only for the
// same rows of its peers, which every block pushes before it waits, so the
// grid need not be co-resident.
//
// Call headers (lamport.cuh): thread 0 of block 0 stores this rank's header
// into every peer's buffer as soon as it knows the call (after its first
// sort, before the keys), and checks every peer's header once its first row's
// keys are merged: both ranks have that row (a call without rows runs
// topk_headers_kernel instead), so the check is reached whatever the peer's
// row count, and a mismatch aborts the blocks that wait for rows the peer
// does not have. Checked outside the poll loop, the header costs the sort and
// the merge no registers. One thread stores and checks, so that its fence
// before an abort word (lamport_record) also orders its headers: a peer that
// meets the abort still finds this rank's header and names both sides.
// The workspace is a grid constant: the failure paths take its address, which
// would otherwise make every thread copy it into local memory at entry.
__global__ void __launch_bounds__(kThreads, 1)
    topk_merge_kernel(const __grid_constant__ DeviceWorkspace ws, TopKGeometry g, SmemPlan p, const float* scores,
                      const int32_t* ids, int64_t s0, int64_t i0, int rows, int c, int k, int32_t* out,
                      const __grid_constant__ CallHeader hdr) {
  extern __shared__ __align__(16) uint8_t smem[];
  // The inputs are the previous kernel's outputs: wait for it (programmatic
  // launch) before loading them, and read the call index only once the first
  // row is sorted, so the counter load overlaps the sort's input loads.
  pdl_wait_and_release();
  uint64_t call = 0;
  bool have_call = false;
  const int n = ws.world, me = ws.rank;
  const int kk = static_cast<int>(g.keys_per_row);  // min(c, k)
  auto inbox = [&](int d, int src, int t) {
    return reinterpret_cast<uint64_t*>(ws.buffer(d, call) + g.inbox_offset) +
           (static_cast<int64_t>(ws.peer_slot(src, d)) * g.max_rows + t) * kk;
  };
  const bool header_thread = blockIdx.x == 0 && threadIdx.x == 0;
  uint64_t* stage = reinterpret_cast<uint64_t*>(smem + p.stage);
  for (int t = blockIdx.x; t < rows; t += gridDim.x) {
    const bool checks_header = header_thread && t == 0;  // block 0's first row
    // 1. Owner: the best kk keys of the row, in order.
    uint64_t* acc = block_select(smem, p, scores + t * s0, ids + t * i0, c, kk);
    if (!have_call) {
      call = block_call_index(ws);
      have_call = true;
      if (header_thread) store_headers(ws, g.header_offset, call, hdr);  // before the keys
    }
    uint64_t* tmp = reinterpret_cast<uint64_t*>(smem + (acc == reinterpret_cast<uint64_t*>(smem + p.acc) ? p.tmp : p.acc));
    // 2. Push them into every peer's buffer (plain stores: the keys are their own flag).
    if (kk % 2 == 0) {
      const int vec = kk / 2;
      for (int x = threadIdx.x; x < (n - 1) * vec; x += kThreads) {
        const int d = (me + 1 + x / vec) % n, v = x % vec;
        reinterpret_cast<ulonglong2*>(inbox(d, me, t))[v] = reinterpret_cast<const ulonglong2*>(acc)[v];
      }
    } else {
      for (int x = threadIdx.x; x < (n - 1) * kk; x += kThreads) {
        const int d = (me + 1 + x / kk) % n;
        inbox(d, me, t)[x % kk] = acc[x % kk];
      }
    }
    // 3. Consumer: merge each peer's list as it lands; the last merge writes the ids.
    int32_t* o = out + static_cast<int64_t>(t) * k;
    int len = kk;
    for (int step = 1; step < n; ++step) {
      const int src = (me + step) % n;
      uint64_t* in = inbox(me, src, t);
      if (kk % 2 == 0) {
        for (int v = threadIdx.x; v < kk / 2; v += kThreads) {
          ulonglong2* q = reinterpret_cast<ulonglong2*>(in) + v;
          reinterpret_cast<ulonglong2*>(stage)[v] = poll_keys(ws, q, src, call);
          *q = make_ulonglong2(kTopKSentinel, kTopKSentinel);
        }
      } else {
        for (int i = threadIdx.x; i < kk; i += kThreads) {
          stage[i] = poll_key(ws, in + i, src, call);
          in[i] = kTopKSentinel;
        }
      }
      __syncthreads();
      const int nout = min(k, len + kk);
      if (step == n - 1) {
        // The last list: the merge writes the ids (nout = k, as k <= N * kk:
        // every position holds a key, invalid ones are 0: id -1).
        merge_path(acc, len, stage, kk, nout, [o](int pos, uint64_t key) { o[pos] = topk_key_id(key); });
      } else {
        merge_two(acc, len, stage, kk, tmp, nout);
        __syncthreads();
        uint64_t* x = acc;
        acc = tmp;
        tmp = x;
        len = nout;
      }
    }
    if (checks_header) check_headers(ws, g.header_offset, call, hdr);
    if (n == 1) {
      for (int pos = threadIdx.x; pos < k; pos += kThreads) o[pos] = topk_key_id(acc[pos]);
    }
    __syncthreads();  // the next row reuses the shared memory
  }
  if (!have_call) call = block_call_index(ws);
  block_finish_call(ws, call);
}

// A call without rows: the call headers alone (stored, then each peer's
// checked), so that the call still waits for every peer's call of the same
// index and a peer with rows sees the difference.
__global__ void __launch_bounds__(32)
    topk_headers_kernel(const __grid_constant__ DeviceWorkspace ws, int64_t header_offset, CallHeader hdr) {
  const uint64_t call = block_call_index(ws);
  if (threadIdx.x == 0) {
    store_headers(ws, header_offset, call, hdr);
    check_headers(ws, header_offset, call, hdr);
  }
  block_finish_call(ws, call);
}

int64_t max_smem_optin(int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return value;
}

// Checks that `bytes` of dynamic shared memory fit next to the kernel's static
// shared memory, and opts the kernel in (the attribute call is made only when
// a larger size is first needed on the device).
void set_smem(const void* kernel, int64_t bytes, std::array<std::atomic<int64_t>, 64>& current, int device,
              const char* arg, const char* what) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const int64_t limit = max_smem_optin(device) - static_cast<int64_t>(attr.sharedSizeBytes);
  SDCP_CHECK_ARG(bytes <= limit, arg, "a row that fits in shared memory (" << limit << " bytes of dynamic shared "
                 "memory on this device)", bytes << " bytes for " << what);
  auto& cur = current[device & 63];
  if (bytes > cur.load()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    cur.store(bytes);
  }
}

void select_cuda(const at::Tensor& scores, const at::Tensor& ids, int64_t k, at::Tensor& out) {
  const int64_t rows = scores.size(0), m = scores.size(1);
  SDCP_CHECK_ARG(m <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per row on CUDA", m);
  SDCP_CHECK_ARG(k <= INT32_MAX / 2, "k", "at most " << INT32_MAX / 2 << " on CUDA", k);
  SDCP_CHECK_ARG(rows <= INT32_MAX, "scores", "at most " << INT32_MAX << " rows on CUDA", rows);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t keep = std::min(m, k);
  const SmemPlan p = plan_smem(m, keep, keep, 0);
  static std::array<std::atomic<int64_t>, 64> current{};
  set_smem(reinterpret_cast<const void*>(topk_select_kernel), p.total, current, scores.get_device(), "scores",
           cat(m, " candidates and k = ", k).c_str());
  // One block per row.
  topk_select_kernel<<<static_cast<unsigned>(rows), kThreads, p.total, at::cuda::getCurrentCUDAStream().stream()>>>(
      p, scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0), static_cast<int>(m),
      static_cast<int>(k), out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int sm_count(int device) {
  static int sms[64] = {0};
  int& v = sms[device & 63];
  if (v == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
  return v;
}

void merge_cuda(const TopKMergeCall& c, const at::Tensor& scores, const at::Tensor& ids) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  if (c.rows == 0) {
    const c10::cuda::CUDAGuard guard(scores.device());
    launch_lamport(topk_headers_kernel, 1, 32, 0, at::cuda::getCurrentCUDAStream().stream(), scores.get_device(),
                   device_workspace(ws), c.geo.header_offset, c.header);
    return;
  }
  const int64_t cand = c.geo.candidates_per_rank, kk = c.geo.keys_per_row, k = c.geo.k;
  SDCP_CHECK_ARG(cand <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per rank on CUDA", cand);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int device = scores.get_device();
  // acc and tmp hold up to k keys (the merged result), stage one peer's kk.
  const SmemPlan p = plan_smem(cand, kk, k, kk);
  static std::array<std::atomic<int64_t>, 64> current{};
  set_smem(reinterpret_cast<const void*>(topk_merge_kernel), p.total, current, device, "scores",
           cat(cand, " candidates per rank and k = ", k).c_str());
  // One block per row of this call, at most one per SM. Programmatic launch:
  // the kernel waits for the previous one in pdl_wait_and_release before it
  // loads anything.
  const int grid = static_cast<int>(std::min<int64_t>(c.rows, sm_count(device)));
  launch_lamport(topk_merge_kernel, grid, kThreads, static_cast<size_t>(p.total),
                 at::cuda::getCurrentCUDAStream().stream(), device, device_workspace(ws), c.geo, p,
                 scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0),
                 static_cast<int>(c.rows), static_cast<int>(cand), static_cast<int>(k), c.out.data_ptr<int32_t>(),
                 c.header);
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("topk_select", &topk_select_op<select_cuda>);
  m.impl("topk_merge", &topk_merge_op<merge_cuda>);
}

}  // namespace sdcp
