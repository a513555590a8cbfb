// Data-as-flag signalling on the GPU (dataflag.h has the protocol): the call
// index, bounded polls of local buffers, stores into peers' buffers, call
// headers, and failures that are reported (an error record and abort words),
// not trapped.
#pragma once

#include "device_signal.cuh"
#include "dataflag.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

namespace sdcp {

// Programmatic dependent launch (sm_90+): a kernel launched with
// launch_dataflag may start while the previous kernel of the stream finishes;
// it waits here, before it reads anything, until that kernel has completed
// and its memory is visible. Then it lets the next kernel start its launch.
__device__ __forceinline__ void pdl_wait_and_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

static __device__ __noinline__ void dataflag_give_up(const DeviceWorkspace& ws, int src, uint64_t call, uint64_t abort,
                                                    uint32_t wait);
static __device__ __noinline__ void dataflag_mismatch(const DeviceWorkspace& ws, int src, uint64_t call, uint32_t field,
                                                     uint32_t mine, uint32_t theirs, uint32_t wait);
static __device__ __noinline__ void dataflag_void(const DeviceWorkspace& ws, int src, uint64_t call);

// What a wait does when it gives up (a timeout or an abort word), meets a
// mismatching call header or a void one. ReportNow, every kernel's but
// top-K's, records at once through the out-of-line functions below. A call
// site costs a 1,024-thread kernel (64 registers) spills throughout its body,
// so the top-K merge passes its own policy instead (topk_cuda.cu): it keeps
// the first failure in shared memory, makes the block's later waits return at
// once (`failed`), and records it inline, without printing, after its loop.
struct ReportNow {
  const DeviceWorkspace& ws;
  __device__ __forceinline__ bool failed() const { return false; }
  __device__ __forceinline__ void give_up(int src, uint64_t call, uint64_t abort, uint32_t wait) const {
    dataflag_give_up(ws, src, call, abort, wait);
  }
  __device__ __forceinline__ void mismatch(int src, uint64_t call, uint32_t field, uint32_t mine,
                                           uint32_t theirs) const {
    dataflag_mismatch(ws, src, call, field, mine, theirs, kWaitHeader);
  }
  __device__ __forceinline__ void voided(int src, uint64_t call) const { dataflag_void(ws, src, call); }
};

// The call this kernel runs, read by every warp from its block's counter
// (dataflag.h). Also advances the counters of the blocks this grid does not
// have (b + g, b + 2g, ...): no block of this grid reads them. Thread 0 loads
// the abort word beside the counter (both in flight, no added step) and
// records a peer's abort that no poll may meet (every word already landed),
// so that the host raises at its next call. The kernel has waited for the
// previous one (pdl_wait_and_release, its first step) before it gets here.
template <typename Fail>
__device__ __forceinline__ uint64_t block_call_index(const DeviceWorkspace& ws, const Fail& fail) {
  DataFlagControl* c = ws.dataflag_control();
  uint64_t* counters = c->call_index;
  uint64_t call = 0, abort = 0;
  if ((threadIdx.x & 31) == 0) {
    call = *reinterpret_cast<volatile uint64_t*>(&counters[blockIdx.x]);
    if (threadIdx.x == 0) abort = *reinterpret_cast<volatile uint64_t*>(&c->abort);
  }
  call = __shfl_sync(0xffffffffu, call, 0);
  if (abort != 0) fail.give_up(-1, call, abort, kWaitData);
  for (uint32_t j = blockIdx.x + gridDim.x * (threadIdx.x + 1); j < kDataFlagBlocks; j += gridDim.x * blockDim.x)
    counters[j] = call + 1;
  return call;
}

__device__ __forceinline__ uint64_t block_call_index(const DeviceWorkspace& ws) {
  return block_call_index(ws, ReportNow{ws});
}

// Advances this block's own counter once every warp has read it. A plain
// store: the next call is another kernel (or waits in pdl_wait_and_release
// until this grid completed), and a fence here would wait for this thread's
// stores into peer memory to be acknowledged.
__device__ __forceinline__ void block_finish_call(const DeviceWorkspace& ws, uint64_t call) {
  __syncthreads();
  if (threadIdx.x == 0) ws.dataflag_control()->call_index[blockIdx.x] = call + 1;
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return v.x == kSentinel || v.y == kSentinel || v.z == kSentinel || v.w == kSentinel;
}

__device__ __forceinline__ uint4 canonical_payload(uint4 v) {
  return make_uint4(canonical_payload_word(v.x), canonical_payload_word(v.y), canonical_payload_word(v.z),
                    canonical_payload_word(v.w));
}

__device__ __forceinline__ void st_volatile_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 sentinel_vector() { return make_uint4(kSentinel, kSentinel, kSentinel, kSentinel); }

// ---- Failure handling (docs/PROTOCOL.md "Failure behaviour") -------------
//
// A thread that gives up (timeout, call mismatch, or a peer's abort word seen
// in a poll's slow path) claims this rank's error record once per workspace,
// writes it (volatile stores, system fence, then `state`), and for its own
// failures stores this rank's abort word into every rank's control region,
// its own included. Then it returns: every later poll on this rank (this
// kernel or a later one) finds the abort word in its slow path and returns at
// once, so the kernel ends quickly with undefined output, and the host raises
// at its next call or check(). Without a record (no host-mapped memory) it
// prints and traps, as before.
//
// kPrint: also print the reason. printf is a call; the functions below that
// print are out of line (one call site per failure path). The top-K merge,
// which can afford no call site at all, records inline without printing (its
// host error carries the same fields).
template <bool kPrint>
__device__ __forceinline__ void record_failure(const DeviceWorkspace& ws, const DataFlagError& e, bool broadcast) {
  if (ws.error == nullptr) {
    if constexpr (kPrint)
      printf("torch_sdcp: rank %d block %d gave up on peer %d (workspace %lld, buffer %d, call %llu, reason %u) "
             "with no error record; trapping\n", ws.rank, blockIdx.x, e.peer, (long long)ws.handle,
             (int)(e.call % kDataFlagBuffers), (unsigned long long)e.call, e.state);
    __trap();
  }
  // Two records, each claimed once (atomicCAS) and written by its claimant
  // alone: this rank's own failure, and a peer's abort seen here. The host
  // reads the own one first (a mismatch names both sides; the abort it raced
  // with does not), so an own failure met after a peer's abort still wins,
  // and no record mixes two writers' fields.
  DataFlagControl* c = ws.dataflag_control();
  const bool own = e.state != kReasonPeerAbort;
  if (atomicCAS(own ? &c->error_claim : &c->peer_abort_claim, 0u, 1u) != 0u) return;
  volatile DataFlagError* r = own ? ws.error : &reinterpret_cast<DataFlagRecords*>(ws.error)->peer_abort;
  if constexpr (kPrint) {
    if (e.state == kReasonTimeout)
      printf("torch_sdcp: timeout: rank %d block %d waited %.3f s for peer %d%s (workspace %lld, %s %d, "
             "call %llu); the peer stopped participating, skipped the call, took the collective path, or calls "
             "differ between ranks\n", ws.rank, blockIdx.x, ws.timeout_ns * 1e-9, e.peer,
             e.wait == kWaitViewRelease ? " to release the previous view call"
                                        : dataflag_wait_is_header(e.wait) ? "'s call header" : "'s data",
             (long long)ws.handle, dataflag_wait_is_view(e.wait) ? "view buffer, view call" : "buffer",
             dataflag_wait_is_view(e.wait) ? (int)e.call : (int)(e.call % kDataFlagBuffers),
             (unsigned long long)e.call);
    else if (e.state == kReasonBadInput)
      printf("torch_sdcp: bad input: rank %d block %d: positions[%u] = %d is outside [0, %u) (workspace %lld, call "
             "%llu)\n", ws.rank, blockIdx.x, e.field, (int)e.mine, e.theirs, (long long)ws.handle,
             (unsigned long long)e.call);
    else if (e.state == kReasonMismatch)
      printf("torch_sdcp: call mismatch: rank %d block %d, peer %d, header field %u: this rank 0x%08x, the peer "
             "0x%08x (workspace %lld, buffer %d, call %llu)\n", ws.rank, blockIdx.x, e.peer, e.field, e.mine,
             e.theirs, (long long)ws.handle, (int)(e.call % kDataFlagBuffers), (unsigned long long)e.call);
  }
  r->block = e.block;
  r->peer = e.peer;
  r->wait = e.wait;
  r->call = e.call;
  r->field = e.field;
  r->mine = e.mine;
  r->theirs = e.theirs;
  r->aborter = e.aborter;
  r->abort_reason = e.abort_reason;
  __threadfence_system();
  r->state = e.state;
  if (broadcast) {
    // This thread's stores (the header lane's own call header) land before its abort word.
    __threadfence_system();
    const uint64_t word = dataflag_abort_word(ws.rank, e.state);
    for (int rank = 0; rank < ws.world; ++rank) {
      uint64_t* a = &reinterpret_cast<DataFlagControl*>(ws.region(rank))->abort;
      if (ld_volatile_u64(a) == 0) st_volatile_u64(a, word);
    }
  }
  __threadfence_system();
}

static __device__ __noinline__ void dataflag_record(const DeviceWorkspace& ws, DataFlagError e, bool broadcast) {
  record_failure<true>(ws, e, broadcast);
}

template <bool kPrint>
__device__ __forceinline__ void record(const DeviceWorkspace& ws, const DataFlagError& e, bool broadcast) {
  if constexpr (kPrint) dataflag_record(ws, e, broadcast);
  else record_failure<false>(ws, e, broadcast);
}

// A poll's slow path ends here: `abort` is this rank's abort word as the
// poll last read it (0: none, so the wait timed out).
template <bool kPrint>
__device__ __forceinline__ void record_give_up(const DeviceWorkspace& ws, int src, uint64_t call, uint64_t abort,
                                               uint32_t wait) {
  DataFlagError e{};
  e.block = blockIdx.x;
  e.peer = src;
  e.wait = wait;
  e.call = call;
  e.aborter = -1;
  if (abort != 0) {
    if (abort_word_rank(abort) == ws.rank) return;  // this rank's own failure, recorded by whoever set it
    e.state = kReasonPeerAbort;
    e.aborter = abort_word_rank(abort);
    e.abort_reason = abort_word_reason(abort);
    record<kPrint>(ws, e, false);  // the aborter told every rank
  } else {
    e.state = kReasonTimeout;
    record<kPrint>(ws, e, true);
  }
}

static __device__ __noinline__ void dataflag_give_up(const DeviceWorkspace& ws, int src, uint64_t call, uint64_t abort,
                                                    uint32_t wait) {
  record_give_up<true>(ws, src, call, abort, wait);
}

__device__ __forceinline__ const uint64_t* own_abort_word(const DeviceWorkspace& ws) {
  return &ws.dataflag_control()->abort;
}

// The bounded poll every wait uses: `load()` until `landed(v)`, with this
// rank's abort word loaded beside each retry (the slow path only: both in
// flight at once, so the check adds no step); gives up through `fail` on a
// timeout, an abort or the policy's own earlier failure, and returns the last
// value loaded.
template <typename Load, typename Landed, typename Fail>
__device__ __forceinline__ auto poll_until(const DeviceWorkspace& ws, Load load, Landed landed, int src,
                                           uint64_t call, uint32_t wait, const Fail& fail) {
  auto v = load();
  if (landed(v)) return v;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    const uint64_t a = ld_volatile_u64(own_abort_word(ws));
    v = load();
    if (landed(v)) return v;
    if (a != 0 || globaltimer_ns() - start > ws.timeout_ns || fail.failed()) {
      fail.give_up(src, call, a, wait);
      return v;
    }
  }
}

