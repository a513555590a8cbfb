// Output/LSE boundary, CUDA: the LSE-weighted combine of stacked partials,
// and the peer path, one fused kernel with data-as-flag signalling (see
// output_lse_kernel). A warp handles one (row, head) item; payloads move as
// 16-byte vectors.

#include "dataflag.cuh"
#include "output_lse.h"
#include "semantics.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

namespace sdcp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename scalar_t>
struct Vec {
  static constexpr int kElems = 16 / sizeof(scalar_t);
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
    return static_cast<float>(reinterpret_cast<const scalar_t*>(&raw)[i]);
  }
  __device__ __forceinline__ void set(int i, float v) { reinterpret_cast<scalar_t*>(&raw)[i] = static_cast<scalar_t>(v); }
};

// Combine one item with the lane's share of its vectors. `lse(s)` is shard s's
// raw LSE; `src(s)` points at shard s's payload (dim elements).
template <typename scalar_t, typename LseAt, typename SrcAt>
__device__ __forceinline__ void combine_item(int n, LseAt lse, SrcAt src, int64_t nvec, bool base2,
                                             scalar_t* out, float* out_lse) {
  using V = Vec<scalar_t>;
  float w[kMaxDeviceWorld];
  const float L = lse_weights(n, lse, base2, w);
  const int lane = threadIdx.x & 31;
  if (lane == 0) *out_lse = L;
  // Two vectors per lane per step, so each source contributes two loads in flight.
  for (int64_t v0 = lane; v0 < nvec; v0 += 64) {
    const bool second = v0 + 32 < nvec;
    float acc[2][V::kElems];
#pragma unroll
    for (int e = 0; e < V::kElems; ++e) acc[0][e] = acc[1][e] = 0.0f;
    for (int s = 0; s < n; ++s) {
      if (w[s] == 0.0f) continue;  // a zero-weight payload is never read
      const uint4* p = reinterpret_cast<const uint4*>(src(s));
      V x0, x1;
      x0.raw = p[v0];
      if (second) x1.raw = p[v0 + 32];
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) {
        acc[0][e] += w[s] * x0.get(e);
        if (second) acc[1][e] += w[s] * x1.get(e);
      }
    }
    V o0, o1;
#pragma unroll
    for (int e = 0; e < V::kElems; ++e) {
      o0.set(e, acc[0][e]);
      o1.set(e, acc[1][e]);
    }
    reinterpret_cast<uint4*>(out)[v0] = o0.raw;
    if (second) reinterpret_cast<uint4*>(out)[v0 + 32] = o1.raw;
  }
}

template <typename scalar_t>
__global__ void lse_combine_kernel(const scalar_t* po, const float* pl, int n, int64_t items, int64_t dim,
                                   bool base2, scalar_t* out, float* lse) {
  const int64_t nvec = dim / Vec<scalar_t>::kElems;
  for (int64_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < items; i += gridDim.x * kWarps) {
    combine_item<scalar_t>(
        n, [&](int s) { return pl[s * items + i]; }, [&](int s) { return po + (s * items + i) * dim; }, nvec,
        base2, out + i * dim, lse + i);
  }
}

// RowMask::row_empty with the whole warp: a 32-way search over the request
// ends (one round of loads for up to 32 requests, two up to 1024, three up to
// 32,768), the last round also loading the candidate requests' seq_lens. A =
// the number of ends query_start_loc[1..R] <= t (ascending ends); the row is
// padding when A == R, else it belongs to request A.
//
// In 32-bit arithmetic (the host keeps R below 2^30, a row index is an int):
// an int64 end is clamped to int32, which keeps its comparison with every
// row, and of a length only whether it is 0 is kept. kNarrow: both tensors
// are int32 (vLLM's metadata), known at compile time; otherwise each
// tensor's width is read from the mask.
//
// One round as a lane holds it: the end at query_start_loc[lo + (lane + 1) *
// step] (INT32_MAX past R) and, in the last round (step 1), whether request
// lo + lane's length is nonzero.
struct LookupRound {
  int32_t end;
  uint32_t nonzero;
};

// The same loads as they land: each value's 32-bit words (hi unused for an
// int32 tensor), converted only where the lookup uses them. Converting at the
// load (a sign extension, a move out of the width's branch) made the first
// round's loads wait in turn at kernel entry, ahead of the call index.
struct LookupWords {
  uint32_t end_lo, end_hi, len_lo, len_hi;
};

