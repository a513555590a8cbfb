"""``FlashInferFusedCombine`` ("FlashInfer fused"): the structure of
FlashInfer's fused ``decode_cp_a2a_lse_reduce`` (read from the flashinfer-python
0.7.4 source: comm/dcp_lse_reduce.py, csrc/dcp_lse_reduce.cu,
include/flashinfer/comm/dcp_lse_reduce.cuh; vLLM 0.33 pins 0.7.2.post1),
written here from scratch in Triton over torch symmetric memory.

What FlashInfer does: one cooperative kernel exchanges and merges. Its
symmetric workspace (one byte buffer per rank) holds 16 bytes of epoch
metadata (word 0: the next epoch, word 1: this call's), two readiness arrays
``uint32 [2 slots][N sources]``, then, 16-byte aligned, the payload
``[2 slots][N sources][entries][D]`` and the LSEs ``[2 slots][N][entries]``
(an entry is a (row, local head) pair). The persistent grid (128 threads per
block, ``min(max(entries, N), co-resident blocks)`` blocks):

1. block 0 copies word 0 to word 1 and advances word 0 (a CUDA graph replay
   advances it); grid sync; every block reads the epoch, ``slot = epoch % 2``
   and the flag value ``epoch + 1``;
2. put: below 16 entries one block per destination stores all its entries
   into the destination's slot (at the sender's index), fences system-wide
   and release-stores the flag into the destination's readiness word of this
   sender; from 16 entries on, (destination, entry) pairs are spread over the
   whole grid, every block fences, grid sync, then block d publishes the flag
   of destination d;
3. block 0 spins (acquire, system scope) until every source's flag of the
   slot equals ``epoch + 1`` (no bound); grid sync;
4. merge: one block per entry (grid-stride): the N LSEs, NaN and +inf folded
   to -inf, max ``m`` (0 when every LSE is -inf), weights ``exp2(l - m)``
   (base 2) or ``exp(l - m)`` (base e: no base change), their sum in rank
   order, ``inv = 1/sum`` (0 when the sum is 0), ``acc += x_r * (w_r * inv)``
   in fp32 over every source in rank order (a zero-weight payload is still
   read and multiplied: a NaN in it leaks), one rounding to the payload dtype.
   No global LSE is returned.

Two slots and no acknowledgement: a rank writes slot p again at call n+2 only
after its call n+1 saw every peer's flag of n+1, sent after that peer's call n
(the last reader of slot p) finished.

What this reproduction keeps: the workspace layout and size, the epoch words,
the flag values, the two put schedules and their threshold, the grid shape,
the waits, the merge arithmetic and order, one launch per call. Where it
differs: peers are reached through torch symmetric memory's CUDA backend
(every peer's buffer mapped in this process, found at a fixed byte offset
from the own one) instead of NCCL LSA windows (``ncclGetLsaPointer``), which
cannot be built here; the grid syncs are a software barrier (an arrival count
and a generation word in a small local tensor, system-scope acquire/release)
over a grid of at most (co-resident programs per SM) x SMs programs, counted
from the compiled kernel's registers and shared memory as the CUDA occupancy
call counts them (2 per SM on a variant's first launch, what any kernel of
4 warps keeps resident), instead of a cooperative launch;
flags are published with a release exchange (an atomic) instead of a release
store, and polled without a sleep; every spin is bounded (``spin_limit``
polls), after which the kernel records the peer in a status word and goes on,
and the host raises a RuntimeError naming it (``check``, and every call made
outside CUDA graph capture); in the merge every thread of a program (4 warps,
FlashInfer's 128 threads) forms the max and the weight sum itself, where
FlashInfer's thread 0 forms them and shares them through shared memory (the
same operations in the same order); exp is Triton's (base e: exp, where
FlashInfer calls the fast ``__expf``); the source is read through strides, so the
benchmark's ``[T, H, D]`` (destination-major heads, the layout every path
gets) needs no permute copy (FlashInfer takes ``[T, H/N, N, D]``); the global
LSE is also written (one fp32 per entry; ``return_lse``). NVLink multicast
stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1); no multimem instruction is
used.

Under the Triton interpreter (programs run one after another) a wait on a
peer or on another program would never end, so the CPU tests run the same
code paths as two launches per simulated rank, ``phase="put"`` (epoch and
put) for every rank, then ``phase="merge"`` (wait and merge), without the
grid barrier; the fused launch runs there at world 1 on one program.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp.competitors._symm import (
    _default_group,
    _enable_for_group,
    _pow2,
    _symmetric_memory,
    check_partials,
    element_offsets,
)

SLOTS = 2
METADATA_BYTES = 16
#: From this many entries on, the put is spread over the whole grid.
ROW_DISTRIBUTED_MIN_ENTRIES = 16
MAX_RANKS = 64
#: Polls of a flag or of the grid barrier before a program gives up.
SPIN_LIMIT = 1 << 22
#: The local sync words: grid barrier arrivals, its generation, the first
#: peer that never signalled (+1), grid barrier give-ups.
SYNC_WORDS = 4
#: Warps of a program: FlashInfer's 128 threads per block.
NUM_WARPS = 4
#: Blocks per SM any kernel of NUM_WARPS warps keeps resident (255 registers a thread).
SAFE_BLOCKS_PER_SM = 2


def payload_offset(n: int) -> int:
    """Bytes before the payload: the epoch words and the two readiness arrays, 16-byte aligned."""
    return (METADATA_BYTES + SLOTS * n * 4 + 15) // 16 * 16


def workspace_bytes(max_entries: int, n: int, head_dim: int, dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return payload_offset(n) + SLOTS * n * max_entries * (head_dim * item + 4)


def workspace_views(ws: Tensor, n: int, max_entries: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Typed views of a byte workspace: ``state`` int32 [4], ``ready`` int32
    [2, N], ``recv`` [2, N, entries, D], ``recv_lse`` fp32 [2, N, entries]."""
    item = torch.empty((), dtype=dtype).element_size()
    p = payload_offset(n)
    out_bytes = SLOTS * n * max_entries * head_dim * item
    return {"state": ws[:METADATA_BYTES].view(torch.int32),
            "ready": ws[METADATA_BYTES:METADATA_BYTES + SLOTS * n * 4].view(torch.int32).view(SLOTS, n),
            "recv": ws[p:p + out_bytes].view(dtype).view(SLOTS, n, max_entries, head_dim),
            "recv_lse": ws[p + out_bytes:p + out_bytes + SLOTS * n * max_entries * 4].view(torch.float32)
            .view(SLOTS, n, max_entries)}