template <typename Load, typename Landed>
__device__ __forceinline__ auto poll_until(const DeviceWorkspace& ws, Load load, Landed landed, int src,
                                           uint64_t call, uint32_t wait) {
  return poll_until(ws, load, landed, src, call, wait, ReportNow{ws});
}

// Polls a 16-byte vector of a local buffer until no word is the sentinel (or
// the wait gives up: then the vector may hold sentinel words).
template <typename Fail>
__device__ __forceinline__ uint4 poll_vector(const DeviceWorkspace& ws, const uint4* p, int src, uint64_t call,
                                             uint32_t wait, const Fail& fail) {
  return poll_until(
      ws, [&] { return ld_volatile_v4(p); }, [](const uint4& v) { return !has_sentinel(v); }, src, call, wait, fail);
}

__device__ __forceinline__ uint4 poll_vector(const DeviceWorkspace& ws, const uint4* p, int src, uint64_t call,
                                             uint32_t wait = kWaitData) {
  return poll_vector(ws, p, src, call, wait, ReportNow{ws});
}

__device__ __forceinline__ uint32_t poll_word(const DeviceWorkspace& ws, const uint32_t* p, int src, uint64_t call,
                                              uint32_t wait = kWaitData) {
  return poll_until(
      ws, [&] { return ld_volatile_u32(p); }, [](uint32_t v) { return v != kSentinel; }, src, call, wait);
}

