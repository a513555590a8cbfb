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
// Two buffers alternate by the call index (one counter per rank, in its
// control region, advanced once per call by the last block that finishes):
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
constexpr int64_t kLamportBuffers = 2;

// The control region of a data-as-flag workspace (in each rank's region).
struct LamportControl {
  uint64_t call_index;  // calls completed by this rank
  uint32_t arrived;     // blocks of the running call that have finished
  uint32_t pad;
};

#if defined(__CUDACC__)
#define SDCP_LAMPORT_HD __host__ __device__ __forceinline__
#else
#define SDCP_LAMPORT_HD inline
#endif

SDCP_LAMPORT_HD uint32_t canonical_payload_word(uint32_t w) { return w == kSentinel ? kCanonicalNaNPair : w; }

// A payload word with a per-call rewrite (kCanonicalNaNPair or kCanonicalNaNQuad).
SDCP_LAMPORT_HD uint32_t canonical_word(uint32_t w, uint32_t canonical) { return w == kSentinel ? canonical : w; }

SDCP_LAMPORT_HD uint32_t canonical_lse_word(uint32_t w) {
  // exponent all ones and a non-zero mantissa: NaN
  return ((w & 0x7F800000u) == 0x7F800000u && (w & 0x007FFFFFu) != 0) ? kCanonicalNaN : w;
}

// The tag of call e (never 0, the value of fresh memory).
SDCP_LAMPORT_HD uint32_t call_tag(uint64_t e) {
  const uint32_t t = static_cast<uint32_t>(e + 1);
  return t == 0 ? 1u : t;
}

}  // namespace sdcp