# ---------------------------------------------------------------------------
# The merge in plain torch (the specification the CPU tests hold the kernel
# to), then the kernel.
# ---------------------------------------------------------------------------


def fi_merge_math(recv: Tensor, recv_lse: Tensor, base2: bool = False) -> tuple[Tensor, Tensor]:
    """Step 4 in plain torch: received payloads ``[N, E, D]`` and LSEs ``[N, E]``
    -> ``([E, D]`` in the payload dtype, ``[E]`` fp32 global LSE). Sums in
    rank order; every payload is multiplied by its weight, zero or not."""
    inf = math.inf
    l = recv_lse.float()
    l = torch.where(torch.isnan(l) | (l == inf), -inf, l)
    m = l.amax(dim=0)
    m = torch.where(m == -inf, 0.0, m)
    e = torch.exp2(l - m) if base2 else torch.exp(l - m)
    denom = torch.zeros_like(m)
    for r in range(l.size(0)):
        denom = denom + e[r]
    inv = torch.where(denom == 0, 0.0, 1.0 / denom)
    acc = torch.zeros(recv.shape[1:], dtype=torch.float32, device=recv.device)
    for r in range(recv.size(0)):
        acc = acc + recv[r].float() * (e[r] * inv).unsqueeze(-1)
    lse = torch.where(denom > 0, m + (torch.log2(denom) if base2 else torch.log(denom)), -inf)
    return acc.to(recv.dtype), lse


