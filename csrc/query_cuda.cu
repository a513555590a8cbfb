// Query boundary, CUDA: the fused RoPE / concatenation / quantisation producer
// and the data-as-flag fan-out of a rank's heads (docs/PROTOCOL.md, version
// 4). A warp handles one (row, local head) item: it produces it once, each
// lane's 16-byte output vectors in registers (produce_item_direct; shapes it
// cannot cut so, and the view's first item, through the warp's shared-memory
// stage), or reads it, for a query produced elsewhere, and stores it as
// canonical 16-byte vectors into every destination; then it polls the peers'
// copies of its items in the local buffer. The copying ops rotate two
// buffers by the call index and re-fill what they read; the zero-copy view is
// one fixed buffer that query_release re-fills and acknowledges.

#include "dataflag.cuh"
#include "query.h"
#include "query_produce.cuh"
#include "semantics.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace sdcp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The local producer has no workspace, hence no error record: a bad position
// prints and traps (the CUDA context fails).
template <typename out_t>
__global__ void query_rope_quant_kernel(ProducerArgs a, out_t* out) {
  __shared__ uint4 rope_stages[kWarps][kMaxRopeBytes / 16];
  const int items = a.rows * a.heads, width = a.nope_dim + a.rope_dim, step = gridDim.x * kWarps;
  int i = blockIdx.x * kWarps + threadIdx.x / 32;
  auto load = [&](int x) {
    const auto th = a.by_heads.divmod(static_cast<unsigned>(x));
    return load_item(a, static_cast<int>(th.div), static_cast<int>(th.mod));
  };
  ItemInputs next;
  if (i < items) next = load(i);
  const ScaleDivider div = scale_divider(a.scale ? *a.scale : 1.0f);
  for (; i < items; i += step) {
    const ItemInputs in = next;
    const int t = static_cast<int>(a.by_heads.div(static_cast<unsigned>(i)));
    if (i + step < items) next = load(i + step);  // in flight meanwhile
    auto bad_position = [&](int64_t pos) {
      if ((threadIdx.x & 31) == 0)
        printf("torch_sdcp: positions[%d] = %lld is outside [0, %lld)\n", t, (long long)pos, (long long)a.max_pos);
      __trap();
    };
    out_t* item = out + static_cast<int64_t>(i) * width;
    if (a.direct) {
      produce_item_direct<out_t>(
          a, div, t, i - t * a.heads, in, rope_stages[threadIdx.x / 32],
          [item](int v, const uint4& x) { reinterpret_cast<uint4*>(item)[v] = x; }, [] {}, bad_position);
    } else {
      produce_item<out_t>(a, t, i - t * a.heads, in, item, [] {}, bad_position);
    }
  }
}

// Bytes of one produced item, staged per warp in dynamic shared memory.
constexpr int kMaxItemBytes = 2048;

// The items of one call, (row, local head) i = t * H_loc + h, as 16-byte vectors.
// Produced: the fused RoPE / quantisation, once per item (query_produce.cuh).
template <typename out_t>
struct Produced {
  using Out = out_t;
  static constexpr bool kStaged = true;
  ProducerArgs a;
};

// Given: a query produced elsewhere, q [T, H_loc, W] packed.
struct Given {
  using Out = uint8_t;
  static constexpr bool kStaged = false;
  const uint4* q;
};

// What a kernel needs of the workspace geometry (QueryGeometry) and the call;
// every index in vectors fits in 32 bits (check_query_range).
struct DeviceQuery {
  int rows, local_heads, nvec;  // nvec: 16-byte vectors per item
  at::cuda::detail::IntDivider<unsigned> by_heads;  // item i = t * local_heads + h
  int entry_vecs;               // vectors of one peer's entry in a rotating buffer
  int64_t view_offset, buffers_offset, buffer_bytes, header_offset;
  uint32_t canonical;
};

__device__ __forceinline__ QueryControl* control_of(const DeviceWorkspace& ws, int r) {
  return reinterpret_cast<QueryControl*>(ws.region(r) + kQueryControlOffset);
}