// Element i of a 1-D int32 / int64 tensor into (lo, hi): one load per word,
// straight into the registers that keep it.
__device__ __forceinline__ void load_words(const void* p, bool wide, int i, uint32_t& lo, uint32_t& hi) {
  const uint32_t* w = static_cast<const uint32_t*>(p);
  lo = w[wide ? 2 * i : i];
  if (wide) hi = w[2 * i + 1];
}

// An end as an int32 that compares with every row as the end does.
__device__ __forceinline__ int32_t narrow_end(uint32_t lo, uint32_t hi, bool wide) {
  const int32_t l = static_cast<int32_t>(lo), h = static_cast<int32_t>(hi);
  if (!wide || h == (l >> 31)) return l;  // in int32 range: hi is lo's sign
  return h < 0 ? INT32_MIN : INT32_MAX;
}

template <bool kNarrow>
__device__ __forceinline__ LookupWords load_lookup_round(const RowMask& m, int lo, int hi) {
  const int lane = threadIdx.x & 31, requests = static_cast<int>(m.requests);
  const bool last = hi - lo <= 32;  // then step 1: A = lo + (the count below)
  const int step = last ? 1 : static_cast<int>(static_cast<unsigned>(hi - lo + 31) >> 5);
  const int e = lo + (lane + 1) * step;
  // Past R: an end above every row, a nonzero length. Every end up to R is
  // loaded, also past hi, so that the last round serves later rows too.
  LookupWords r{0x7fffffffu, 0u, 1u, 0u};
  if (e <= requests) load_words(m.query_start_loc, !kNarrow && m.query_start_loc_wide, e, r.end_lo, r.end_hi);
  if (last && lo + lane < requests) load_words(m.seq_lens, !kNarrow && m.seq_lens_wide, lo + lane, r.len_lo, r.len_hi);
  return r;
}

template <bool kNarrow>
__device__ __forceinline__ LookupRound narrow(const RowMask& m, const LookupWords& r) {
  const bool len_wide = !kNarrow && m.seq_lens_wide;
  return {narrow_end(r.end_lo, r.end_hi, !kNarrow && m.query_start_loc_wide), len_wide ? r.len_lo | r.len_hi : r.len_lo};
}

// The first round is the same for every row (lo = 0, hi = R): a warp loads it
// once, beside its first inputs and the call index, and keeps it in shared
// memory (in registers it costs spills), so a row of up to 32 requests is
// looked up without a global load of its own.
template <bool kNarrow>
__device__ __forceinline__ LookupWords first_lookup_round(const RowMask& m) {
  return m.enabled && m.requests > 0 ? load_lookup_round<kNarrow>(m, 0, static_cast<int>(m.requests))
                                     : LookupWords{0x7fffffffu, 0u, 1u, 0u};
}

// A warp's last round of step 1, kept for its later rows: lane j's share
// (`r`, in shared memory: in registers it costs spills) holds the end and
// length of request lo + j. A row t >= row_lo (= query_start_loc[lo], so
// A >= lo) is answered by it with one ballot, unless all 32 ends are <= t
// short of R. A warp's rows ascend through its items (and again in the owner
// loop), so at many rows per warp most lookups take this path.
struct LookupWindow {
  int lo;
  int row_lo;      // INT32_MAX: no window yet
  LookupRound* r;  // this lane's entry
};

