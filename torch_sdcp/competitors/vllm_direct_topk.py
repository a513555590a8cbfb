"""``VllmDirectTopK`` ("vLLM direct"): the algorithm of vLLM 0.34.0's peer-memory
top-K merge (``DirectDCPTopKWorkspace.merge``, kernels/attention/dsa/
dcp_topk_direct.py; what ``_merge_dcp_topk_global`` runs for DSA indexer models
with ``--dcp-comm-backend a2a``), written here in Triton over torch symmetric
memory:

1. pack: each rank's C candidates per row become (score, id) pairs in a local
   staging buffer (vLLM's pack reads the logits at the local top-K positions and
   maps them to global ids; here the boundary's inputs already are scores and
   global ids). The id travels as an fp32 value, as in vLLM (exact below 2^24);
2. push: one kernel stores the pairs into every rank's inbox (itself included)
   at the sender's place, in slot ``call % 2`` of two ping-pong slots;
3. publish and wait: one single-program kernel advances this rank's epoch with
   a system-scope release add, then spins with acquire loads until every
   peer's epoch reached its own, at most ``max_spins`` rounds (vLLM: 10^8).
   On timeout it traps, as vLLM's does: the CUDA context is lost and the next
   synchronising call raises (on the bench's virtual ranks, which share one
   CUDA context, it raises a sticky status word the bench checks instead). Under the Triton interpreter (CPU tests) the
   kernel stores the verdict and the caller raises ``RuntimeError``;
4. select: the stable top-K of the N*C received candidates of each row.

Two slots and no read acknowledgement: a rank overwrites a slot only after
every peer published the call in between, which each peer does after its
selection of the slot's previous call.

vLLM's selection (``StableTopKFromPingPongCandidatesKernel``): each candidate
gets the key (``u``, ``~id``) where ``u`` is the score's bits with the sign
flipped (all bits for a negative score), its high ``score_bits`` only (32; 16
when the indexer logits are bf16); the k largest keys are chosen, an id < 0
never; fewer than k valid: all valid ones, then -1. So ties go to the lower
id; -0.0 ranks below +0.0; a positive NaN ranks above +inf and a negative NaN
below -inf (NaN payloads are ordered by their bits). The ids of a row are
written in no defined order (their commit order in shared memory).
``direct_topk_spec`` is that selection in plain torch, best first.

Where this reproduction differs:

- selection: torch_sdcp's stable top-K kernel (``torch.ops.sdcp.topk_select``),
  as CuTeDSL is not available here. Its order (docs/DESIGN.md 2.2: -0.0 equals
  +0.0, every NaN below -inf, ties to the lower id) is made vLLM's by the score
  the pack stores (``select_score``: a negative non-NaN score moves one ulp
  away from zero, so -0.0 falls below +0.0 and -inf onto the NaN class; a
  positive NaN becomes +inf). Identical to vLLM's set except where +inf meets
  a positive NaN, or -inf a negative NaN, at the k-th place, or NaNs of
  different payloads (there they tie, the lower id first). The ids come best
  first, in a new tensor (vLLM: no defined order, into the caller's tensor);
- the inbox is planar (``[slot, score|id, row, N*C]``, vLLM: interleaved
  pairs), because ``topk_select`` reads unit-stride scores and ids;
- the slot is the host's call parity, passed to the push and read by the
  selection through a tensor view (vLLM's kernels read it from the device
  epoch). A CUDA graph replays the slots it captured: a graph of an even
  number of calls alternates them as vLLM does (the benchmark times 8 calls
  per graph, k8 only); one of an odd number would reuse a slot on consecutive
  replays;
- peers are reached by element offsets from this rank's buffer (vLLM: a table
  of peer pointers); PDL (``launch_pdl``, ``gdc_wait``) as in vLLM on SM90+,
  between the pack, the push and the publish kernels (``topk_select`` is
  launched without it).

NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp.competitors._symm import (
    _default_group,
    _enable_for_group,
    _pow2,
    _symmetric_memory,
    element_offsets,
)

#: vLLM's bound on the spin rounds of the publish-and-wait kernel.
MAX_SPINS = 100_000_000


def direct_max_rows(max_num_seqs: int = 1024, tokens_per_request: int = 4, max_num_batched_tokens: int = 8192,
                    capture_size: int = 512) -> int:
    """The rows bound of vLLM 0.34.0's direct top-K (``direct_max_rows``): its
    DCP workspace bound, ``get_dcp_workspace_max_num_tokens``; batches above it
    take the NCCL all-gather. The defaults are vLLM's on H100/H200 (OpenAI
    server: 1024 sequences, 8192 batched tokens, CUDA graphs up to 512) with
    three MTP draft tokens, the benchmark's largest regime: 4096 rows (1024
    without draft tokens)."""
    return min(max_num_batched_tokens, max(max_num_seqs * tokens_per_request, capture_size))


# ---------------------------------------------------------------------------
# vLLM's selection in plain torch (the specification), and the score the pack
# stores so that topk_select orders as vLLM's key does.
# ---------------------------------------------------------------------------


def _check_score_bits(score_bits: int) -> None:
    if score_bits not in (16, 32):
        raise ValueError(f"vLLM direct: argument 'score_bits': expected 16 or 32, got {score_bits}")


def vllm_score_key(scores: Tensor, score_bits: int = 32) -> Tensor:
    """vLLM's score key, int64 in [0, 2^32): the fp32 bits with the sign bit
    flipped (every bit for a negative score), the low ``32 - score_bits`` zero."""
    _check_score_bits(score_bits)
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return key >> (32 - score_bits) << (32 - score_bits)


def direct_topk_spec(scores: Tensor, ids: Tensor, k: int, score_bits: int = 32) -> Tensor:
    """vLLM's selection over candidates (scores [T, M] fp32, ids [T, M] int32):
    the ids (after their fp32 round trip) of the k largest keys (score key,
    then the lower id), best first, -1 padded; ids < 0 never chosen."""
    ids = ids.float().to(torch.int32)
    key = vllm_score_key(scores, score_bits)
    order = torch.sort(ids, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices)
    valid = ids.gather(1, order) >= 0
    order = order.gather(1, torch.sort(valid.to(torch.int8), dim=1, descending=True, stable=True).indices)
    take = min(k, ids.size(1))
    chosen = ids.gather(1, order[:, :take])
    out = torch.full((ids.size(0), k), -1, dtype=torch.int32, device=ids.device)
    out[:, :take] = torch.where(chosen >= 0, chosen, -1)
    return out


def select_score(scores: Tensor, score_bits: int = 32) -> Tensor:
    """The score the pack stores (plain torch; the pack kernel computes the
    same bits): under topk_select's order it ranks as vLLM's key, up to the
    ties named in the module docstring."""
    _check_score_bits(score_bits)
    b = scores.float().contiguous().view(torch.int32)
    neg = b < 0
    if score_bits < 32:
        low = (1 << (32 - score_bits)) - 1
        b = torch.where(neg, b | low, b & ~low)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    b = torch.where(neg & ~nan, b + 1, b)
    b = torch.where(~neg & nan, 0x7F800000, b)
    return b.view(torch.float32)


# ---------------------------------------------------------------------------
# The kernels (defined on first use: importing this module needs no Triton).
# ---------------------------------------------------------------------------


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def pack(scores_ptr, ids_ptr, packed_ptr, plane, C: tl.constexpr, BLOCK: tl.constexpr,
             SCORE_BITS: tl.constexpr):
        # Program (row, block): scores to plane 0 as select_score, ids (fp32 round trip) to plane 1.
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < C
        b = tl.load(scores_ptr + t * C + c, mask=mask).to(tl.int32, bitcast=True)
        neg = b < 0
        if SCORE_BITS < 32:  # the class of equal high bits, by its extreme member
            b = tl.where(neg, b | ((1 << (32 - SCORE_BITS)) - 1), b & -(1 << (32 - SCORE_BITS)))
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        b = tl.where(neg & ~nan, b + 1, b)
        b = tl.where(~neg & nan, 0x7F800000, b)
        ids = tl.load(ids_ptr + t * C + c, mask=mask).to(tl.float32).to(tl.int32)
        tl.store(packed_ptr + t * C + c, b.to(tl.float32, bitcast=True), mask=mask)
        tl.store(packed_ptr + plane + t * C + c, ids.to(tl.float32, bitcast=True), mask=mask)

    @triton.jit
    def push(packed_ptr, inbox_ptr, inbox_offsets, slot, rank, rows, max_rows, N: tl.constexpr,
             C: tl.constexpr, BLOCK: tl.constexpr, launch_pdl: tl.constexpr):
        # Element e of the packed [2, rows, C] buffer goes to every rank's
        # inbox [2, 2, max_rows, N, C] at [slot, plane, row, rank, c].
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = e < 2 * rows * C
        plane = e // (rows * C)
        rem = e - plane * (rows * C)
        t = rem // C
        c = rem - t * C
        dst = ((slot * 2 + plane) * max_rows + t) * (N * C) + rank * C + c
        if launch_pdl:  # dispatched before the pack retires: wait for its stores
            tl.extra.cuda.gdc_wait()
        v = tl.load(packed_ptr + e, mask=mask)
        for peer in tl.static_range(N):
            tl.store(inbox_ptr + tl.load(inbox_offsets + peer) + dst, v, mask=mask)
        if launch_pdl:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def publish_and_wait(signal_ptr, signal_offsets, status_ptr, N: tl.constexpr, N_POW2: tl.constexpr,
                         MAX_SPINS: tl.constexpr, launch_pdl: tl.constexpr, TRAP: tl.constexpr):
        if launch_pdl:  # publish only once every push program stored
            tl.extra.cuda.gdc_wait()
        epoch = tl.atomic_add(signal_ptr, 1, sem="release", scope="sys") + 1
        peer = tl.arange(0, N_POW2)
        mask = peer < N
        peers = signal_ptr + tl.load(signal_offsets + peer, mask=mask, other=0)
        seen = tl.atomic_add(peers, 0, mask=mask, sem="acquire", scope="sys")
        pending = tl.max(tl.where(mask & (seen < epoch), 1, 0), axis=0)
        spins = 0
        while (pending != 0) & (spins < MAX_SPINS):
            seen = tl.atomic_add(peers, 0, mask=mask, sem="acquire", scope="sys")
            pending = tl.max(tl.where(mask & (seen < epoch), 1, 0), axis=0)
            spins += 1
        if TRAP:  # a peer that never came: trap rather than read a stale slot
            tl.inline_asm_elementwise("{ .reg .pred late; setp.ne.s32 late, $1, 0; @late trap; mov.u32 $0, 0; }",
                                      "=r,r", [pending], dtype=tl.int32, is_pure=False, pack=1)
        else:  # sticky: a later call that passes does not clear it
            tl.atomic_max(status_ptr, pending)
        if launch_pdl:
            tl.extra.cuda.gdc_launch_dependents()

    return pack, push, publish_and_wait


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _pdl(device_index: int) -> bool:
    """PDL on SM90+ (vLLM: ``is_arch_support_pdl``); never under the interpreter."""
    return not _interpreted() and torch.cuda.get_device_capability(device_index)[0] >= 9


def _use_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and _pdl(device.index if device.index is not None else torch.cuda.current_device())


def pack_candidates(scores: Tensor, ids: Tensor, packed: Tensor, score_bits: int = 32) -> None:
    """Step 1: ``scores``/``ids`` [T, C] into ``packed`` (flat, at least 2*T*C
    fp32) as [2, T, C]: ``select_score`` and the ids' int32 bits."""
    pack, _, _ = _kernels()
    rows, c = scores.shape
    if rows:
        block = min(1024, _pow2(c))
        pack[(rows, -(-c // block))](scores, ids, packed, rows * c, C=c, BLOCK=block, SCORE_BITS=score_bits,
                                    num_warps=4)


def push_candidates(packed: Tensor, inbox: Tensor, inbox_offsets: Tensor, slot: int, rank: int, rows: int) -> None:
    """Step 2: the packed [2, rows, C] into slot ``slot`` of every rank's inbox
    ([2, 2, max_rows, N, C] fp32, this rank's; ``inbox_offsets`` int64 [N]
    element offsets of every rank's inbox from it)."""
    _, push, _ = _kernels()
    _, _, max_rows, n, c = inbox.shape
    if rows:
        pdl = _use_pdl(inbox.device)
        block = 1024
        push[(-(-2 * rows * c // block),)](packed, inbox, inbox_offsets, slot, rank, rows, max_rows, N=n, C=c,
                                           BLOCK=block, launch_pdl=pdl, num_warps=4)


def publish_and_wait(signal: Tensor, signal_offsets: Tensor, status: Tensor, max_spins: int = MAX_SPINS,
                     trap: bool | None = None) -> None:
    """Step 3: advance this rank's epoch (``signal`` int64 [1]) and wait for
    every peer's (``signal_offsets`` int64 [N] element offsets). On CUDA a
    timeout traps; under the interpreter it raises ``RuntimeError``.
    ``trap=False`` on CUDA: a timeout raises ``status`` (sticky) instead, for
    the caller to check (the bench's virtual ranks share one CUDA context that
    a trap would end)."""
    _, _, kernel = _kernels()
    n = signal_offsets.numel()
    on_cuda = not _interpreted() and signal.device.type == "cuda"
    trap = on_cuda if trap is None else trap
    kernel[(1,)](signal, signal_offsets, status, N=n, N_POW2=max(2, _pow2(n)), MAX_SPINS=max_spins,
                 launch_pdl=_use_pdl(signal.device), TRAP=trap, num_warps=1)
    if not trap and not on_cuda and int(status[0]):
        raise RuntimeError(f"vLLM direct: a peer did not publish within {max_spins} spins (on CUDA the kernel "
                           f"traps, as vLLM's does)")


def select_from_inbox(inbox: Tensor, slot: int, rows: int, k: int) -> Tensor:
    """Step 4: ``topk_select`` over the N*C candidates of slot ``slot``: [rows, k] int32."""
    _, _, max_rows, n, c = inbox.shape
    scores = inbox[slot, 0, :rows].view(rows, n * c)
    ids = inbox[slot, 1, :rows].view(rows, n * c).view(torch.int32)
    return torch.ops.sdcp.topk_select(scores, ids, k)


def direct_call(scores: Tensor, ids: Tensor, packed: Tensor, inbox: Tensor, inbox_offsets: Tensor, signal: Tensor,
                signal_offsets: Tensor, status: Tensor, slot: int, rank: int, k: int, score_bits: int = 32,
                max_spins: int = MAX_SPINS, trap: bool | None = None) -> Tensor:
    """One call of rank ``rank`` from its buffers (those of the steps above):
    pack, push into slot ``slot`` of every rank's inbox, publish and wait,
    select: [rows, k] int32."""
    rows = scores.size(0)
    pack_candidates(scores.contiguous(), ids.contiguous(), packed, score_bits)
    push_candidates(packed, inbox, inbox_offsets, slot, rank, rows)
    publish_and_wait(signal, signal_offsets, status, max_spins, trap)
    return select_from_inbox(inbox, slot, rows, k)


class VllmDirectTopK:
    """vLLM 0.34.0's direct top-K merge (see the module docstring): pack, push
    into every peer's slot, publish and wait, select. Created collectively;
    every rank makes the same calls."""

    def __init__(self, group, max_rows: int, k: int, device: torch.device, candidates_per_rank: int | None = None,
                 score_bits: int = 32, max_spins: int = MAX_SPINS):
        symm_mem = _symmetric_memory()
        _check_score_bits(score_bits)
        self.group = group if group is not None else _default_group()
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.k, self.c = k, candidates_per_rank or k
        self.max_rows, self.score_bits, self.max_spins = max_rows, score_bits, max_spins
        _enable_for_group(symm_mem, self.group)
        name = self.group.group_name
        shape = (2, 2, max_rows, self.n, self.c)
        self.inbox = symm_mem.empty(shape, dtype=torch.float32, device=device)
        self.signal = symm_mem.empty(2, dtype=torch.int64, device=device)  # [0]: the epoch; 16 bytes apart
        self.inbox.zero_()
        self.signal.zero_()
        torch.cuda.synchronize(device)
        self.h_inbox = symm_mem.rendezvous(self.inbox, name)
        self.h_signal = symm_mem.rendezvous(self.signal, name)
        # Keep the peer views alive with the offsets derived from them.
        self.peer_inbox = [self.h_inbox.get_buffer(r, list(shape), torch.float32, 0) for r in range(self.n)]
        self.peer_signal = [self.h_signal.get_buffer(r, [2], torch.int64, 0) for r in range(self.n)]
        self.inbox_offsets = element_offsets(self.peer_inbox, self.inbox, device)
        self.signal_offsets = element_offsets(self.peer_signal, self.signal, device)
        self.packed = torch.empty(2 * max_rows * self.c, dtype=torch.float32, device=device)
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.calls = 0
        self.physical_bytes = self.inbox.numel() * 4 + self.signal.numel() * 8
        self.h_inbox.barrier(channel=0)
        torch.cuda.synchronize(device)

    def merge(self, scores: Tensor, ids: Tensor) -> Tensor:
        rows = scores.size(0)
        if scores.shape != (rows, self.c) or scores.dtype != torch.float32:
            raise ValueError(f"vLLM direct: argument 'scores': expected [T, {self.c}] float32, got "
                             f"{list(scores.shape)} {scores.dtype}")
        if ids.shape != scores.shape or ids.dtype != torch.int32:
            raise ValueError(f"vLLM direct: argument 'ids': expected {list(scores.shape)} int32, got "
                             f"{list(ids.shape)} {ids.dtype}")
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"vLLM direct: argument 'scores': expected 1 to {self.max_rows} rows (vLLM's "
                             f"direct bound), got {rows}")
        slot = self.calls & 1
        self.calls += 1
        return direct_call(scores, ids, self.packed, self.inbox, self.inbox_offsets, self.signal[:1],
                           self.signal_offsets, self.status, slot, self.rank, self.k, self.score_bits, self.max_spins)