__device__ __forceinline__ uint4 canonical_vector(uint4 v, uint32_t c) {
  return make_uint4(canonical_word(v.x, c), canonical_word(v.y, c), canonical_word(v.z, c), canonical_word(v.w, c));
}

// A bad position in a workspace call: recorded (kReasonBadInput, dataflag.h)
// and the workspace aborted on every rank, as a timeout is; the kernel goes
// on with the item unrotated and every later poll returns at once, so the
// host raises at its next call or check() and the CUDA context survives.
static __device__ __noinline__ void record_bad_position(const DeviceWorkspace& ws, uint64_t call, int row,
                                                        int64_t pos, int64_t max_pos, uint32_t wait) {
  DataFlagError e{};
  e.state = kReasonBadInput;
  e.block = blockIdx.x;
  e.peer = -1;
  e.wait = wait;  // kWaitViewData: the record names the view buffer and view call
  e.call = call;
  e.field = static_cast<uint32_t>(row);
  const int64_t saturated = pos > INT32_MAX ? INT32_MAX : pos < INT32_MIN ? INT32_MIN : pos;
  e.mine = static_cast<uint32_t>(static_cast<int32_t>(saturated));
  e.theirs = static_cast<uint32_t>(max_pos > UINT32_MAX ? UINT32_MAX : max_pos);
  e.aborter = -1;
  dataflag_record(ws, e, true);
}

// Takes peer `src`'s call header at `h`, whose first load `hv` the caller
// issued with its first data loads: polls it if it had not landed, writes the
// sentinel back and compares (a mismatch is recorded and aborts the
// workspace: every poll then gives up at once). `other` is src's header
// entry of the other kind of call (the view's for a copying call, and the
// reverse): a header there while none arrived at `h` means that src made the
// other kind of call (gather against gather_view), a mismatch of the op
// instead of a timeout. In step, src stores its header of this call before
// its header of any later call of the other kind (a later kernel), so the
// fence and second load below see it.
template <bool kView, typename Other>
__device__ __forceinline__ void land_header(const DeviceWorkspace& ws, uint4* h, uint4 hv, const CallHeader& mine,
                                            int src, uint64_t call, Other other_entry) {
  constexpr uint32_t kWait = kView ? kWaitViewHeader : kWaitHeader;
  if (has_sentinel(hv)) {  // the slow path only: the other entry is found and loaded here
    const uint4* other = other_entry();
    uint4 ov = sentinel_vector();
    hv = poll_until(
        ws, [&] { return ld_volatile_v4(h); },
        [&](const uint4& v) { return !has_sentinel(v) || !has_sentinel(ov = ld_volatile_v4(other)); }, src, call,
        kWait);
    if (has_sentinel(hv) && !has_sentinel(ov)) {
      __threadfence_system();
      hv = ld_volatile_v4(h);
      if (has_sentinel(hv)) {
        dataflag_mismatch(ws, src, call, kHeaderFlags, mine.w[kHeaderFlags], ov.z, kWait);
        return;
      }
    }
  }
  if (has_sentinel(hv)) hv = ld_volatile_v4(h);  // gave up on an abort: the header may have landed since
  *h = sentinel_vector();
  if (has_sentinel(hv)) return;
  const CallHeader theirs{{hv.x, hv.y, hv.z, hv.w}};
  const uint32_t f = call_header_mismatch(mine, theirs, kQueryOpBits);
  if (f == kHeaderFields) {
    if (header_is_void(theirs)) dataflag_void(ws, src, call);
    return;
  }
  // Words selected, not indexed by f: an indexed header would live in local memory.
  auto word = [f](const CallHeader& c) { return f == 0 ? c.w[0] : f == 1 ? c.w[1] : f == 2 ? c.w[2] : c.w[3]; };
  dataflag_mismatch(ws, src, call, f, word(mine), word(theirs), kWait);
}

// Vectors per lane kept in flight (loads issued together, then used).
constexpr int kUnroll = 4;