// Polls a tagged 64-bit word until it carries `tag` in its high half.
__device__ __forceinline__ uint32_t poll_tagged(const DeviceWorkspace& ws, const uint64_t* p, uint32_t tag, int src,
                                                uint64_t call, uint32_t wait = kWaitData) {
  return static_cast<uint32_t>(poll_until(
      ws, [&] { return ld_volatile_u64(p); }, [&](uint64_t v) { return static_cast<uint32_t>(v >> 32) == tag; }, src,
      call, wait));
}

// ---- Call headers (dataflag.h) ---------------------------------------------
//
// Each producer stores its CallHeader into every consumer's header entry
// (one per peer and buffer) before its payload; the consumer compares the
// peer's header with its own. One warp per kernel does it (block 0's last
// warp: lane s for peer s), so every other warp polls only payload.

__device__ __forceinline__ uint4 header_vector(const CallHeader& h) { return make_uint4(h.w[0], h.w[1], h.w[2], h.w[3]); }

// A peer's header that differs from this rank's: a call mismatch (`wait`:
// the call's header, or the query view's).
template <bool kPrint>
__device__ __forceinline__ void record_mismatch(const DeviceWorkspace& ws, int src, uint64_t call, uint32_t field,
                                                uint32_t mine, uint32_t theirs, uint32_t wait) {
  DataFlagError e{};
  e.state = kReasonMismatch;
  e.block = blockIdx.x;
  e.peer = src;
  e.wait = wait;
  e.call = call;
  e.field = field;
  e.mine = mine;
  e.theirs = theirs;
  e.aborter = -1;
  record<kPrint>(ws, e, true);
}

