// Data-as-flag ("Lamport") signalling, shared by the host and device
// backends (docs/PROTOCOL.md, protocol version 4).
//
// A receive buffer holds a sentinel word wherever no data has landed. A
// producer stores its payload into the consumer's buffer with plain stores,
// rewriting any word that equals the sentinel to a canonical word of the same
// meaning; the consumer polls its *local* buffer until no word of what it
// needs is the sentinel, uses the data and writes the sentinel back. There is
// no flag, no fence and no acknowledgement on the critical path.
//
// Two buffers alternate by the call index (kept per rank in its control
// region and advanced once per call by the kernel itself):
// a producer writes buffer (e + 2) % 2 == e % 2 again only in call e + 2,
// which it starts after its call e + 1 saw this rank's call-(e + 1) data,
// stored by a kernel that ran after this rank's call e had re-filled the
// buffer. The byte-generic exchange cannot reserve a sentinel value, so each
// aligned 64-bit word carries 4 payload bytes and a 32-bit tag (the call
// index plus one) instead, stored and loaded as one single-copy-atomic
// access; a stale word can never carry the current tag.
#pragma once

#include <cstdint>

namespace sdcp {

#if defined(__CUDACC__)
#define SDCP_DATAFLAG_HD __host__ __device__ __forceinline__
#else
#define SDCP_DATAFLAG_HD inline
#endif

// Every payload word equal to this is rewritten by its producer.
constexpr uint32_t kSentinel = 0xFFFFFFFFu;
// The rewrite: two bf16 or fp16 NaNs, or one fp32 NaN (NaN stays NaN).
constexpr uint32_t kCanonicalNaNPair = 0x7FC07FC0u;
// A NaN LSE (the empty-shard mark) is stored as this fp32 quiet NaN.
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;
// The rewrite for one-byte floats: four 0x7F bytes, NaN in float8_e4m3fn and
// in float8_e5m2 (0xC0 would be -2.0 in e4m3).
constexpr uint32_t kCanonicalNaNQuad = 0x7F7F7F7Fu;
// Payload bytes of one tagged 64-bit word of the exchange.
constexpr int64_t kTaggedPayload = 4;
// Buffers that alternate by call index.
constexpr int64_t kDataFlagBuffers = 2;

// Why a rank aborted a workspace (the high half of an abort word), and what
// an error record reports (DataFlagError::state).
enum DataFlagReason : uint32_t {
  kReasonNone = 0,
  kReasonTimeout = 1,    // a wait on a peer ran out of time
  kReasonMismatch = 2,   // a peer's call header differs from this rank's
  kReasonError = 3,      // a call raised on that rank after it was entered (bad input, ...)
  kReasonPeerAbort = 4,  // record only: a peer's abort word was seen
  kReasonBadInput = 5,   // a kernel met an input it cannot use (query: a position outside the cache; field = row,
                         // mine = the position saturated to int32, theirs = the cache rows)
};

// What a wait was for (DataFlagError::wait).
enum DataFlagWait : uint32_t {
  kWaitData = 0,    // a payload, LSE or tagged word
  kWaitHeader = 1,  // the call header (the peer has not entered the call)
  // The query's zero-copy view (one fixed buffer, its own view call index):
  kWaitViewData = 2,     // a peer's rows in the view
  kWaitViewHeader = 3,   // a peer's call header of the view call
  kWaitViewRelease = 4,  // a peer's release of the previous view call (its reader finished)
};

SDCP_DATAFLAG_HD bool dataflag_wait_is_view(uint32_t wait) { return wait >= kWaitViewData && wait <= kWaitViewRelease; }
SDCP_DATAFLAG_HD bool dataflag_wait_is_header(uint32_t wait) { return wait == kWaitHeader || wait == kWaitViewHeader; }

// The most blocks of a data-as-flag grid (dataflag_grid caps grids at this).
constexpr int kDataFlagBlocks = 384;

// The control region of a data-as-flag workspace (in each rank's region).
struct DataFlagControl {
  // Between calls every counter holds the number of calls this rank
  // completed; block b of a grid of g blocks reads counter b and advances
  // counters b, b + g, b + 2g, ..., so no two blocks share a counter and no
  // atomic or end-of-grid arrival is needed. The host backend uses counter 0.
  uint64_t call_index[kDataFlagBlocks];
  // Non-zero once any rank aborted the workspace (dataflag_abort_word): the
  // failing rank stores it into every rank's control region, its own
  // included; every poll reads its own in its slow path and gives up. Never
  // cleared: a workspace is re-created after a failure.
  uint64_t abort;
  // CUDA: the first thread that gives up claims this rank's error record, the
  // first that meets a peer's abort the peer-abort record (atomicCAS, once
  // each: DataFlagRecords).
  uint32_t error_claim;
  uint32_t peer_abort_claim;
};
static_assert(sizeof(DataFlagControl) <= 4096, "DataFlagControl must fit its 4 KiB control region");

// What went wrong, as the rank that saw it records it: in host-mapped pinned
// memory on CUDA (written by the kernel, read by the host without a
// synchronisation), in host memory on the host backend. `state` is written
// last (after a system fence); 0 means healthy.
struct DataFlagError {
  uint32_t state;   // DataFlagReason
  int32_t block;    // CUDA block that recorded it (-1 on the host)
  int32_t peer;     // the peer waited for or disagreed with
  uint32_t wait;    // DataFlagWait
  uint64_t call;    // this rank's call index
  uint32_t field;   // mismatch: the CallHeader field that differs
  uint32_t mine;    // mismatch: this rank's word of that field
  uint32_t theirs;  // mismatch: the peer's word
  int32_t aborter;  // peer abort: the rank that aborted (-1 if none)
  uint32_t abort_reason;  // peer abort: its DataFlagReason
  uint32_t pad[3];
};
static_assert(sizeof(DataFlagError) == 56, "DataFlagError layout");

// An abort word: the aborting rank and its reason, never 0.
SDCP_DATAFLAG_HD uint64_t dataflag_abort_word(int64_t rank, uint32_t reason) {
  return (static_cast<uint64_t>(reason) << 32) | static_cast<uint32_t>(rank + 1);
}
SDCP_DATAFLAG_HD int32_t abort_word_rank(uint64_t w) { return static_cast<int32_t>(static_cast<uint32_t>(w)) - 1; }
SDCP_DATAFLAG_HD uint32_t abort_word_reason(uint64_t w) { return static_cast<uint32_t>(w >> 32); }

// The call header: what a call is, stored by the producer into every
// consumer's header entry (one per peer and buffer) with its data, and
// compared by the consumer before it trusts the data. Four 32-bit words,
// none the sentinel (canonical_header_word), so a sentinel-filled header is
// polled like data; the exchange stores them as tagged words instead.
enum CallHeaderField : uint32_t {
  kHeaderRows = 0,      // rows (the exchange: bytes)
  kHeaderDtype = 1,     // c10::ScalarType of the payload
  kHeaderFlags = 2,     // family-defined (Output/LSE: the LSE base; exchange: a shape hash; query: the op, options)
  kHeaderGeometry = 3,  // Workspace::geometry_hash (kind, world size, parameters)
  kHeaderFields = 4,
};

struct CallHeader {
  uint32_t w[kHeaderFields];
};

// A void call (docs/PROTOCOL.md "Void calls"): a rank whose call failed its
// argument checks before anything was published makes the call anyway, with
// placeholder inputs and this bit in its dtype word (a c10::ScalarType never
// has it), so that every rank stays in step; a consumer that meets it
// records the void (below) and the call raises there without poisoning. A
// void header pairs with any options (header_flags_difference) and, when it
// has no tag, with any tag (header_dtype_difference).
constexpr uint32_t kHeaderVoidBit = 0x80000000u;

SDCP_DATAFLAG_HD bool header_is_void(const CallHeader& h) { return (h.w[kHeaderDtype] & kHeaderVoidBit) != 0; }

// The caller's call tag (docs/PROTOCOL.md "Failure behaviour": every call
// method takes an optional `tag`, e.g. the layer index): bits 8..30 of the
// dtype word hold tag + 1, 0 when the call is untagged (a c10::ScalarType
// fits in the low 8 bits), so the header stays one 16-byte vector: the same
// stores and loads; the comparison gains two masks and branches.
// Tags are [0, kCallTagLimit); -1 is untagged.
// (Not the exchange's per-call word tag, call_tag below.)
constexpr uint32_t kHeaderTagShift = 8;
constexpr uint32_t kHeaderTagMask = 0x7FFFFF00u;
constexpr int64_t kCallTagLimit = (int64_t{1} << 23) - 1;

// The dtype word's bits of `tag` (checked: -1 or [0, kCallTagLimit)).
SDCP_DATAFLAG_HD uint32_t header_tag_bits(int64_t tag) {
  return tag < 0 ? 0u : static_cast<uint32_t>(tag + 1) << kHeaderTagShift;
}

// The bits in which two dtype words differ. The void bit is no difference
// (a void call is otherwise the same call), and neither is the tag against
// a void placeholder without one: it stands for a call whose tag was not
// valid (or absent), so it pairs with any tag.
SDCP_DATAFLAG_HD uint32_t header_dtype_difference(uint32_t mine, uint32_t theirs) {
  uint32_t d = (mine ^ theirs) & ~kHeaderVoidBit;
  if ((d & kHeaderTagMask) != 0 && ((mine & (kHeaderVoidBit | kHeaderTagMask)) == kHeaderVoidBit ||
                                    (theirs & (kHeaderVoidBit | kHeaderTagMask)) == kHeaderVoidBit))
    d &= ~kHeaderTagMask;
  return d;
}

// The void word a consumer stores (the first void it meets, until the host
// takes it): the voiding rank plus one, and the low 32 bits of the call.
SDCP_DATAFLAG_HD uint64_t void_word(int64_t src, uint64_t call) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(call)) << 32) | static_cast<uint32_t>(src + 1);
}