// Row t's lookup, from its first round `first` (first_lookup_round's).
template <bool kNarrow>
__device__ __forceinline__ bool warp_row_empty(const RowMask& m, int t, LookupRound first, LookupWindow& win) {
  const int requests = static_cast<int>(m.requests);
  if (requests == 0) return true;
  if (t >= win.row_lo) {
    const LookupRound w = *win.r;
    const int c = __popc(__ballot_sync(0xffffffffu, w.end <= t));
    const bool got = __shfl_sync(0xffffffffu, w.nonzero, c & 31) != 0u;
    if (c < 32) return win.lo + c >= requests || !got;  // padding, or request lo + c's length
    if (win.lo + 32 >= requests) return true;           // A = R: padding
  }
  int lo = 0, hi = requests, row_lo = INT32_MIN;  // A in [lo, hi], and query_start_loc[lo] <= t
  LookupRound r = first;
  while (true) {
    const bool last = hi - lo <= 32;
    const int c = __popc(__ballot_sync(0xffffffffu, r.end <= t));
    if (last) {
      win.lo = lo;
      win.row_lo = row_lo;
      *win.r = r;
      const int a = lo + c;
      if (a >= requests) return true;  // padding
      // a - lo = c <= 31 here unless every lane's end was <= t (then a == lo + 32).
      if (c < 32) return __shfl_sync(0xffffffffu, r.nonzero, c) == 0u;
      uint32_t len_lo, len_hi = 0;
      load_words(m.seq_lens, !kNarrow && m.seq_lens_wide, a, len_lo, len_hi);
      return (len_lo | len_hi) == 0u;
    }
    const int step = static_cast<int>(static_cast<unsigned>(hi - lo + 31) >> 5);
    const int32_t found = __shfl_sync(0xffffffffu, r.end, (c + 31) & 31);  // lane c - 1: end at lo + c * step
    if (c > 0) row_lo = found;
    hi = min(hi, lo + (c + 1) * step - 1);
    lo += c * step;
    r = narrow<kNarrow>(m, load_lookup_round<kNarrow>(m, lo, hi));
  }
}