def fi_combine_math(partials: Tensor, lses: Tensor, rank: int, base2: bool = False) -> tuple[Tensor, Tensor]:
    """The whole boundary for ``rank`` in plain torch: every rank's partials
    ``[N, T, H, D]`` and LSEs ``[N, T, H]`` -> its heads ``([T, H/N, D], [T, H/N])``:
    what the put leaves in its slot (``[src, t * H/N + h]`` = source ``src``'s
    head ``rank * H/N + h`` of row ``t``), merged by ``fi_merge_math``."""
    n, t, h, d = partials.shape
    hl = h // n
    heads = slice(rank * hl, (rank + 1) * hl)
    out, lse = fi_merge_math(partials[:, :, heads].reshape(n, t * hl, d), lses[:, :, heads].reshape(n, t * hl),
                             base2)
    return out.view(t, hl, d), lse.view(t, hl)


def _fi_kernel():
    """The kernel (its module is imported on first use: importing this one
    needs no Triton, and TRITON_INTERPRET is read when the kernel is defined)."""
    from torch_sdcp.competitors import _flashinfer_kernels

    return _flashinfer_kernels.fused


def fi_launch(partial_out: Tensor, partial_lse: Tensor, views: dict, peer_bytes: Tensor, sync: Tensor, rank: int,
              base2: bool, grid_cap: int, phase: str = "fused", spin_limit: int = SPIN_LIMIT,
              out: Tensor | None = None, out_lse: Tensor | None = None) -> tuple[Tensor, Tensor, object]:
    """One call on rank ``rank``: ``partial_out [T, H, D]`` / ``partial_lse [T, H]``
    (destination-major heads) -> ``([T, H/N, D], [T, H/N] fp32)``. ``views`` are
    this rank's ``workspace_views``; ``peer_bytes`` (int64 [N]) every rank's
    workspace's byte offset from this one; ``sync`` int32 [4] local, zeroed
    once. ``phase``: "fused" (one launch, grid barriers), or "put" / "merge"
    (the interpreter's two launches, no grid barrier). Also returns the
    compiled kernel launched (None when nothing was), for its occupancy."""
    if phase not in ("fused", "put", "merge"):
        raise ValueError(f"FlashInfer fused: argument 'phase': expected 'fused', 'put' or 'merge', got {phase!r}")
    fused = _fi_kernel()
    _, n, max_entries, d = views["recv"].shape
    rows, heads = partial_out.shape[:2]
    hl = heads // n
    entries = rows * hl
    out = partial_out.new_empty((rows, hl, d)) if out is None else out
    out_lse = partial_lse.new_empty((rows, hl)) if out_lse is None else out_lse
    if entries == 0:
        return out, out_lse, None
    grid = max(1, min(max(entries, n), grid_cap))
    so, sl = partial_out.stride(), partial_lse.stride()
    compiled = fused[(grid,)](
        partial_out, partial_lse, so[0], so[1], hl * so[1], sl[0], sl[1], hl * sl[1], views["state"],
        views["ready"], views["recv"], views["recv_lse"], peer_bytes, sync, out, out_lse, entries, max_entries, rank,
        spin_limit, N=n, HL=hl, D=d, BLOCK_D=_pow2(d), ELEM=partial_out.element_size(),
        ROW_DISTRIBUTED=entries >= ROW_DISTRIBUTED_MIN_ENTRIES, BASE_E=not base2, DO_PUT=phase != "merge",
        DO_MERGE=phase != "put", GRID_SYNC=phase == "fused", num_warps=NUM_WARPS)
    return out, out_lse, compiled


def resident_blocks_per_sm(compiled, props) -> int | None:
    """Blocks of ``compiled`` one SM keeps resident (threads, registers with
    their 256-per-warp granularity, shared memory with 1 KiB reserved per
    block), as cudaOccupancyMaxActiveBlocksPerMultiprocessor counts them for
    FlashInfer's grid; None where the kernel does not say its registers."""
    regs = getattr(compiled, "n_regs", 0)
    if not regs:
        return None
    by_threads = props.max_threads_per_multi_processor // (32 * NUM_WARPS)
    by_regs = props.regs_per_multiprocessor // (-(-regs * 32 // 256) * 256) // NUM_WARPS
    by_smem = props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024)
    return max(1, min(32, by_threads, by_regs, by_smem))