// One call. Block b owns the items [begin, end) of the same partition on
// every rank (rows and H_loc agree: the call header checks it), stores them
// before it waits, and waits only for the peers' copies of its own items,
// which the peers' block b stores before it waits: the grid is sized to the
// items and need not be co-resident.
//  kView == false (query_gather, query_all_gather_heads_out): this rank's
//    heads go straight into `out`, every peer's copy into its entry of the
//    rotating buffer `call % 2`; the peers' copies are polled, copied into
//    `out` and re-filled with the sentinel at once.
//  kView == true (query_publish): after every peer released the last view
//    call, this rank's heads go into every rank's view (its own included);
//    the peers' copies are polled in place and stay for the reader.
// Call headers: block 0's last warp, lane d for peer d, stores this rank's
// header before any payload and takes the peers' with its first data loads
// (or alone at the end, if it owns no item).
//
// At a few rows the call is one warp's chain of dependent steps, so (as in
// output_lse_kernel) the index arithmetic is 32-bit (64-bit division is a
// software routine), the world size is a template parameter (kN; 0 = any) so
// the peer loops unroll, the first inputs are loaded before the call index
// is read, and each lane keeps kUnroll loads in flight. `ws` is a grid
// constant: the failure paths take its address without a local copy.
template <typename Items, bool kView, int kN>
__global__ void __launch_bounds__(kThreads)
    query_kernel(const __grid_constant__ DeviceWorkspace ws, const DeviceQuery q, const Items items, uint4* out,
                 const __grid_constant__ CallHeader hdr) {
  extern __shared__ __align__(16) uint4 stage_all[];
  constexpr int kMaxN = kN > 0 ? kN : kMaxDeviceWorld;
  pdl_wait_and_release();
  const int n = kN > 0 ? kN : ws.world, me = ws.rank, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int hl = q.local_heads, nvec = q.nvec, total = q.rows * hl;
  const int grid = static_cast<int>(gridDim.x);
  const int per_block = (total + grid - 1) / grid;
  const int begin = min(total, static_cast<int>(blockIdx.x) * per_block), end = min(total, begin + per_block);
  const int first = begin + warp;
  uint4* const stage = stage_all + (Items::kStaged ? warp * nvec : 0);
  // The direct producer's rope stage, after every warp's item stage (Produced only).
  uint4* const rope_stage = stage_all + (Items::kStaged ? kWarps * nvec + warp * (kMaxRopeBytes / 16) : 0);
  const bool header_warp = blockIdx.x == 0 && warp == kWarps - 1;
  const bool header_lane = header_warp && lane < n && lane != me;
  // The view call: every thread loads it (one load per warp); it changes only
  // in query_release, a later kernel. The copying calls read the call index
  // lazily, once the first inputs are in flight.
  uint64_t call = 0;
  if constexpr (kView) call = *reinterpret_cast<volatile uint64_t*>(&control_of(ws, me)->view_call);
  bool have_call = kView;
  // [row][src * H_loc + h]: item i = t * H_loc + h of source s.
  auto row_of = [&](int i) { return static_cast<int>(q.by_heads.div(static_cast<unsigned>(i))); };
  auto gathered = [&](int i, int s) {
    const int t = row_of(i);
    return (t * n + s) * hl + (i - t * hl);
  };
  auto entry = [&](int dst, int src) {  // src's entry in dst's rotating buffer of this call
    return reinterpret_cast<uint4*>(ws.slot_data(dst, 0) + q.buffers_offset +
                                    static_cast<int64_t>(call % kDataFlagBuffers) * q.buffer_bytes) +
           static_cast<int64_t>(ws.peer_slot(src, dst)) * q.entry_vecs;
  };
  auto view_of = [&](int r) { return reinterpret_cast<uint4*>(ws.slot_data(r, 0) + q.view_offset); };
  auto header = [&](int dst, int src) {
    const int set = kView ? static_cast<int>(kQueryViewHeaders) : static_cast<int>(call % kDataFlagBuffers);
    return reinterpret_cast<uint4*>(ws.slot_data(dst, 0) + q.header_offset) + set * (n - 1) + ws.peer_slot(src, dst);
  };
  auto other_header = [&](int src) {  // src's header of the other kind of call here: a view's, or the next copying one's
    const int set = kView ? static_cast<int>(ld_volatile_u64(&ws.dataflag_control()->call_index[0]) % kDataFlagBuffers)
                          : static_cast<int>(kQueryViewHeaders);
    return reinterpret_cast<const uint4*>(ws.slot_data(me, 0) + q.header_offset) + set * (n - 1) +
           ws.peer_slot(src, me);
  };
  auto begin_call = [&] {  // copying calls: the call index, then this rank's headers before any payload
    call = block_call_index(ws);
    have_call = true;
    if (header_lane) store_call_header(header(lane, me), hdr);
  };
  // The first inputs of item i (Produced only: load_item).
  auto load = [&](int i) {
    ItemInputs in{};
    if constexpr (Items::kStaged) {
      const int t = row_of(i);
      in = load_item(items.a, t, i - t * hl);
    }
    return in;
  };
  // Vector v of item i, whose first vector is at `mine` of the gathered
  // layout, into every destination: each rank's view, or this rank's output
  // and every peer's entry of this call.
  auto store_vector = [&](int i, int mine, int v, const uint4& val) {
    if constexpr (kView) {
#pragma unroll
      for (int d = 0; d < kMaxN; ++d)
        if (d < n) view_of(d)[mine + v] = val;
    } else {
      out[mine + v] = val;
#pragma unroll
      for (int d = 0; d < kMaxN; ++d)
        if (d < n && d != me) entry(d, me)[static_cast<int64_t>(i) * nvec + v] = val;
    }
  };
  // The producers' hooks: the call index once the first inputs are in flight,
  // and a position outside the cache recorded.
  auto loaded = [&] {
    if (!have_call) begin_call();
  };
  auto bad_position = [&](int t, int64_t pos) {
    if constexpr (Items::kStaged)
      if (lane == 0) record_bad_position(ws, call, t, pos, items.a.max_pos, kView ? kWaitViewData : kWaitData);
  };
  // Produces item i straight into every destination (Produced with a.direct):
  // as store() below, vector by vector as the lanes convert them; with
  // `to_stage`, into the warp's stage instead, for store() to store later.
  auto produce_direct = [&](int i, const ItemInputs& in, const ScaleDivider& div, bool to_stage) {
    if constexpr (Items::kStaged) {
      const int t = row_of(i);
      const int mine = gathered(i, me) * nvec;
      produce_item_direct<typename Items::Out>(
          items.a, div, t, i - t * hl, in, rope_stage,
          [&](int v, const uint4& val) {
            if (to_stage) stage[v] = val;
            else store_vector(i, mine, v, val);
          },
          loaded, [&](int64_t pos) { bad_position(t, pos); });
    }
  };
  // Produces item i, its first inputs loaded, into the warp's stage (Produced only).
  auto produce = [&](int i, const ItemInputs& in) {
    if constexpr (Items::kStaged) {
      const int t = row_of(i);
      produce_item(
          items.a, t, i - t * hl, in, reinterpret_cast<typename Items::Out*>(stage), loaded,
          [&](int64_t pos) { bad_position(t, pos); });
      __syncwarp();
    }
  };
  // Stores item i (its vectors at x: the stage, or the input) into every destination.
  auto store = [&](int i, const uint4* x) {
    const int mine = gathered(i, me) * nvec;
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if (v < nvec) buf[u] = x[v];
      }
      if (!have_call) begin_call();  // while the first inputs are in flight
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if (v >= nvec) continue;
        store_vector(i, mine, v, canonical_vector(buf[u], q.canonical));
      }
    }
    __syncwarp();  // the stage is rewritten by the next item
  };

  // 1. Store this rank's items.
  if constexpr (kView) {
    // The first item is produced while the last warp waits for the releases
    // (one lane per peer); a wait that gave up stores nothing, since a peer's
    // reader may still read its view.
    ItemInputs next{};
    const ScaleDivider div = scale_divider(items.a.scale ? *items.a.scale : 1.0f);
    if (first < end) {
      if (items.a.direct) produce_direct(first, load(first), div, true);
      else produce(first, load(first));
      __syncwarp();  // the stage is read by other lanes in store()
    }
    bool gave_up = false;
    if (threadIdx.x == 0) {  // a peer's abort that no poll may meet
      const uint64_t a = ld_volatile_u64(own_abort_word(ws));
      if (a != 0) {
        dataflag_give_up(ws, -1, call, a, kWaitViewData);
        gave_up = true;
      }
    }
    if (warp == kWarps - 1) {
      const QueryControl* c = control_of(ws, me);
      for (int s = lane; s < n; s += 32) {
        if (s == me) continue;
        const uint64_t got = poll_until(
            ws, [&] { return ld_acquire_sys(&c->released[s]); }, [&](uint64_t v) { return v >= call; }, s, call,
            kWaitViewRelease);
        gave_up = gave_up || got < call;
      }
    }
    if (__syncthreads_or(gave_up)) return;
    if (header_lane) store_call_header(header(lane, me), hdr);
    if (first + kWarps < end) next = load(first + kWarps);
    if (first < end) store(first, stage);
    // The later items go straight into the views where the shape allows it.
    for (int i = first + kWarps; i < end; i += kWarps) {
      const ItemInputs in = next;
      if (i + kWarps < end) next = load(i + kWarps);  // in flight while item i is converted
      if (items.a.direct) {
        produce_direct(i, in, div, false);
      } else {
        produce(i, in);
        store(i, stage);
      }
    }
  } else {
    ItemInputs next{};
    if (first < end) next = load(first);
    ScaleDivider div{};
    if constexpr (Items::kStaged) div = scale_divider(items.a.scale ? *items.a.scale : 1.0f);
    for (int i = first; i < end; i += kWarps) {
      if constexpr (Items::kStaged) {
        const ItemInputs in = next;
        if (i + kWarps < end) next = load(i + kWarps);  // in flight while item i is converted
        if (items.a.direct) {
          produce_direct(i, in, div, false);
        } else {
          produce(i, in);
          store(i, stage);
        }
      } else {
        store(i, items.q + static_cast<int64_t>(i) * nvec);
      }
    }
    if (!have_call) begin_call();
  }

  // 2. Wait for the peers' copies of the same items, (peer, vector) pairs
  //    flattened over the lanes, kUnroll loads in flight per lane. The header
  //    lanes take the peers' headers with their first loads.
  const int pairs = (n - 1) * nvec;
  const uint4 sentinel4 = sentinel_vector();
  // This lane's first pair: peer index k0 (0 .. n-2), vector v0; later pairs step by 32.
  const int k0 = lane / nvec, v0 = lane - k0 * nvec;
  bool header_pending = header_lane;
  for (int i = first; i < end; i += kWarps) {
    int k = k0, v = v0;
    for (int base = 0; base < pairs; base += 32 * kUnroll) {
      uint4 got[kUnroll];
      uint4* at[kUnroll];
      int src[kUnroll];
      int64_t to[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = me + 1 + k < n ? me + 1 + k : me + 1 + k - n;
        src[u] = s;
        if (base + u * 32 + lane < pairs) {
          const int g = gathered(i, s) * nvec + v;
          at[u] = kView ? view_of(me) + g : entry(me, s) + static_cast<int64_t>(i) * nvec + v;
          to[u] = g;
          got[u] = ld_volatile_v4(at[u]);
        }
        for (v += 32; v >= nvec; v -= nvec) ++k;
      }
      if (header_pending) {  // its load issued beside the first data loads
        header_pending = false;
        uint4* h = header(me, lane);
        land_header<kView>(ws, h, ld_volatile_v4(h), hdr, lane, call, [&] { return other_header(lane); });
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * 32 + lane >= pairs) continue;
        const uint4 val =
            has_sentinel(got[u]) ? poll_vector(ws, at[u], src[u], call, kView ? kWaitViewData : kWaitData) : got[u];
        if constexpr (!kView) {
          out[to[u]] = val;
          *at[u] = sentinel4;
        }
      }
    }
  }
  if (header_pending) {  // the header warp owns no item
    uint4* h = header(me, lane);
    land_header<kView>(ws, h, ld_volatile_v4(h), hdr, lane, call, [&] { return other_header(lane); });
  }
  if constexpr (!kView) block_finish_call(ws, call);
}