static __device__ __noinline__ void dataflag_mismatch(const DeviceWorkspace& ws, int src, uint64_t call, uint32_t field,
                                                     uint32_t mine, uint32_t theirs, uint32_t wait) {
  record_mismatch<true>(ws, src, call, field, mine, theirs, wait);
}

// A peer's header of a void call: the first one met stays in the void word
// until the host takes it (the kernel goes on: the placeholder's data lands
// like any other). A plain 64-bit store: two voids in flight at once leave
// one of them, whole.
__device__ __forceinline__ void record_void(const DeviceWorkspace& ws, int src, uint64_t call) {
  if (ws.voided == nullptr || ld_volatile_u64(ws.voided) != 0) return;
  st_volatile_u64(ws.voided, void_word(src, call));
  __threadfence_system();
}

static __device__ __noinline__ void dataflag_void(const DeviceWorkspace& ws, int src, uint64_t call) {
  record_void(ws, src, call);
}

// True when the peer's header `v` (landed) matches `mine`; else records the
// mismatch and aborts the workspace on every rank.
template <typename Fail>
__device__ __forceinline__ bool header_matches(uint4 v, const CallHeader& mine, int src, uint64_t call,
                                               const Fail& fail) {
  const CallHeader theirs{{v.x, v.y, v.z, v.w}};
  const uint32_t f = call_header_mismatch(mine, theirs);
  if (f == kHeaderFields) {
    if (header_is_void(theirs)) fail.voided(src, call);
    return true;
  }
  fail.mismatch(src, call, f, mine.w[f], theirs.w[f]);
  return false;
}