def check_status(sync: Tensor, rank: int) -> None:
    """Raise the RuntimeError for a spin that gave up (``sync``'s words 2 and 3)."""
    peer, barrier = (int(v) for v in sync[2:4].tolist())
    if peer:
        raise RuntimeError(f"FlashInfer fused: rank {rank} gave up waiting for peer {peer - 1}'s flag after "
                           f"the spin limit (the peer never published its put)")
    if barrier:
        raise RuntimeError(f"FlashInfer fused: rank {rank}: the grid barrier gave up after the spin limit "
                           f"({barrier} times; the grid was not co-resident)")


class FlashInferFusedCombine:
    """FlashInfer's fused exchange + merge for the Output/LSE boundary (see the
    module docstring). Created collectively; every rank makes the same calls."""

    def __init__(self, group, max_rows: int, total_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, spin_limit: int = SPIN_LIMIT):
        symm_mem = _symmetric_memory()

        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer fused: argument 'dtype': expected bfloat16 or float16, got {dtype}")
        if head_dim * torch.empty((), dtype=dtype).element_size() % 16:
            raise ValueError(f"FlashInfer fused: argument 'head_dim': expected rows of a multiple of 16 bytes, "
                             f"got {head_dim}")
        self.group = group if group is not None else _default_group()
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.n > MAX_RANKS:
            raise ValueError(f"FlashInfer fused: group size: expected at most {MAX_RANKS}, got {self.n}")
        if total_heads % self.n:
            raise ValueError(f"FlashInfer fused: argument 'total_heads': expected a multiple of {self.n}, "
                             f"got {total_heads}")
        self.hl, self.dim, self.dtype, self.max_rows = total_heads // self.n, head_dim, dtype, max_rows
        self.spin_limit = spin_limit
        self.props = torch.cuda.get_device_properties(device)
        # Co-resident blocks per SM of each kernel variant (row-distributed
        # put, base), measured on its first launch, which runs SAFE_BLOCKS_PER_SM.
        self.blocks_per_sm: dict = {}
        _enable_for_group(symm_mem, self.group)
        nbytes = workspace_bytes(max_rows * self.hl, self.n, head_dim, dtype)
        self.workspace = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        # Epoch and flags start at 0; the payload is written before it is read.
        self.workspace[:payload_offset(self.n)].zero_()
        torch.cuda.synchronize(device)
        self.handle = symm_mem.rendezvous(self.workspace, self.group.group_name)
        # Keep the peer views alive with the offsets derived from them.
        self.peers = [self.handle.get_buffer(r, [nbytes], torch.uint8, 0) for r in range(self.n)]
        self.peer_bytes = element_offsets(self.peers, self.workspace, device)
        self.views = workspace_views(self.workspace, self.n, max_rows * self.hl, head_dim, dtype)
        self.sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
        self.physical_bytes = nbytes
        self.handle.barrier(channel=0)
        torch.cuda.synchronize(device)

    def check(self) -> None:
        """Raise a RuntimeError if a wait of an earlier call gave up (synchronizes)."""
        check_status(self.sync, self.rank)

    def combine(self, partial_out: Tensor, partial_lse: Tensor, base2: bool = False, return_lse: bool = True):
        rows = partial_out.size(0)
        check_partials("FlashInfer fused", partial_out, self.n * self.hl, self.dim, self.dtype, self.max_rows)
        if not torch.cuda.is_current_stream_capturing():
            self.check()
        po = partial_out if partial_out.stride(-1) == 1 else partial_out.contiguous()
        key = (rows * self.hl >= ROW_DISTRIBUTED_MIN_ENTRIES, base2)
        per_sm = self.blocks_per_sm.get(key, SAFE_BLOCKS_PER_SM)
        out, lse, compiled = fi_launch(po, partial_lse, self.views, self.peer_bytes, self.sync, self.rank, base2,
                                       per_sm * self.props.multi_processor_count, spin_limit=self.spin_limit)
        if key not in self.blocks_per_sm and compiled is not None:
            self.blocks_per_sm[key] = resident_blocks_per_sm(compiled, self.props) or SAFE_BLOCKS_PER_SM
        return (out, lse) if return_lse else out