// The reader of the view is done: re-fill the peers' heads of the first `rows`
// rows with the sentinel, then the last block to finish (a grid of one block
// without the arrival counter) tells every producer
// (one release store per peer, after a system fence that orders every block's
// re-fill before it) and advances the view call. The fences wait for local
// stores only, and the kernel runs after the reader, off the producers'
// critical path. Launched programmatically: it waits for the reader (the
// previous kernel) before it re-fills anything.
__global__ void __launch_bounds__(kThreads) query_release_kernel(const __grid_constant__ DeviceWorkspace ws,
                                                                 const DeviceQuery q) {
  pdl_wait_and_release();
  const int n = ws.world, me = ws.rank;
  const int head_vecs = q.local_heads * q.nvec;  // one source's heads of one row
  const int per_row = (n - 1) * head_vecs, total = q.rows * per_row;
  uint4* view = reinterpret_cast<uint4*>(ws.slot_data(me, 0) + q.view_offset);
  const uint4 sentinel = sentinel_vector();
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  for (int x = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); x < total; x += stride) {
    const int t = x / per_row, r = x - t * per_row, k = r / head_vecs;
    const int s = me + 1 + k < n ? me + 1 + k : me + 1 + k - n;
    view[(t * n + s) * head_vecs + (r - k * head_vecs)] = sentinel;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's re-fill (ordered by the barrier) before its arrival
    QueryControl* c = control_of(ws, me);
    // One block (a few rows) is the last by itself: no arrival, and its fence above orders its re-fill.
    const bool last = gridDim.x == 1 || atomicAdd(&c->release_arrived, 1u) == gridDim.x - 1;
    if (last) {
      if (gridDim.x > 1) {
        __threadfence_system();  // every block's re-fill before the releases
        c->release_arrived = 0;
      }
      const uint64_t call = *reinterpret_cast<volatile uint64_t*>(&c->view_call);
      for (int d = 0; d < n; ++d)
        if (d != me) st_release_sys(&control_of(ws, d)->released[me], call + 1);
      *reinterpret_cast<volatile uint64_t*>(&c->view_call) = call + 1;
    }
  }
}