SDCP_DATAFLAG_HD uint32_t canonical_payload_word(uint32_t w) { return w == kSentinel ? kCanonicalNaNPair : w; }

// A payload word with a per-call rewrite (kCanonicalNaNPair or kCanonicalNaNQuad).
SDCP_DATAFLAG_HD uint32_t canonical_word(uint32_t w, uint32_t canonical) { return w == kSentinel ? canonical : w; }

SDCP_DATAFLAG_HD uint32_t canonical_lse_word(uint32_t w) {
  // exponent all ones and a non-zero mantissa: NaN
  return ((w & 0x7F800000u) == 0x7F800000u && (w & 0x007FFFFFu) != 0) ? kCanonicalNaN : w;
}

// The tag of call e (never 0, the value of fresh memory).
SDCP_DATAFLAG_HD uint32_t call_tag(uint64_t e) {
  const uint32_t t = static_cast<uint32_t>(e + 1);
  return t == 0 ? 1u : t;
}

// A header word is never the sentinel (a value that would be moves one down).
SDCP_DATAFLAG_HD uint32_t canonical_header_word(uint32_t w) { return w == kSentinel ? kSentinel - 1 : w; }

// The header of a call: rows (or bytes), payload dtype, family flags and the
// workspace's geometry hash, each canonical.
SDCP_DATAFLAG_HD CallHeader make_call_header(int64_t rows, int64_t dtype, uint32_t flags, uint32_t geometry) {
  CallHeader h;
  h.w[kHeaderRows] = canonical_header_word(static_cast<uint32_t>(rows));
  h.w[kHeaderDtype] = canonical_header_word(static_cast<uint32_t>(dtype));
  h.w[kHeaderFlags] = canonical_header_word(flags);
  h.w[kHeaderGeometry] = canonical_header_word(geometry);
  return h;
}