__device__ __forceinline__ bool header_matches(const DeviceWorkspace& ws, uint4 v, const CallHeader& mine, int src,
                                               uint64_t call) {
  return header_matches(v, mine, src, call, ReportNow{ws});
}

// Sentinel buffers. Producer: one plain 16-byte store (no word is the sentinel).
__device__ __forceinline__ void store_call_header(uint4* dst, const CallHeader& h) { *dst = header_vector(h); }

// Consumer: polls peer `src`'s header, writes the sentinel back, compares.
template <typename Fail>
__device__ __forceinline__ bool check_call_header(const DeviceWorkspace& ws, uint4* p, const CallHeader& mine, int src,
                                                  uint64_t call, const Fail& fail) {
  uint4 v = poll_vector(ws, p, src, call, kWaitHeader, fail);
  if (has_sentinel(v)) v = ld_volatile_v4(p);  // gave up on an abort: the header may have landed since
  *p = sentinel_vector();
  return !has_sentinel(v) && header_matches(v, mine, src, call, fail);
}

__device__ __forceinline__ bool check_call_header(const DeviceWorkspace& ws, uint4* p, const CallHeader& mine, int src,
                                                  uint64_t call) {
  return check_call_header(ws, p, mine, src, call, ReportNow{ws});
}

// Consumer, fused with a first data word: the header and the word are loaded
// together (two loads in flight, no added step when both landed), the header
// is compared as soon as it lands (before the word, which a peer with fewer
// rows may never send), then the word is polled as poll_word does. `hv` and
// `v` are the first loads of `h` and `p`, issued by the caller.
// A peer's header whose first load `hv` the caller issued: polled until it
// lands (once more after a give-up: it may have landed since), the sentinel
// written back. Still holds a sentinel word when it never landed.
template <typename Fail>
__device__ __forceinline__ uint4 land_peer_header(const DeviceWorkspace& ws, uint4* h, uint4 hv, int src,
                                                  uint64_t call, const Fail& fail) {
  if (has_sentinel(hv)) hv = poll_vector(ws, h, src, call, kWaitHeader, fail);
  if (has_sentinel(hv)) hv = ld_volatile_v4(h);  // gave up on an abort: the header may have landed since
  *h = sentinel_vector();
  return hv;
}

__device__ __forceinline__ uint32_t land_word_with_header(const DeviceWorkspace& ws, const uint32_t* p, uint32_t v,
                                                          uint4* h, uint4 hv, const CallHeader& mine, int src,
                                                          uint64_t call) {
  hv = land_peer_header(ws, h, hv, src, call, ReportNow{ws});
  if (has_sentinel(hv) || !header_matches(ws, hv, mine, src, call)) return v;  // gave up: later polls return at once
  return v != kSentinel ? v : poll_word(ws, p, src, call);
}

__device__ __forceinline__ uint32_t poll_word_with_header(const DeviceWorkspace& ws, const uint32_t* p, uint4* h,
                                                          const CallHeader& mine, int src, uint64_t call) {
  const uint4 hv = ld_volatile_v4(h);
  return land_word_with_header(ws, p, ld_volatile_u32(p), h, hv, mine, src, call);
}

// Tagged buffers (the exchange): the header as kHeaderFields tagged words.
__device__ __forceinline__ void store_call_header_tagged(uint64_t* dst, uint64_t tag, const CallHeader& h) {
#pragma unroll
  for (uint32_t f = 0; f < kHeaderFields; ++f) st_volatile_u64(dst + f, tag | h.w[f]);
}