// The kernels index vectors with 32-bit ints: the largest index is a vector
// of the view, [max_rows][N * H_loc][nvec] (the rotating buffers, the headers
// and a call's output are smaller).
void check_query_range(const Workspace& ws, const QueryGeometry& g) {
  const int64_t view_vecs = g.max_rows * ws.world_size * g.local_heads * (g.item_bytes() / 16);
  SDCP_CHECK_ARG(view_vecs < (int64_t{1} << 31), "max_rows, local_heads, head_dim",
                 "a view of fewer than 2**31 16-byte vectors (the CUDA kernels' 32-bit indexing)",
                 g.max_rows << " rows x " << ws.world_size << " ranks x " << g.local_heads << " heads x "
                            << g.item_bytes() << " bytes");
}

DeviceQuery device_query(const Workspace& ws, const QueryGeometry& g, int64_t rows) {
  check_query_range(ws, g);
  const int64_t nvec = g.item_bytes() / 16;
  return {static_cast<int>(rows), static_cast<int>(g.local_heads), static_cast<int>(nvec),
          at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(std::max<int64_t>(g.local_heads, 1))),
          static_cast<int>(g.max_rows * g.local_heads * nvec), g.view_offset, g.buffers_offset, g.buffer_bytes,
          g.header_offset, g.canonical};
}

