// Top-K boundary, CUDA. Candidates become 64-bit keys (semantics.h, larger =
// selected first), so a selection is a descending sort and the ids come out in
// selection order. One block of 1024 threads per row sorts with rank_sort and
// merges with merge_path (topk_sort.cuh).
// topk_select sorts chunks of 2048 candidates and merges them one at a time.
// The peer merge (protocol version 4, data-as-flag): each owner sorts its row,
// pushes its best min(C, k) keys into every peer's buffer with plain stores,
// then merges each peer's list as it lands in its own buffer, writing the
// sentinel back (kTopKSentinel: no key takes it).

#include "dataflag.cuh"
#include "semantics.h"
#include "topk.h"
#include "topk_sort.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <atomic>

namespace sdcp {
namespace {

constexpr int64_t kMaxSortKeys = 16384;  // candidates per row of topk_select

// ---------------------------------------------------------------------------
// Shared memory of a selection: rank_sort's (topk_sort.cuh), plus acc and
// tmp (the merged best keys so far), a chunk's sorted output when there is
// more than one chunk, and the peer merge a staging list for one peer's keys.
// ---------------------------------------------------------------------------

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

// The peer merge as a tree (topk_merge_kernel<kRowLoop, true>): the own list
// stays in acc; every peer's list is staged at once into its own slot, and
// log2 of the list count (rounded up to a power of two, the missing lists
// empty) levels of pairwise merges follow, each level's merges side by side.
// Slots of k keys: [0, world - 1) the staged lists, then tree_outputs(world)
// for the odd levels' outputs; the even levels write over the staged lists,
// read by then. The slots start at tmp and lie over chunk_out and the sort,
// which are free once the own list is in acc.
constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
constexpr int tree_outputs(int world) { return next_pow2(world) / 2; }

SmemPlan tree_plan(int64_t candidates, int64_t keep, int64_t k, int world) {
  SmemPlan p = plan_smem(candidates, keep, k, 0);
  p.total = std::max<int64_t>(p.total, p.tmp + align16((world - 1 + tree_outputs(world)) * k * 8));
  return p;
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

// The merge kernel's failure policy (dataflag.cuh, ReportNow): a call site
// anywhere in this 1,024-thread kernel (64 registers) costs it spills
// throughout (measured: 1.1-1.8 us per call at one rank, NOTES.md; one left
// after the row loop, 0.1 us), so its waits keep the block's first
// failure here, in shared memory, and thread 0 records it inline after the
// row loop, without printing (printf is a call; the host's error carries the
// same fields). The block's later waits return at once (failed()), so the
// record comes after at most its remaining rows' sorts. The first failure
// wins, except that a header mismatch replaces a seen abort word: the host
// reads an own failure before a peer's abort (dataflag.cuh record_failure),
// so the mismatch alone tells it what both records would. A void header is
// kept beside it.
struct PendingFailure {
  uint32_t kind;  // kNoFailure, kTimedOut, kAborted, kMismatched
  int src;
  uint32_t wait, field, mine, theirs;
  uint64_t abort;
  int void_src;  // the first peer whose header was void, or -1
};
constexpr uint32_t kNoFailure = 0, kTimedOut = 1, kAborted = 2, kMismatched = 3;

struct ReportLater {
  PendingFailure* f;  // the block's, in shared memory
  __device__ __forceinline__ bool failed() const { return *reinterpret_cast<volatile uint32_t*>(&f->kind) != 0; }
  __device__ __forceinline__ void give_up(int src, uint64_t, uint64_t abort, uint32_t wait) const {
    if (atomicCAS(&f->kind, kNoFailure, abort != 0 ? kAborted : kTimedOut) != kNoFailure) return;
    f->src = src;
    f->abort = abort;
    f->wait = wait;
  }
  // Thread 0 compares the headers between barriers (after the first row's
  // polls, before the next row's), so no give_up writes `src` meanwhile.
  __device__ __forceinline__ void mismatch(int src, uint64_t, uint32_t field, uint32_t mine, uint32_t theirs) const {
    if (atomicCAS(&f->kind, kNoFailure, kMismatched) != kNoFailure &&
        atomicCAS(&f->kind, kAborted, kMismatched) != kAborted)
      return;
    f->src = src;
    f->field = field;
    f->mine = mine;
    f->theirs = theirs;
  }
  __device__ __forceinline__ void voided(int src, uint64_t) const { atomicCAS(&f->void_src, -1, src); }
};

// Thread 0, after the row loop's last barrier: what the block kept, recorded.
__device__ __forceinline__ void record_pending(const DeviceWorkspace& ws, const PendingFailure& f, uint64_t call) {
  if (f.void_src >= 0) record_void(ws, f.void_src, call);
  if (f.kind == kMismatched) record_mismatch<false>(ws, f.src, call, f.field, f.mine, f.theirs, kWaitHeader);
  else if (f.kind != kNoFailure) record_give_up<false>(ws, f.src, call, f.abort, f.wait);
}

// Polls two keys of a local buffer until neither is the sentinel. Each 64-bit
// element of the vector is single-copy atomic, so a landed key is whole.
__device__ __forceinline__ ulonglong2 poll_keys(const DeviceWorkspace& ws, const ulonglong2* p, int src,
                                                uint64_t call, const ReportLater& fail) {
  return poll_until(
      ws, [p] { return ld_volatile_keys(p); },
      [](const ulonglong2& v) { return v.x != kTopKSentinel && v.y != kTopKSentinel; }, src, call, kWaitData, fail);
}

__device__ __forceinline__ uint64_t poll_key(const DeviceWorkspace& ws, const uint64_t* p, int src, uint64_t call,
                                             const ReportLater& fail) {
  return poll_until(
      ws, [p] { return ld_volatile_u64(p); }, [](uint64_t v) { return v != kTopKSentinel; }, src, call, kWaitData,
      fail);
}

// Where rank `d` keeps peer `src`'s call header in the buffer of `call`.
__device__ __forceinline__ uint4* topk_header(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call, int d,
                                              int src) {
  return reinterpret_cast<uint4*>(ws.buffer(d, call) + header_offset) + ws.peer_slot(src, d);
}

// This rank's call header into every peer's buffer (before the keys).
__device__ __forceinline__ void store_headers(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call,
                                                  CallHeader mine) {
  for (int step = 1; step < ws.world; ++step) {
    const int d = ws.rank + step < ws.world ? ws.rank + step : ws.rank + step - ws.world;
    store_call_header(topk_header(ws, header_offset, call, d, ws.rank), mine);
  }
}

// Every peer's call header of this call: polled, re-filled, compared (a
// mismatch or a wait that gives up goes to `fail`, which records it and
// aborts the workspace on every rank).
template <typename Fail>
__device__ __forceinline__ void check_headers(const DeviceWorkspace& ws, int64_t header_offset, uint64_t call,
                                              const CallHeader& mine, const Fail& fail) {
  for (int step = 1; step < ws.world; ++step) {
    const int src = ws.rank + step < ws.world ? ws.rank + step : ws.rank + step - ws.world;
    check_call_header(ws, topk_header(ws, header_offset, call, ws.rank, src), mine, src, call, fail);
  }
}

// ---------------------------------------------------------------------------
// The merge tree (topk_merge_kernel<kRowLoop, true>, tree_plan).
// ---------------------------------------------------------------------------

constexpr int kThreadBits = 10;
static_assert(kThreads == 1 << kThreadBits, "the tree splits the block into power-of-two groups");

// List i of tree level `level`: level 0's are this rank's (acc) and the staged
// peer lists, empty past the world; level l's list i merges lists
// [i * 2^l, (i + 1) * 2^l) of level 0 into slot world - 1 + i (odd l) or
// slot i (even l, over staged lists that level l - 1 has read).
__device__ __forceinline__ uint64_t* tree_list(uint64_t* slots, uint64_t* acc, int level, int i, int n, int k) {
  if (level == 0) return i == 0 ? acc : slots + static_cast<int64_t>(i - 1) * k;
  return slots + static_cast<int64_t>((level & 1) ? n - 1 + i : i) * k;
}

__device__ __forceinline__ int tree_len(int level, int i, int n, int kk, int k) {
  const int lists = min(max(n - (i << level), 0), 1 << level);
  return min(k, lists * kk);
}

// Row t's peer merge as a tree: acc holds this rank's kk keys; the row's k ids
// go to o. Every peer's list is staged into its slot (each thread's vectors
// of kBatch peers loaded before it waits for any, so that their round trips
// overlap: 4 registers a peer), the call headers
// checked in parallel (block 0's first row), then log2 next_pow2(world)
// levels of pairwise merges, each level's merges side by side in groups of
// kThreads / merges threads; the last level writes the ids.
template <int kBatch>
__device__ __forceinline__ void tree_merge(const DeviceWorkspace& ws, const TopKGeometry& g, const SmemPlan& p,
                                           uint8_t* smem, uint64_t* acc, int32_t* o, int t, int k, uint64_t call,
                                           const CallHeader& hdr, bool checks_header, const ReportLater& fail) {
  const int n = ws.world, me = ws.rank;
  const int kk = static_cast<int>(g.keys_per_row);
  uint64_t* slots = reinterpret_cast<uint64_t*>(smem + p.tmp);  // tree_plan
  // Row t of this rank's inbox from the peer `step` ranks on (peer_slot(me + step, me) = step - 1).
  uint64_t* const inbox =
      reinterpret_cast<uint64_t*>(ws.buffer(me, call) + g.inbox_offset) + static_cast<int64_t>(t) * kk;
  const int64_t peer_stride = g.max_rows * kk;
  // Lane s of warp 0 checks peer me + s + 1's header, loaded before the staging's loads.
  const bool header_lane = checks_header && static_cast<int>(threadIdx.x) < n - 1;
  uint4* hp = nullptr;
  uint4 hv = make_uint4(0, 0, 0, 0);
  int hsrc = 0;
  if (header_lane) {
    hsrc = me + 1 + static_cast<int>(threadIdx.x);
    if (hsrc >= n) hsrc -= n;
    hp = topk_header(ws, g.header_offset, call, me, hsrc);
    hv = ld_volatile_v4(hp);
  }
  // 3. Staging: polled from the local buffer, the sentinel written back at once.
  if (kk % 2 == 0) {
    for (int s0 = 1; s0 < n; s0 += kBatch) {
      for (int v = threadIdx.x; v < kk / 2; v += kThreads) {
        ulonglong2 x[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (s0 + i < n)
            x[i] = ld_volatile_keys(reinterpret_cast<const ulonglong2*>(inbox + (s0 + i - 1) * peer_stride) + v);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (s0 + i < n) {
            const int src = me + s0 + i < n ? me + s0 + i : me + s0 + i - n;
            ulonglong2* q = reinterpret_cast<ulonglong2*>(inbox + (s0 + i - 1) * peer_stride) + v;
            if (x[i].x == kTopKSentinel || x[i].y == kTopKSentinel) x[i] = poll_keys(ws, q, src, call, fail);
            reinterpret_cast<ulonglong2*>(slots + static_cast<int64_t>(s0 + i - 1) * k)[v] = x[i];
            *q = make_ulonglong2(kTopKSentinel, kTopKSentinel);
          }
        }
      }
    }
  } else {
    for (int step = 1; step < n; ++step) {
      const int src = me + step < n ? me + step : me + step - n;
      uint64_t* in = inbox + (step - 1) * peer_stride;
      uint64_t* dst = slots + static_cast<int64_t>(step - 1) * k;
      for (int i = threadIdx.x; i < kk; i += kThreads) {
        dst[i] = poll_key(ws, in + i, src, call, fail);
        in[i] = kTopKSentinel;
      }
    }
  }
  if (header_lane) hv = land_peer_header(ws, hp, hv, hsrc, call, fail);
  __syncthreads();  // every list staged, every poll of the row done: no give_up runs while a mismatch is kept
  if (header_lane && !has_sentinel(hv)) header_matches(hv, hdr, hsrc, call, fail);
  // 4. The merges. The last level's one merge writes the ids (k <= world * kk:
  // every position holds a key, invalid ones are 0: id -1).
  const int levels = 32 - __clz(n - 1);  // log2 next_pow2(n), n >= 2
  for (int l = 1; l <= levels; ++l) {
    const int group_bits = kThreadBits - (levels - l);  // 2^(levels - l) merges of 2^group_bits threads
    const int j = static_cast<int>(threadIdx.x) >> group_bits;
    const int lane = static_cast<int>(threadIdx.x) & ((1 << group_bits) - 1);
    const uint64_t* a = tree_list(slots, acc, l - 1, 2 * j, n, k);
    const uint64_t* b = tree_list(slots, acc, l - 1, 2 * j + 1, n, k);
    const int la = tree_len(l - 1, 2 * j, n, kk, k), lb = tree_len(l - 1, 2 * j + 1, n, kk, k);
    if (l == levels) {
      merge_path(a, la, b, lb, k, [o](int pos, uint64_t key) { o[pos] = topk_key_id(key); }, lane, 1 << group_bits);
    } else {
      uint64_t* dst = tree_list(slots, acc, l, j, n, k);
      merge_path(a, la, b, lb, min(k, la + lb), [dst](int pos, uint64_t key) { dst[pos] = key; }, lane,
                 1 << group_bits);
      __syncthreads();
    }
  }
}

// Grid: one block per row, at most one per SM. kRowLoop: block b handles
// rows b, b + gridDim.x, ...; without it the grid is the row count and block
// b handles row b alone: a loop around the sort lets the compiler hoist the
// sort's per-thread addresses out of it and keep them, spilled, across the
// sort (at 128 rows, 2 us above the sort alone: NOTES.md, Version 13). For
// each row: sort the own candidates, push the best kk keys into every peer's
// buffer (16-byte stores when kk is even), then merge the peers' lists
// (polled from the local buffer, the sentinel written back at once) into the
// result. kTree (tree_plan): every peer's list is staged at once and merged
// in a tree of log2 N levels; otherwise (one rank, or a tree that does not
// fit in shared memory) each peer's list in turn, nearest peer first. A
// block waits only for the same rows of its peers, which every block pushes
// before it waits, so the grid need not be co-resident.
//
// Call headers (dataflag.cuh): thread 0 of block 0 stores this rank's header
// into every peer's buffer as soon as it knows the call (after its first
// sort, before the keys), and block 0 checks every peer's header once its
// first row's keys have landed: both ranks have that row (a call without
// rows runs topk_headers_kernel instead), so the check is reached whatever
// the peer's row count, and a mismatch aborts the blocks that wait for rows
// the peer does not have. Checked outside the poll loop, the header costs the
// sort and the merge no registers. One thread stores, so that its fence
// before an abort word (dataflag_record) also orders its headers: a peer that
// meets the abort still finds this rank's header and names both sides. The
// tree checks the headers in parallel (lane s of warp 0: peer me + s + 1),
// each loaded before the staging polls so that its round trip overlaps
// theirs, and compared after the barrier that ends every poll of the row, so
// that no give_up writes the block's pending failure while a mismatch does;
// the sequential merge's thread 0 checks them in turn after the merges.
// The workspace is a grid constant: the failure paths take its address, which
// would otherwise make every thread copy it into local memory at entry.
template <bool kRowLoop, bool kTree>
__global__ void __launch_bounds__(kThreads, 1)
    topk_merge_kernel(const __grid_constant__ DeviceWorkspace ws, TopKGeometry g, SmemPlan p, const float* scores,
                      const int32_t* ids, int64_t s0, int64_t i0, int rows, int c, int k, int32_t* out,
                      const __grid_constant__ CallHeader hdr) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ PendingFailure pending;  // set before the first sort's barriers, read after the row loop's
  if (threadIdx.x == 0) {
    pending.kind = kNoFailure;
    pending.void_src = -1;
  }
  const ReportLater fail{&pending};
  // The inputs are the previous kernel's outputs: wait for it (programmatic
  // launch) before loading them, and read the call index only once the first
  // row is sorted, so the counter load overlaps the sort's input loads. The
  // block keeps it in shared memory: held in a register across a later row's
  // sort, which needs all 64, it would be spilled, and spills are stored
  // through to L2 (NOTES.md, Version 13).
  __shared__ uint64_t block_call;
  pdl_wait_and_release();
  uint64_t call = 0;
  const int n = ws.world, me = ws.rank;
  const int kk = static_cast<int>(g.keys_per_row);  // min(c, k)
  auto inbox = [&](int d, int src, int t) {
    return reinterpret_cast<uint64_t*>(ws.buffer(d, call) + g.inbox_offset) +
           (static_cast<int64_t>(ws.peer_slot(src, d)) * g.max_rows + t) * kk;
  };
  const bool header_thread = blockIdx.x == 0 && threadIdx.x == 0;
  for (int t = blockIdx.x; t < rows; t += gridDim.x) {
    const bool checks_header = blockIdx.x == 0 && t == 0;  // block 0's first row
    // 1. Owner: the best kk keys of the row, in order.
    uint64_t* acc = block_select(smem, p, scores + t * s0, ids + t * i0, c, kk);
    if (t == static_cast<int>(blockIdx.x)) {  // the block's first row
      call = block_call_index(ws, fail);
      if (threadIdx.x == 0) block_call = call;  // read after the barriers of this row
      if (header_thread) store_headers(ws, g.header_offset, call, hdr);  // before the keys
    } else {
      call = block_call;
    }
    if constexpr (kTree) {
      // The tree's slots lie over tmp: a selection of several chunks may end there.
      uint64_t* own = reinterpret_cast<uint64_t*>(smem + p.acc);
      if (acc != own) {
        for (int i = threadIdx.x; i < kk; i += kThreads) own[i] = acc[i];
        __syncthreads();
        acc = own;
      }
    }
    // 2. Push them into every peer's buffer (plain stores: the keys are their
    //    own flag), one peer after the other, nearest first: the destination
    //    is the same for the whole block, so the stores' loop holds no index
    //    arithmetic (a division and a modulo by run-time values per vector
    //    cost about 0.5 us per peer, NOTES.md Version 13).
    for (int step = 1; step < n; ++step) {
      uint64_t* dst = inbox(me + step < n ? me + step : me + step - n, me, t);
      if (kk % 2 == 0) {
        for (int v = threadIdx.x; v < kk / 2; v += kThreads)
          reinterpret_cast<ulonglong2*>(dst)[v] = reinterpret_cast<const ulonglong2*>(acc)[v];
      } else {
        for (int i = threadIdx.x; i < kk; i += kThreads) dst[i] = acc[i];
      }
    }
    int32_t* o = out + static_cast<int64_t>(t) * k;
    if constexpr (kTree) {
      // Two peers' vectors in flight per thread fit the one-row kernel's
      // registers; the row loop's spill at two (ptxas: 36 -> 140 bytes).
      tree_merge<kRowLoop ? 1 : 2>(ws, g, p, smem, acc, o, t, k, call, hdr, checks_header, fail);
    } else {
      // 3. Consumer: merge each peer's list as it lands; the last merge writes the ids.
      uint64_t* stage = reinterpret_cast<uint64_t*>(smem + p.stage);
      uint64_t* tmp =
          reinterpret_cast<uint64_t*>(smem + (acc == reinterpret_cast<uint64_t*>(smem + p.acc) ? p.tmp : p.acc));
      int len = kk;
      for (int step = 1; step < n; ++step) {
        const int src = (me + step) % n;
        uint64_t* in = inbox(me, src, t);
        if (kk % 2 == 0) {
          for (int v = threadIdx.x; v < kk / 2; v += kThreads) {
            ulonglong2* q = reinterpret_cast<ulonglong2*>(in) + v;
            reinterpret_cast<ulonglong2*>(stage)[v] = poll_keys(ws, q, src, call, fail);
            *q = make_ulonglong2(kTopKSentinel, kTopKSentinel);
          }
        } else {
          for (int i = threadIdx.x; i < kk; i += kThreads) {
            stage[i] = poll_key(ws, in + i, src, call, fail);
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
      if (checks_header && threadIdx.x == 0) check_headers(ws, g.header_offset, call, hdr, fail);
      if (n == 1) {
        for (int pos = threadIdx.x; pos < k; pos += kThreads) o[pos] = topk_key_id(acc[pos]);
      }
    }
    __syncthreads();  // the next row reuses the shared memory
    if constexpr (!kRowLoop) break;
  }
  // Every wait of the block is done: the row loop ends with a barrier, and
  // every block has a row (the grid is at most the row count).
  call = block_call;
  if (threadIdx.x == 0) record_pending(ws, pending, call);
  block_finish_call(ws, call);
}

// A call without rows: the call headers alone (stored, then each peer's
// checked), so that the call still waits for every peer's call of the same
// index and a peer with rows sees the difference.
__global__ void __launch_bounds__(32)
    topk_headers_kernel(const __grid_constant__ DeviceWorkspace ws, int64_t header_offset, CallHeader hdr) {
  pdl_wait_and_release();
  const uint64_t call = block_call_index(ws);
  if (threadIdx.x == 0) {
    store_headers(ws, header_offset, call, hdr);
    check_headers(ws, header_offset, call, hdr, ReportNow{ws});
  }
  block_finish_call(ws, call);
}

int64_t max_smem_optin(int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return value;
}

// The dynamic shared memory a kernel can opt into beside its static shared memory.
int64_t smem_limit(const void* kernel, int device) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return max_smem_optin(device) - static_cast<int64_t>(attr.sharedSizeBytes);
}

// Checks that `bytes` of dynamic shared memory fit next to the kernel's static
// shared memory, and opts the kernel in (the attribute call is made only when
// a larger size is first needed on the device).
void set_smem(const void* kernel, int64_t bytes, std::array<std::atomic<int64_t>, 64>& current, int device,
              const char* arg, const char* what) {
  const int64_t limit = smem_limit(kernel, device);
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

void merge_cuda(const TopKMergeCall& c, const at::Tensor& scores, const at::Tensor& ids) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  if (c.rows == 0) {
    const c10::cuda::CUDAGuard guard(scores.device());
    launch_dataflag(topk_headers_kernel, 1, 32, 0, at::cuda::getCurrentCUDAStream().stream(), scores.get_device(),
                   device_workspace(ws), c.geo.header_offset, c.header);
    return;
  }
  const int64_t cand = c.geo.candidates_per_rank, kk = c.geo.keys_per_row, k = c.geo.k;
  SDCP_CHECK_ARG(cand <= kMaxSortKeys, "scores", "at most " << kMaxSortKeys << " candidates per rank on CUDA", cand);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int device = scores.get_device();
  const int world = static_cast<int>(ws.world_size);
  // With SDCP_TOPK_TREE=1, the tree where its slots fit (every peer's list
  // and the odd levels' outputs: DCP8 at k = 2,048 takes 192 KiB); else, and
  // at one rank, one peer's list at a time: acc and tmp hold up to k keys
  // (the merged result), stage one peer's kk.
  const SmemPlan tree = tree_plan(cand, kk, k, world);
  static std::array<std::atomic<int64_t>, 64> tree_limit{};  // per device, 0 until asked
  auto& limit = tree_limit[device & 63];
  if (limit.load() == 0) limit.store(smem_limit(reinterpret_cast<const void*>(topk_merge_kernel<true, true>), device));
  static const bool tree_on = kernel_opt_in("SDCP_TOPK_TREE");  // off until a GPU run has checked the tree
  const bool use_tree = tree_on && world > 1 && tree.total <= limit.load();
  const SmemPlan p = use_tree ? tree : plan_smem(cand, kk, k, kk);
  // One block per row of this call, at most one per SM: up to one row per SM
  // the kernel without the row loop. Programmatic launch: the kernel waits
  // for the previous one in pdl_wait_and_release before it loads anything.
  const int sms = grid_sms(device);
  auto launch = [&](auto kernel, std::array<std::atomic<int64_t>, 64>& current) {
    set_smem(reinterpret_cast<const void*>(kernel), p.total, current, device, "scores",
             cat(cand, " candidates per rank and k = ", k).c_str());
    launch_dataflag(kernel, static_cast<int>(std::min<int64_t>(c.rows, sms)), kThreads, static_cast<size_t>(p.total),
                   at::cuda::getCurrentCUDAStream().stream(), device, device_workspace(ws), c.geo, p,
                   scores.data_ptr<float>(), ids.data_ptr<int32_t>(), scores.stride(0), ids.stride(0),
                   static_cast<int>(c.rows), static_cast<int>(cand), static_cast<int>(k), c.out.data_ptr<int32_t>(),
                   c.header);
  };
  static std::array<std::atomic<int64_t>, 64> current[4]{};
  if (use_tree) {
    if (c.rows <= sms) launch(topk_merge_kernel<false, true>, current[0]);
    else launch(topk_merge_kernel<true, true>, current[1]);
  } else {
    if (c.rows <= sms) launch(topk_merge_kernel<false, false>, current[2]);
    else launch(topk_merge_kernel<true, false>, current[3]);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("topk_select", &topk_select_op<select_cuda>);
  m.impl("topk_merge", &topk_merge_op<merge_cuda>);
}

}  // namespace sdcp