// Data-as-flag (dataflag.h). Block b owns the same items (row, local head) on
// every rank: it stores its items' head shards for every peer into that
// peer's buffer, then, for its own heads, polls each peer's LSE and payload
// vectors in the local buffer as they land, writes the sentinel back, reads
// this rank's own shard in place from partial_out and combines in fp32. A
// block waits only for the same block of its peers, which stores before it
// waits, so the grid is sized to the items and need not be co-resident.
//
// At a few rows the call is one warp's chain of dependent steps, so the
// kernel keeps independent loads in flight together (the first inputs with
// the call index, an item's LSE words with its first payload vectors, each
// peer's next vectors while the current ones are combined), uses 32-bit
// index arithmetic (64-bit division is a long software routine), and is
// compiled per world size (kN; 0 = any) so that the per-shard LSEs and
// weights stay in registers instead of local memory. The workspace is a grid
// constant: the failure paths take its address, which would otherwise make
// every thread copy it into local memory at entry (the row mask too: its
// lookup is a member function).
//
// With a row mask (vLLM's seq_lens / query_start_loc, output_lse.h) each
// producer sends -inf for its own empty rows, so the owner's combine gives
// them no weight; a warp looks a row up once (warp_row_empty, whose first
// round it loads at entry and whose last round it keeps for its later rows),
// and without a mask the lookup is one uniform branch per item. kNarrowMask:
// int32 metadata (or none), the lookup's load widths fixed at compile time.
// At one rank this warp's own first inputs, the lookup's first round and the
// call index are all in flight together.
//
// kAllPeers (SDCP_OLSE_ALL_PEERS=1, DCP4 and DCP8; off until a GPU run has
// checked it): each lane loads every peer's vectors of a chunk at once, one
// round trip for all peers instead of one per peer, in 2 x 16 registers a
// peer (ptxas, DCP8: 128 registers and 40 bytes of spills -> 191 and none;
// DCP4: 128 and 8 -> 156 and none).
template <typename scalar_t, int kN, bool kNarrowMask, bool kAllPeers = false>
__global__ void __launch_bounds__(kThreads)
    output_lse_kernel(const __grid_constant__ DeviceWorkspace ws, OutputLSEGeometry g, const scalar_t* po,
                      const float* pl, int rows, bool base2, scalar_t* out, float* out_lse,
                      const __grid_constant__ CallHeader hdr, const __grid_constant__ RowMask mask) {
  using V = Vec<scalar_t>;
  constexpr int kShards = kN > 0 ? kN : kMaxDeviceWorld;
  pdl_wait_and_release();
  const int n = kN > 0 ? kN : ws.world, me = ws.rank;
  const int heads = static_cast<int>(g.total_heads), hl = static_cast<int>(g.local_heads);
  const int dim = static_cast<int>(g.head_dim), nvec = dim / V::kElems, items = rows * hl;
  const int per_block = (items + gridDim.x - 1) / gridDim.x;
  const int begin = min(items, static_cast<int>(blockIdx.x) * per_block), end = min(items, begin + per_block);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  uint64_t call = 0;
  bool have_call = false;
  // The warp's last looked-up row (items of one row are often the same warp's).
  // Called by the whole warp (the lookup is a warp-wide search).
  int mask_row = -1;
  bool mask_row_empty = false;
  __shared__ LookupRound windows[kThreads];  // the kept last round, laid out as first_rounds
  LookupWindow mask_window{0, INT32_MAX, &windows[threadIdx.x]};  // no window yet
  // The lookup's first round: loaded at entry, kept in shared memory once
  // the call index is known (by then it has landed).
  __shared__ LookupRound first_rounds[kThreads];  // lane j of warp w: [w * 32 + j]
  const LookupWords first_round = first_lookup_round<kNarrowMask>(mask);
  auto row_empty = [&](int t) {
    if (!mask.enabled) return false;
    if (t != mask_row) {
      mask_row = t;
      mask_row_empty = warp_row_empty<kNarrowMask>(mask, t, first_rounds[threadIdx.x], mask_window);
    }
    return mask_row_empty;
  };
  // Buffer of rank d, entry of source s: payload [row][h_loc][dim], LSE [row][h_loc].
  const int64_t entry_vecs = g.max_rows * g.local_heads * nvec, entry_words = g.max_rows * g.local_heads;
  auto inbox_out = [&](int d, int s) {
    return reinterpret_cast<uint4*>(ws.buffer(d, call) + g.out_inbox_offset) + ws.peer_slot(s, d) * entry_vecs;
  };
  auto inbox_lse = [&](int d, int s) {
    return reinterpret_cast<uint32_t*>(ws.buffer(d, call) + g.lse_inbox_offset) + ws.peer_slot(s, d) * entry_words;
  };
  // Call headers (dataflag.cuh): block 0's last warp, lane d for peer d, stores
  // this rank's header as soon as it knows the call and checks the peers'
  // with its first LSE poll (or alone, if it owns no item).
  auto header = [&](int d, int s) {
    return reinterpret_cast<uint4*>(ws.buffer(d, call) + g.header_offset) + ws.peer_slot(s, d);
  };
  const bool header_warp = blockIdx.x == 0 && warp == kWarps - 1;
  auto begin_call = [&] {
    call = block_call_index(ws);
    have_call = true;
    if (mask.enabled) first_rounds[threadIdx.x] = narrow<kNarrowMask>(mask, first_round);  // read by this lane only
    if (header_warp && lane < n && lane != me) store_call_header(header(lane, me), hdr);
  };
  // Shard d of item (t, h): partial_out[t, d*hl + h] (dim elements).
  auto shard = [&](int t, int h, int d) {
    return reinterpret_cast<const uint4*>(po + (static_cast<int64_t>(t) * heads + d * hl + h) * dim);
  };
  // 1. Producer: the (peer, vector) pairs of an item are flattened, kUnroll per lane.
  constexpr int kUnroll = 4;
  const int pairs = (n - 1) * nvec;
  for (int i = begin + warp; i < end; i += kWarps) {
    const int t = i / hl, h = i - t * hl;
    const bool sends_lse = lane < n && lane != me;
    // Loaded before the row lookup, whose loads then overlap it and the payload's.
    const float raw_lse = sends_lse ? pl[static_cast<int64_t>(t) * heads + lane * hl + h] : 0.0f;
    for (int base = 0; base < pairs; base += 32 * kUnroll) {
      uint4 buf[kUnroll];
      int dst[kUnroll], vec[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int x = base + u * 32 + lane, k = x / nvec;
        vec[u] = x - k * nvec;
        dst[u] = me + 1 + k < n ? me + 1 + k : me + 1 + k - n;
        if (x < pairs) buf[u] = shard(t, h, dst[u])[vec[u]];
      }
      if (!have_call) begin_call();  // while the first inputs are in flight
      // The LSE first: the owner needs it before any payload vector. An empty
      // row sends -inf (base == 0 is warp-uniform: the lookup is warp-wide).
      if (base == 0) {
        const float lse = row_empty(t) ? -INFINITY : raw_lse;
        if (sends_lse) inbox_lse(lane, me)[i] = canonical_lse_word(__float_as_uint(lse));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 + lane < pairs) inbox_out(dst[u], me)[static_cast<int64_t>(i) * nvec + vec[u]] = canonical_payload(buf[u]);
    }
  }
  // 2. Owner: for each own item, every shard's LSE (lane s polls peer s) and
  //    the first peer's first vectors in one round of loads, then the
  //    payload vectors in shard order, each polled, re-filled and weighed.
  const uint4 sentinel4 = make_uint4(kSentinel, kSentinel, kSentinel, kSentinel);
  const int first_peer = me == 0 ? 1 : 0;
  static_assert(!kAllPeers || kN >= 4, "at 2 ranks the first peer is every peer; any size keeps one peer ahead");
  // This rank's own shard of an item (chunk 0) and its own LSE are loaded one
  // item ahead: a warp keeps two items' loads in flight, which is what the
  // large-row regime needs (the grid is capped near 2 blocks per SM).
  const bool two0 = lane + 32 < nvec;
  uint4 next0 = make_uint4(0, 0, 0, 0), next1 = next0;
  float next_lse = 0.0f;
  auto load_own = [&](int i) {
    const int t = i / hl, h = i - t * hl;
    const uint4* own = shard(t, h, me);
    if (lane < nvec) next0 = own[lane];
    if (two0) next1 = own[lane + 32];
    if (lane == me) next_lse = pl[static_cast<int64_t>(t) * heads + me * hl + h];
  };
  // The first item's: at one rank the warp has sent nothing, so before the
  // call index (both in flight together); in larger worlds after it (held
  // across the call index's failure path, the vectors cost spills).
  constexpr bool kOwnBeforeCall = kN == 1;
  if (kOwnBeforeCall && begin + warp < end) load_own(begin + warp);
  if (!have_call) begin_call();
  if (!kOwnBeforeCall && begin + warp < end) load_own(begin + warp);
  for (int i = begin + warp; i < end; i += kWarps) {
    const int t = i / hl, h = i - t * hl;
    const uint4* own = shard(t, h, me);
    uint4 own0 = next0, own1 = next1;
    const float own_raw_lse = next_lse;
    uint4* const inbox = reinterpret_cast<uint4*>(ws.buffer(me, call) + g.out_inbox_offset) + static_cast<int64_t>(i) * nvec;
    auto peer_vec = [&](int s, int v) { return inbox + ws.peer_slot(s, me) * entry_vecs + v; };
    uint32_t* lse_at = inbox_lse(me, lane) + i;
    const bool polls_lse = lane < n && lane != me;
    // The header warp's first item also checks the peers' headers (loaded with the LSE word).
    const bool checks_header = header_warp && i == begin + warp && polls_lse;
    uint4* const header_at = header(me, lane);
    const uint4 header_word = checks_header ? ld_volatile_v4(header_at) : sentinel4;
    uint32_t lse_word = polls_lse ? ld_volatile_u32(lse_at) : 0u;
    // Chunk 0's vectors: this rank's own (loaded one item ahead) and the first
    // peer's, or with kAllPeers every peer's, so that the peers' round trips
    // overlap instead of following each other.
    uint4 a0 = sentinel4, a1 = sentinel4;
    uint4 pa0[kAllPeers ? kShards : 1], pa1[kAllPeers ? kShards : 1];
    if constexpr (kAllPeers) {
#pragma unroll
      for (int s = 0; s < kShards; ++s) {
        if (s != me && lane < nvec) pa0[s] = ld_volatile_v4(peer_vec(s, lane));
        if (s != me && two0) pa1[s] = ld_volatile_v4(peer_vec(s, lane + 32));
      }
    } else {
      if (first_peer < n && lane < nvec) a0 = ld_volatile_v4(peer_vec(first_peer, lane));
      if (first_peer < n && two0) a1 = ld_volatile_v4(peer_vec(first_peer, lane + 32));
    }
    if (i + kWarps < end) load_own(i + kWarps);
    const bool empty = row_empty(t);  // the whole warp, after its loads are in flight
    float mine = lane != me ? 0.0f : empty ? -INFINITY : own_raw_lse;
    if (polls_lse) {
      if (checks_header) lse_word = land_word_with_header(ws, lse_at, lse_word, header_at, header_word, hdr, lane, call);
      else if (lse_word == kSentinel) lse_word = poll_word(ws, lse_at, lane, call);
      *lse_at = kSentinel;
      mine = __uint_as_float(lse_word);
    }
    __syncwarp();
    float lse[kShards];
#pragma unroll
    for (int s = 0; s < kShards; ++s) lse[s] = __shfl_sync(0xffffffffu, mine, s);
    float w[kShards];
    const float L = lse_weights(n, [&](int s) { return lse[s]; }, base2, w);
    if (lane == 0) out_lse[i] = L;
    for (int v0 = lane; v0 < nvec; v0 += 64) {
      const bool second = v0 + 32 < nvec;
      if (v0 != lane) {  // later chunks: load this rank's and the first peer's vectors now
        own0 = own[v0];
        if (second) own1 = own[v0 + 32];
        if constexpr (kAllPeers) {
#pragma unroll
          for (int s = 0; s < kShards; ++s) {
            if (s == me) continue;
            pa0[s] = ld_volatile_v4(peer_vec(s, v0));
            if (second) pa1[s] = ld_volatile_v4(peer_vec(s, v0 + 32));
          }
        } else if (first_peer < n) {
          a0 = ld_volatile_v4(peer_vec(first_peer, v0));
          if (second) a1 = ld_volatile_v4(peer_vec(first_peer, v0 + 32));
        }
      }
      float acc[2][V::kElems];
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) acc[0][e] = acc[1][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < kShards; ++s) {
        if (s >= n) break;
        V x0, x1;
        if (s == me) {
          x0.raw = own0;
          x1.raw = own1;
        } else if constexpr (kAllPeers) {
          // Every vector is waited for, even at weight 0: the buffer is re-filled here.
          uint4* p = peer_vec(s, v0);
          x0.raw = has_sentinel(pa0[s]) ? poll_vector(ws, p, s, call) : pa0[s];
          *p = sentinel4;
          if (second) {
            x1.raw = has_sentinel(pa1[s]) ? poll_vector(ws, p + 32, s, call) : pa1[s];
            p[32] = sentinel4;
          }
        } else {
          // a0/a1 hold peer s's vectors (loaded earlier); wait until they landed.
          // Every vector is waited for, even at weight 0: the buffer is re-filled here.
          uint4* p = peer_vec(s, v0);
          x0.raw = has_sentinel(a0) ? poll_vector(ws, p, s, call) : a0;
          *p = sentinel4;
          if (second) {
            x1.raw = has_sentinel(a1) ? poll_vector(ws, p + 32, s, call) : a1;
            p[32] = sentinel4;
          }
          const int next = s + 1 == me ? s + 2 : s + 1;
          if (next < n) {
            a0 = ld_volatile_v4(peer_vec(next, v0));
            if (second) a1 = ld_volatile_v4(peer_vec(next, v0 + 32));
          }
        }
        if (w[s] == 0.0f) continue;  // a zero-weight payload contributes exactly 0
#pragma unroll
        for (int e = 0; e < V::kElems; ++e) {
          acc[0][e] += w[s] * x0.get(e);
          if (second) acc[1][e] += w[s] * x1.get(e);
        }
      }
      V o0, o1;
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) {
        o0.set(e, acc[0][e]);
        o1.set(e, acc[1][e]);
      }
      uint4* o = reinterpret_cast<uint4*>(out + static_cast<int64_t>(i) * dim);
      o[v0] = o0.raw;
      if (second) o[v0 + 32] = o1.raw;
    }
  }
  if (header_warp && begin + warp >= end && lane < n && lane != me) check_call_header(ws, header(me, lane), hdr, lane, call);
  block_finish_call(ws, call);
}