// The kernels move items as 16-byte vectors; a produced item is staged in at
// most kMaxItemBytes of shared memory.
void check_item_bytes(const QueryGeometry& g, const char* arg, bool staged) {
  const int64_t limit = staged ? kMaxItemBytes : kMaxRegionBytes;
  SDCP_CHECK_ARG(g.item_bytes() % 16 == 0 && g.item_bytes() <= limit, arg,
                 "heads of a multiple of 16 bytes" << (staged ? ", at most 2048," : "") << " on CUDA",
                 g.head_dim << " elements of " << g.elem_bytes << " bytes");
}

ProducerArgs producer_args(const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                           const at::Tensor& cache, const std::optional<at::Tensor>& q_scale, bool neox,
                           const QueryShape& s, at::ScalarType out_dtype) {
  ProducerArgs a;
  a.nope = ql_nope.data_ptr<c10::BFloat16>();
  a.pe = q_pe.data_ptr<c10::BFloat16>();
  a.positions = positions.data_ptr();
  a.cache = cache.data_ptr();
  a.scale = q_scale.has_value() ? q_scale->data_ptr<float>() : nullptr;
  a.nope_s0 = ql_nope.stride(0);
  a.nope_s1 = ql_nope.stride(1);
  a.pe_s0 = q_pe.stride(0);
  a.pe_s1 = q_pe.stride(1);
  a.pos_s0 = positions.stride(0);
  // Items (row, head) and offsets inside an item are 32-bit in the kernels.
  SDCP_CHECK_ARG(s.rows * s.heads < (int64_t{1} << 30) && s.width() < (int64_t{1} << 30), "ql_nope",
                 "fewer than 2**30 (row, head) items and elements per head (the CUDA kernels' 32-bit indexing)",
                 s.rows << " rows x " << s.heads << " heads of " << s.width() << " elements");
  a.rows = static_cast<int>(s.rows);
  a.heads = static_cast<int>(s.heads);
  a.by_heads = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(std::max<int64_t>(s.heads, 1)));
  a.nope_dim = static_cast<int>(s.nope);
  a.rope_dim = static_cast<int>(s.rope);
  a.max_pos = cache.size(0);
  a.pos64 = positions.scalar_type() == at::kLong;
  a.cache_f32 = cache.scalar_type() == at::kFloat;
  a.neox = neox;
  a.vec_nope = s.nope % 8 == 0 && a.nope_s0 % 8 == 0 && a.nope_s1 % 8 == 0 &&
               reinterpret_cast<uintptr_t>(a.nope) % 16 == 0;
  const bool fp8 = out_dtype == at::kFloat8_e4m3fn;
  a.direct = direct_layout(a, fp8 ? 1 : 2);
  a.nope_pairs = a.direct && fp8;
  return a;
}