// The bits in which two flags words differ. Against a void header (either
// side) only `op_bits` count, the bits that name the op (the query's; 0 for
// the other families): the rest are the call's options (Output/LSE's base,
// the query's RoPE style and q_scale, the exchange's shape hash), which a
// void placeholder cannot know when the call's own were not valid (a base
// "10", a misspelt keyword), and which change nothing that is moved (the
// rows and the dtype say that), so it pairs with any, as an untagged one
// pairs with any tag. Rows, dtype and geometry stay compared against a void
// header: its rows are the call's leading tensor's or its peers' (a rank
// with more rows would wait for rows never sent), its dtype the
// workspace's (the exchange: x's), its geometry the workspace's own.
SDCP_DATAFLAG_HD uint32_t header_flags_difference(const CallHeader& mine, const CallHeader& theirs,
                                                  uint32_t op_bits) {
  const uint32_t d = mine.w[kHeaderFlags] ^ theirs.w[kHeaderFlags];
  return header_is_void(mine) || header_is_void(theirs) ? d & op_bits : d;
}

// The first field in which two headers differ, or kHeaderFields (the void
// bit is not a difference: a void call is otherwise the same call, of any
// options: header_flags_difference). Calls of different tags are another
// call, whatever else differs: that is named first (the dtype word), so
// every rank names the tags. Symmetric, so both sides of a pair reach the
// same verdict. `op_bits`: the flags bits that name the op (the query's
// kQueryOpBits), compared against a void header too.
SDCP_DATAFLAG_HD uint32_t call_header_mismatch(const CallHeader& mine, const CallHeader& theirs,
                                               uint32_t op_bits = 0) {
  const uint32_t dtype = header_dtype_difference(mine.w[kHeaderDtype], theirs.w[kHeaderDtype]);
  if ((dtype & kHeaderTagMask) != 0) return kHeaderDtype;
  for (uint32_t f = 0; f < kHeaderFields; ++f)
    if (f == kHeaderDtype    ? dtype != 0
        : f == kHeaderFlags ? header_flags_difference(mine, theirs, op_bits) != 0
                            : mine.w[f] != theirs.w[f])
      return f;
  return kHeaderFields;
}

}  // namespace sdcp