// The kernels move payloads as 16-byte vectors.
void check_vectorizable(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(t.size(-1) * t.element_size() % 16 == 0, name,
                 "a last dimension of a multiple of 16 bytes on CUDA", t.size(-1) << " elements of "
                 << t.element_size() << " bytes");
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, "a 16-byte aligned data pointer",
                 "address " << t.data_ptr());
}

void lse_combine_cuda(const at::Tensor& partial_out, const at::Tensor& partial_lse, bool base2, at::Tensor& out,
                      at::Tensor& lse) {
  check_vectorizable(partial_out, "partial_out");
  const int64_t n = partial_out.size(0), items = partial_out.size(1) * partial_out.size(2);
  const int64_t dim = partial_out.size(3);
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int grid = static_cast<int>(std::min<int64_t>((items + kWarps - 1) / kWarps, 1024));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_combine", [&] {
    lse_combine_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        partial_out.data_ptr<scalar_t>(), partial_lse.data_ptr<float>(), static_cast<int>(n), items, dim, base2,
        out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_combine(const CombineCall& c, int grid, cudaStream_t stream, bool narrow_mask, const at::Tensor& partial_out,
                    const at::Tensor& partial_lse, bool base2, at::Tensor& out, at::Tensor& out_lse) {
  auto launch = [&](auto kernel) {
    launch_dataflag(kernel, grid, kThreads, stream, partial_out.get_device(), device_workspace(*c.ws), c.geo,
                    partial_out.data_ptr<scalar_t>(), partial_lse.data_ptr<float>(), static_cast<int>(c.rows), base2,
                    out.data_ptr<scalar_t>(), out_lse.data_ptr<float>(), c.header, c.mask);
  };
  static const bool all_peers = kernel_opt_in("SDCP_OLSE_ALL_PEERS");
  auto by_world = [&](auto narrow) {
    constexpr bool kNarrow = decltype(narrow)::value;
    switch (c.ws->world_size) {  // one rank, DCP2, 4 and 8 keep their weights in registers
      case 1: launch(output_lse_kernel<scalar_t, 1, kNarrow>); break;
      case 2: launch(output_lse_kernel<scalar_t, 2, kNarrow>); break;
      case 4:
        if (all_peers) launch(output_lse_kernel<scalar_t, 4, kNarrow, true>);
        else launch(output_lse_kernel<scalar_t, 4, kNarrow>);
        break;
      case 8:
        if (all_peers) launch(output_lse_kernel<scalar_t, 8, kNarrow, true>);
        else launch(output_lse_kernel<scalar_t, 8, kNarrow>);
        break;
      default: launch(output_lse_kernel<scalar_t, 0, kNarrow>);
    }
  };
  if (narrow_mask) by_world(std::true_type{});
  else by_world(std::false_type{});
}

void combine_out_cuda(const CombineCall& c, const at::Tensor& partial_out, const at::Tensor& partial_lse, bool base2,
                      at::Tensor& out, at::Tensor& out_lse) {
  const Workspace& ws = *c.ws;
  check_vectorizable(partial_out, "partial_out");
  check_vectorizable(out, "out");
  check_device_world(ws);
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  // One warp per item; at least one block, even for 0 rows (it advances the call index).
  const int grid = dataflag_grid(c.rows * c.geo.local_heads, kWarps, partial_out.get_device());
  // Items and vector offsets fit in 32 bits (the kernel's index arithmetic).
  SDCP_CHECK_ARG(c.rows * c.geo.local_heads * c.geo.head_dim < (int64_t{1} << 31), "partial_out",
                 "fewer than 2**31 elements of this rank's heads (the CUDA kernel's 32-bit indexing)",
                 c.rows << " rows x " << c.geo.local_heads << " heads x " << c.geo.head_dim << " elements");
  // int32 metadata (vLLM's, or no mask) takes the kernel with the widths fixed at compile time.
  const bool narrow_mask = !c.mask.enabled || (!c.mask.seq_lens_wide && !c.mask.query_start_loc_wide);
  auto launch = [&](auto payload) {
    using scalar_t = decltype(payload);
    launch_combine<scalar_t>(c, grid, stream, narrow_mask, partial_out, partial_lse, base2, out, out_lse);
  };
  switch (partial_out.scalar_type()) {  // the payload dtypes check_partial_inputs admits
    case at::kFloat: launch(float{}); break;
    case at::kHalf: launch(at::Half{}); break;
    case at::kBFloat16: launch(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "output_lse_combine: unchecked payload dtype ", partial_out.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// ---------------------------------------------------------------------------
// lse_correct: the local kernel of the collective Output/LSE path (LSE
// all_gather -> this kernel -> reduce_scatter on heads). One warp per (t, h):
// every lane forms the global LSE from the N gathered LSEs (broadcast loads,
// fp32), then the warp scales the D payload elements as 16-byte vectors, two
// in flight per lane, rounding once, and stores them head-major [H, T, D] so
// that reduce_scatter on dim 0 needs no transpose copy. A zero weight stores
// exact zeros without reading the payload.
// ---------------------------------------------------------------------------

namespace {

constexpr int kCorrectThreads = 256;
constexpr int kCorrectWarps = kCorrectThreads / 32;

// Weight of shard `rank` and the global LSE of one (t, h): the arithmetic of
// lse_weights (semantics.h) in the same order, with no per-shard array (any N).
__device__ __forceinline__ float correct_weight(const float* lse, int64_t stride, int64_t n, int64_t rank,
                                                bool base2, float* L_out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse[i * stride]);
    m = l > m ? l : m;
  }
  if (m == -INFINITY) m = 0.0f;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_sanitize(lse[i * stride]);
    sum += base2 ? exp2f(l - m) : expf(l - m);
  }
  if (sum == 0.0f) {
    *L_out = -INFINITY;
    return 0.0f;
  }
  const float L = m + (base2 ? log2f(sum) : logf(sum));
  *L_out = L;
  const float l = lse_sanitize(lse[rank * stride]);
  return base2 ? exp2f(l - L) : expf(l - L);
}

template <typename scalar_t>
__global__ void lse_correct_kernel(const scalar_t* __restrict__ po, const float* __restrict__ gl, int64_t n,
                                   int64_t rank, int64_t rows, int64_t heads, int64_t dim, bool base2,
                                   scalar_t* __restrict__ out, float* __restrict__ out_lse) {
  using V = Vec<scalar_t>;
  const int64_t items = rows * heads, nvec = dim / V::kElems;
  const int lane = threadIdx.x & 31;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kCorrectWarps + threadIdx.x / 32; i < items;
       i += static_cast<int64_t>(gridDim.x) * kCorrectWarps) {
    float L;
    const float w = correct_weight(gl + i, items, n, rank, base2, &L);
    if (lane == 0) out_lse[i] = L;
    const int64_t t = i / heads, h = i - t * heads;
    uint4* dst = reinterpret_cast<uint4*>(out + (h * rows + t) * dim);
    if (w == 0.0f) {  // exactly 0; the payload (maybe NaN) is never read
      for (int64_t v = lane; v < nvec; v += 32) dst[v] = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const uint4* src = reinterpret_cast<const uint4*>(po + i * dim);
    for (int64_t v0 = lane; v0 < nvec; v0 += 64) {
      const bool second = v0 + 32 < nvec;
      V x0, x1;
      x0.raw = src[v0];
      if (second) x1.raw = src[v0 + 32];
#pragma unroll
      for (int e = 0; e < V::kElems; ++e) {
        x0.set(e, w * x0.get(e));
        if (second) x1.set(e, w * x1.get(e));
      }
      dst[v0] = x0.raw;
      if (second) dst[v0 + 32] = x1.raw;
    }
  }
}

void lse_correct_cuda(const at::Tensor& partial_out, const at::Tensor& gathered_lse, int64_t rank, bool base2,
                      at::Tensor& out, at::Tensor& lse) {
  const int64_t n = gathered_lse.size(0), rows = partial_out.size(0), heads = partial_out.size(1);
  const int64_t dim = partial_out.size(2), items = rows * heads;
  SDCP_CHECK_ARG(dim % 8 == 0, "partial_out", "a last dimension of a multiple of 8 elements on CUDA",
                 dim << " elements");
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(partial_out.data_ptr()) % 16 == 0, "partial_out",
                 "a 16-byte aligned data pointer", "address " << partial_out.data_ptr());
  const c10::cuda::CUDAGuard guard(partial_out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int grid = static_cast<int>(std::min<int64_t>((items + kCorrectWarps - 1) / kCorrectWarps, 4096));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial_out.scalar_type(), "lse_correct", [&] {
    lse_correct_kernel<scalar_t><<<grid, kCorrectThreads, 0, stream>>>(
        partial_out.data_ptr<scalar_t>(), gathered_lse.data_ptr<float>(), n, rank, rows, heads, dim, base2,
        out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("lse_correct", &lse_correct_op<lse_correct_cuda>);
  m.impl("lse_combine", &lse_combine_op<lse_combine_cuda, kMaxDeviceWorld>);
  m.impl("output_lse_combine_out", &output_lse_combine_out_op<combine_out_cuda>);
}

}  // namespace sdcp