__device__ __forceinline__ bool check_call_header_tagged(const DeviceWorkspace& ws, const uint64_t* p, uint32_t tag,
                                                         const CallHeader& mine, int src, uint64_t call) {
  // The four words are loaded together (one round trip when they landed).
  uint64_t first[kHeaderFields];
#pragma unroll
  for (uint32_t f = 0; f < kHeaderFields; ++f) first[f] = ld_volatile_u64(p + f);
  uint32_t word[kHeaderFields];
#pragma unroll
  for (uint32_t f = 0; f < kHeaderFields; ++f)
    word[f] = static_cast<uint32_t>(first[f] >> 32) == tag ? static_cast<uint32_t>(first[f])
                                                           : poll_tagged(ws, p + f, tag, src, call, kWaitHeader);
  const CallHeader theirs{{word[0], word[1], word[2], word[3]}};
  if (call_header_mismatch(mine, theirs) == kHeaderFields) {
    if (header_is_void(theirs)) dataflag_void(ws, src, call);
    return true;
  }
  // A poll that gave up (a peer's abort) returns a stale word: compare only a
  // header that has landed whole by now. One that has is compared even after
  // an abort, so a rank that meets a mismatching peer's abort first still
  // names both sides (the mismatch record replaces the peer-abort one).
#pragma unroll
  for (uint32_t f = 0; f < kHeaderFields; ++f) {
    const uint64_t x = ld_volatile_u64(p + f);
    if (static_cast<uint32_t>(x >> 32) != tag) return false;
    word[f] = static_cast<uint32_t>(x);
  }
  return header_matches(ws, make_uint4(word[0], word[1], word[2], word[3]), mine, src, call);
}

// The SMs the grids on `device` are sized for: the device's, or fewer where
// SDCP_BENCH_GRID_SMS asks. The one-GPU bench sets it: its N virtual ranks
// share one GPU, and each sizes its grids for its share so that every rank's
// grid is resident at once (a block waits for the same block of its peers).
// Read once per process, at the first launch.
inline int grid_sms(int device) {
  static int sms[64] = {0};
  int& n = sms[device & 63];
  if (n == 0) {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    const char* env = std::getenv("SDCP_BENCH_GRID_SMS");
    const int want = env != nullptr ? std::atoi(env) : 0;
    n = want > 0 && want < count ? want : count;
  }
  return n;
}

// Blocks for `items` of `items_per_block`, at most `per_sm` per SM and
// kDataFlagBlocks (every block of a data-as-flag kernel only waits for the
// same block of its peers, so the grid need not be co-resident; the cap keeps
// the launch small).
inline int dataflag_grid(int64_t items, int64_t items_per_block, int device, int per_sm = 2) {
  const int n = grid_sms(device);
  const int64_t want = (items + items_per_block - 1) / items_per_block;
  const int64_t cap = std::min<int64_t>(static_cast<int64_t>(per_sm) * n, kDataFlagBlocks);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap)));
}

// Whether data-as-flag kernels use programmatic dependent launch on `device`
// (compute capability 9.0 or later, unless SDCP_PDL=0).
inline bool dataflag_pdl(int device) {
  static int cached[64] = {0};  // 0 unknown, 1 no, 2 yes
  int& c = cached[device & 63];
  if (c == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    const char* env = std::getenv("SDCP_PDL");
    c = (major >= 9 && !(env && std::string(env) == "0")) ? 2 : 1;
  }
  return c == 2;
}

// A kernel design that is off until a GPU run has checked and measured it:
// on when the environment variable `name` is "1" (read once per process by
// each caller, at its first launch).
inline bool kernel_opt_in(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::string(env) == "1";
}

// Launches a data-as-flag kernel with `shared_bytes` of dynamic shared memory
// (the kernel's first step is pdl_wait_and_release: it waits for the previous
// kernel where the launch is programmatic).
template <typename... KernelArgs, typename... Args>
void launch_dataflag(void (*kernel)(KernelArgs...), int grid, int threads, size_t shared_bytes, cudaStream_t stream,
                    int device, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dataflag_pdl(device) ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Without dynamic shared memory.
template <typename... KernelArgs, typename... Args>
void launch_dataflag(void (*kernel)(KernelArgs...), int grid, int threads, cudaStream_t stream, int device,
                    Args&&... args) {
  launch_dataflag(kernel, grid, threads, size_t{0}, stream, device, std::forward<Args>(args)...);
}

}  // namespace sdcp
