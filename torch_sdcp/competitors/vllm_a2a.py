"""``VllmA2AOutputLSE`` ("vLLM a2a"): the algorithm of vLLM's direct symmetric-
memory all-to-all (``DirectDCPA2AWorkspace.lse_reduce``, vLLM PR #50484; the
path ``--dcp-comm-backend a2a`` selects on one node), written here in Triton
over torch symmetric memory:

1. a per-call epoch counter in device memory is advanced on the stream
   (so a CUDA graph advances it on every replay); its parity picks one of two
   staging slots, ``inbox[2, N, max_rows, H/N, D]`` and ``inbox_lse[2, N,
   max_rows, H/N]`` in every rank's symmetric memory;
2. one dispatch kernel, one program per (destination, row), stores the row's
   contiguous head shard of that destination and its H/N LSEs straight into
   the destination's slot, at the sender's index;
3. one signal round: every rank signals every peer and waits for every peer
   (vLLM: a release-store signal kernel and acquire spins in the combine
   kernel; here the symmetric-memory barrier kernel, the same one round of
   flags, with release/acquire at system scope);
4. one combine kernel, one program per (row, local head), reads the N LSEs of
   the slot, forms base-2 weights ``exp2(l*log2(e) - m) / sum`` (NaN/+inf ->
   -inf, m <- 0 when every shard is empty, weight 0 when the sum is 0),
   accumulates the N payloads in fp32 and rounds once.

Two slots and no acknowledgement: rank A reuses slot p at call n+2 only after
its call n+1 waited for B's signal of n+1, which B sends after its call n
(the last reader of slot p) finished. Where this reproduction differs: the
signal/wait is the barrier kernel (not fused into the combine); a zero-weight
payload is not read (so a NaN in an empty shard cannot leak; vLLM multiplies
it by 0); the global LSE is also returned (``return_lse``); the engine's
empty-shard mask (seq_lens) is not fused into the dispatch (the benchmark
passes no mask to any path). On the bench's virtual ranks (``--one-gpu N``,
bench/one_gpu_competitors.py: no process group behind the buffers) step 3
is competitors/_signal.py's device signal round instead, closer to vLLM's
(a release-store flag per peer, bounded acquire spins; its own kernel,
not fused into the combine). NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1); no multimem instruction is used.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp.competitors._symm import (
    LN2,
    LOG2E,
    _default_group,
    _enable_for_group,
    _pow2,
    _symmetric_memory,
    check_partials,
    element_offsets,
)

# ---------------------------------------------------------------------------
# vLLM a2a: the math of the combine step in plain torch (the specification of
# the Triton kernel, and what the CPU tests check), then the kernels.
# ---------------------------------------------------------------------------


def a2a_weights(inbox_lse: Tensor, base2: bool) -> tuple[Tensor, Tensor]:
    """The combine step's weights ``[N, T, H]`` and global LSE ``[T, H]`` (in
    the caller's base) from the received LSEs ``[N, T, H]`` fp32, as the
    kernel forms them: base 2 inside, ``exp2(l - m) * (1 / sum)``."""
    inf = math.inf
    l = torch.where(torch.isnan(inbox_lse) | (inbox_lse == inf), -inf, inbox_lse)
    if not base2:
        l = l * LOG2E
    m = l.amax(dim=0)
    m = torch.where(m == -inf, 0.0, m)
    e = torch.exp2(l - m)
    s = e.sum(dim=0)
    inv = torch.where(s > 0, 1.0 / s, 0.0)
    big_l = torch.where(s > 0, m + torch.log2(s), -inf)
    if not base2:
        big_l = big_l * LN2
    return e * inv, big_l


def a2a_combine_math(inbox: Tensor, inbox_lse: Tensor, base2: bool = False) -> tuple[Tensor, Tensor]:
    """The combine step in plain torch: received payloads ``[N, T, H, D]`` and
    LSEs ``[N, T, H]`` -> ``([T, H, D]`` in the payload dtype, ``[T, H]`` fp32).
    fp32 accumulation in source order, one rounding; a zero-weight payload
    adds exactly 0."""
    w, big_l = a2a_weights(inbox_lse.float(), base2)
    acc = torch.zeros(inbox.shape[1:], dtype=torch.float32, device=inbox.device)
    for s in range(inbox.size(0)):
        ws = w[s].unsqueeze(-1)
        acc = acc + torch.where(ws != 0, inbox[s].float() * ws, 0.0)
    return acc.to(inbox.dtype), big_l


@functools.cache
def _a2a_kernels():
    """The two Triton kernels (defined on first use: importing this module
    needs no Triton, and TRITON_INTERPRET is read when they are defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dispatch(po_ptr, pl_ptr, inbox_ptr, inbox_lse_ptr, out_offsets, lse_offsets, epoch_ptr, rows, max_rows,
                 rank, N: tl.constexpr, HL: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_H: tl.constexpr, VEC: tl.constexpr):
        # Program (destination, row): the row's head shard of the destination
        # is contiguous in the source ([T, H, D]) and in the slot.
        pid = tl.program_id(0).to(tl.int64)
        dst = pid // rows
        t = pid - dst * rows
        parity = tl.load(epoch_ptr) & 1
        slot_row = (parity * N + rank) * max_rows + t
        # Peer memory is mapped into this process: the destination's inbox is
        # this rank's inbox plus a fixed element offset (VEC elements = 16 bytes).
        dst_out = inbox_ptr + tl.multiple_of(tl.load(out_offsets + dst), VEC) + slot_row * (HL * D)
        src = po_ptr + (t * (N * HL) + dst * HL) * D
        for off in range(0, HL * D, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < HL * D
            tl.store(dst_out + idx, tl.load(src + idx, mask=mask), mask=mask)
        h = tl.arange(0, BLOCK_H)
        hmask = h < HL
        dst_lse = inbox_lse_ptr + tl.load(lse_offsets + dst) + slot_row * HL
        tl.store(dst_lse + h, tl.load(pl_ptr + t * (N * HL) + dst * HL + h, mask=hmask), mask=hmask)

    @triton.jit
    def combine(inbox_ptr, inbox_lse_ptr, epoch_ptr, out_ptr, out_lse_ptr, max_rows, N: tl.constexpr,
                N_POW2: tl.constexpr, HL: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BASE_E: tl.constexpr):
        # Program (row, local head) over the N sources of the current slot.
        pid = tl.program_id(0).to(tl.int64)
        t = pid // HL
        h = pid - t * HL
        parity = tl.load(epoch_ptr) & 1
        src = tl.arange(0, N_POW2)
        l = tl.load(inbox_lse_ptr + ((parity * N + src) * max_rows + t) * HL + h, mask=src < N,
                    other=float("-inf"))
        l = tl.where((l != l) | (l == float("inf")), float("-inf"), l)
        if BASE_E:
            l = l * 1.4426950408889634
        m = tl.max(l, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp2(l - m), axis=0)
        inv = tl.where(s > 0.0, 1.0 / s, 0.0)
        big_l = tl.where(s > 0.0, m + tl.log2(s), float("-inf"))
        if BASE_E:
            big_l = big_l * 0.6931471805599453
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for r in tl.static_range(N):
            item = ((parity * N + r) * max_rows + t) * HL + h
            lr = tl.load(inbox_lse_ptr + item)
            lr = tl.where((lr != lr) | (lr == float("inf")), float("-inf"), lr)
            if BASE_E:
                lr = lr * 1.4426950408889634
            w = tl.exp2(lr - m) * inv
            # A zero-weight payload is not read (it may be NaN or stale).
            wv = tl.zeros([BLOCK_D], dtype=tl.float32) + w
            x = tl.load(inbox_ptr + item * D + d, mask=dmask & (wv != 0.0), other=0.0).to(tl.float32)
            acc += x * wv
        tl.store(out_ptr + pid * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
        tl.store(out_lse_ptr + pid, big_l)

    return dispatch, combine


def a2a_dispatch(partial_out: Tensor, partial_lse: Tensor, inbox: Tensor, inbox_lse: Tensor, out_offsets: Tensor,
                 lse_offsets: Tensor, epoch: Tensor, rank: int) -> None:
    """Step 2: store every destination's head shard of ``partial_out [T, H, D]``
    and ``partial_lse [T, H]`` into the destination's slot ``epoch % 2``.
    ``inbox [2, N, max_rows, H/N, D]`` / ``inbox_lse [2, N, max_rows, H/N]`` are
    this rank's; ``out_offsets`` / ``lse_offsets`` (int64 [N], elements) locate
    every rank's inbox relative to them."""
    dispatch, _ = _a2a_kernels()
    _, n, max_rows, hl, d = inbox.shape
    rows = partial_out.size(0)
    if rows == 0:
        return
    dispatch[(n * rows,)](partial_out, partial_lse, inbox, inbox_lse, out_offsets, lse_offsets, epoch, rows,
                          max_rows, rank, N=n, HL=hl, D=d, BLOCK=min(2048, _pow2(hl * d)),
                          BLOCK_H=_pow2(hl), VEC=16 // inbox.element_size(), num_warps=8)


def a2a_combine(inbox: Tensor, inbox_lse: Tensor, epoch: Tensor, rows: int, base2: bool,
                out: Tensor | None = None, out_lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Step 4: combine slot ``epoch % 2`` of this rank's inbox into
    ``([T, H/N, D], [T, H/N] fp32)``."""
    _, combine = _a2a_kernels()
    _, n, max_rows, hl, d = inbox.shape
    out = inbox.new_empty((rows, hl, d)) if out is None else out
    out_lse = inbox_lse.new_empty((rows, hl)) if out_lse is None else out_lse
    if rows:
        combine[(rows * hl,)](inbox, inbox_lse, epoch, out, out_lse, max_rows, N=n, N_POW2=max(2, _pow2(n)),
                              HL=hl, D=d, BLOCK_D=_pow2(d), BASE_E=not base2, num_warps=4)
    return out, out_lse


def a2a_call(partial_out: Tensor, partial_lse: Tensor, inbox: Tensor, inbox_lse: Tensor, out_offsets: Tensor,
             lse_offsets: Tensor, epoch: Tensor, rank: int, signal_round: Callable[[], object],
             base2: bool = False) -> tuple[Tensor, Tensor]:
    """One call of rank ``rank`` from its buffers (``a2a_dispatch``'s): the
    epoch advanced on the stream (1.), the dispatch (2.), ``signal_round()``
    (3.: every rank signals every peer and waits for every peer), the combine
    of slot ``epoch % 2`` (4.)."""
    po, pl = partial_out.contiguous(), partial_lse.contiguous()
    epoch.add_(1)  # 1. on the stream: a graph replay advances it
    a2a_dispatch(po, pl, inbox, inbox_lse, out_offsets, lse_offsets, epoch, rank)  # 2.
    signal_round()  # 3.
    return a2a_combine(inbox, inbox_lse, epoch, po.size(0), base2)  # 4.


class VllmA2AOutputLSE:
    """vLLM's direct symmetric-memory all-to-all for the Output/LSE boundary
    (see the module docstring): epoch, dispatch kernel, one signal round,
    combine kernel. Created collectively; every rank makes the same calls."""

    def __init__(self, group, max_rows: int, total_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        symm_mem = _symmetric_memory()

        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"vLLM a2a: argument 'dtype': expected bfloat16 or float16, got {dtype}")
        if head_dim % 8:
            raise ValueError(f"vLLM a2a: argument 'head_dim': expected a multiple of 8, got {head_dim}")
        self.group = group if group is not None else _default_group()
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if total_heads % self.n:
            raise ValueError(f"vLLM a2a: argument 'total_heads': expected a multiple of {self.n}, got {total_heads}")
        self.hl, self.dim, self.dtype, self.max_rows = total_heads // self.n, head_dim, dtype, max_rows
        _enable_for_group(symm_mem, self.group)
        name = self.group.group_name
        shape = (2, self.n, max_rows, self.hl, head_dim)
        self.inbox = symm_mem.empty(shape, dtype=dtype, device=device)
        self.inbox_lse = symm_mem.empty(shape[:-1], dtype=torch.float32, device=device)
        self.inbox.zero_()
        self.inbox_lse.zero_()
        torch.cuda.synchronize(device)
        self.h_out = symm_mem.rendezvous(self.inbox, name)
        self.h_lse = symm_mem.rendezvous(self.inbox_lse, name)
        # Keep the peer views alive with the offsets derived from them.
        self.peer_out = [self.h_out.get_buffer(r, list(shape), dtype, 0) for r in range(self.n)]
        self.peer_lse = [self.h_lse.get_buffer(r, list(shape[:-1]), torch.float32, 0) for r in range(self.n)]
        self.out_offsets = element_offsets(self.peer_out, self.inbox, device)
        self.lse_offsets = element_offsets(self.peer_lse, self.inbox_lse, device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.physical_bytes = self.inbox.numel() * self.inbox.element_size() + self.inbox_lse.numel() * 4
        self.h_out.barrier(channel=0)
        torch.cuda.synchronize(device)

    def combine(self, partial_out: Tensor, partial_lse: Tensor, base2: bool = False, return_lse: bool = True):
        check_partials("vLLM a2a", partial_out, self.n * self.hl, self.dim, self.dtype, self.max_rows)
        out, lse = a2a_call(partial_out, partial_lse, self.inbox, self.inbox_lse, self.out_offsets,
                            self.lse_offsets, self.epoch, self.rank, lambda: self.h_out.barrier(channel=0), base2)
        return (out, lse) if return_lse else out