void rope_quant_cuda(const QueryShape& s, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                  at::ScalarType out_dtype, at::Tensor& out) {
  const int64_t items = s.rows * s.heads;
  const c10::cuda::CUDAGuard guard(ql_nope.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto a = producer_args(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, s, out_dtype);
  const int grid = static_cast<int>(std::min<int64_t>((items + kWarps - 1) / kWarps, 1024));
  if (out_dtype == at::kFloat8_e4m3fn) {
    query_rope_quant_kernel<c10::Float8_e4m3fn>
        <<<grid, kThreads, 0, stream>>>(a, static_cast<c10::Float8_e4m3fn*>(out.data_ptr()));
  } else {
    query_rope_quant_kernel<c10::BFloat16><<<grid, kThreads, 0, stream>>>(a, out.data_ptr<c10::BFloat16>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches query_kernel<Items, kView, kN> with the world size as a template
// parameter where it is 1, 2, 4 or 8 (0: any), programmatically (launch_dataflag).
template <typename Items, bool kView>
void launch_query(const Workspace& ws, int grid, size_t shared_bytes, int device, const DeviceQuery& dq,
                  const Items& items, uint4* out, const CallHeader& header) {
  auto stream = at::cuda::getCurrentCUDAStream();
  auto go = [&](auto kernel) {
    launch_dataflag(kernel, grid, kThreads, shared_bytes, stream, device, device_workspace(ws), dq, items, out, header);
  };
  switch (ws.world_size) {
    case 1: go(query_kernel<Items, kView, 1>); break;
    case 2: go(query_kernel<Items, kView, 2>); break;
    case 4: go(query_kernel<Items, kView, 4>); break;
    case 8: go(query_kernel<Items, kView, 8>); break;
    default: go(query_kernel<Items, kView, 0>);
  }
}

// Launches the gather kernel (copying), or the publish kernel (view).
void gather_cuda(const QueryCall& c, const at::Tensor& ql_nope, const at::Tensor& q_pe, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_scale, bool neox,
                 at::ScalarType out_dtype, bool view) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);  // the header lanes are one warp
  check_item_bytes(c.geo, "ql_nope, q_pe", true);
  const c10::cuda::CUDAGuard guard(ql_nope.device());
  const auto a = producer_args(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, c.shape, out_dtype);
  const auto dq = device_query(ws, c.geo, c.shape.rows);
  // One warp per item; at least one block. Each warp stages one item (the
  // view's first, or every item of a shape without the direct producer) and a
  // direct item's rope pairs.
  const int grid = dataflag_grid(c.shape.rows * c.shape.heads, kWarps, ql_nope.get_device());
  const size_t stage = static_cast<size_t>(kWarps) * (c.geo.item_bytes() + kMaxRopeBytes);
  auto* out = c.out ? static_cast<uint4*>(c.out->data_ptr()) : nullptr;
  auto launch = [&](auto items) {
    using Items = decltype(items);
    if (view) launch_query<Items, true>(ws, grid, stage, ql_nope.get_device(), dq, items, nullptr, c.header);
    else launch_query<Items, false>(ws, grid, stage, ql_nope.get_device(), dq, items, out, c.header);
  };
  if (out_dtype == at::kFloat8_e4m3fn) launch(Produced<c10::Float8_e4m3fn>{a});
  else launch(Produced<c10::BFloat16>{a});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_aligned(const at::Tensor& t, const char* name) {
  SDCP_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, "a 16-byte aligned data pointer on CUDA",
                 "address " << t.data_ptr());
}

void all_gather_heads_cuda(const HeadsCall& c, const at::Tensor& q, at::Tensor& out) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  check_item_bytes(c.geo, "q", false);
  check_aligned(q, "q");
  check_aligned(out, "out");
  const c10::cuda::CUDAGuard guard(q.device());
  const auto dq = device_query(ws, c.geo, c.rows);
  const int grid = dataflag_grid(c.rows * c.geo.local_heads, kWarps, q.get_device());
  launch_query<Given, false>(ws, grid, 0, q.get_device(), dq, Given{static_cast<const uint4*>(q.data_ptr())},
                             static_cast<uint4*>(out.data_ptr()), c.header);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void release_cuda(const ReleaseCall& c, const at::Tensor& view) {
  const Workspace& ws = *c.ws;
  check_device_world(ws);
  check_item_bytes(c.geo, "inbox", false);
  const c10::cuda::CUDAGuard guard(view.device());
  const auto dq = device_query(ws, c.geo, c.rows);
  // Up to 8 re-filled vectors per thread, so that a few rows (DCP8 at 1 row: 2,016 vectors) take one
  // block, which acknowledges without an arrival counter; at least one block (it acknowledges).
  constexpr int kReleaseVectorsPerThread = 8;
  const int grid = dataflag_grid(c.rows * (ws.world_size - 1) * c.geo.local_heads * dq.nvec,
                                 kThreads * kReleaseVectorsPerThread, view.get_device());
  launch_dataflag(query_release_kernel, grid, kThreads, at::cuda::getCurrentCUDAStream(), view.get_device(),
                 device_workspace(ws), dq);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(sdcp, CUDA, m) {
  m.impl("query_rope_quant", &query_rope_quant_op<rope_quant_cuda>);
  m.impl("query_gather", &query_gather_op<gather_cuda>);
  m.impl("query_publish", &query_publish_op<gather_cuda>);
  m.impl("query_release", &query_release_op<release_cuda>);
  m.impl("query_all_gather_heads_out", &query_all_gather_heads_out_op<all_gather_heads_cuda>);
}

}  // namespace sdcp
