"""A device-side signal round for competitors whose ranks reach each other's
buffers with no process group behind them (the bench's virtual ranks on one
GPU, bench/one_gpu_competitors.py), in place of torch symmetric memory's
host-driven barrier (``handle.barrier``).

The structure of vLLM's own signal kernel: one flag per peer. Every rank's
flag array is ``int64 [N]`` in its peer-addressable memory; a round of call
epoch ``e`` (the competitor's device epoch) release-stores ``e`` into its
word (index ``rank``) of every rank's array (itself included; a release
exchange, an atomic, at system scope), then spins with acquire loads until
every word of its own array reached ``e``. The spins are bounded
(``spin_limit`` polls): a round that gives up raises a sticky status word
(this rank's, ``int32 [1]``) that the host reads when it checks
(``check_status``), where vLLM's spin has no bound.

Two slots and no acknowledgement stay correct with a single round: a rank
reaches round ``e + 1`` only after its round ``e`` saw every peer's ``e``,
which the peer sent after its call ``e - 1`` (the last reader of the slot
``e + 1`` writes) finished.

Under the Triton interpreter (programs and ranks run one after another) a
wait on a peer that has not run would never end: the CPU tests run
``phase="publish"`` for every rank, then ``phase="wait"``.
"""

from __future__ import annotations

import functools

from torch import Tensor

from torch_sdcp.competitors._symm import _pow2

PHASES = ("round", "publish", "wait")


@functools.cache
def _kernel():
    """The kernel (defined on first use: importing this module needs no
    Triton, and TRITON_INTERPRET is read when it is defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def signal_round(flags_ptr, flag_offsets, epoch_ptr, status_ptr, rank, spin_limit, N: tl.constexpr,
                     N_POW2: tl.constexpr, PUBLISH: tl.constexpr, WAIT: tl.constexpr):
        epoch = tl.load(epoch_ptr)
        peer = tl.arange(0, N_POW2)
        mask = peer < N
        if PUBLISH:  # this rank's word of every rank's flag array
            words = flags_ptr + tl.load(flag_offsets + peer, mask=mask, other=0) + rank
            tl.atomic_xchg(words, tl.zeros([N_POW2], dtype=tl.int64) + epoch, mask=mask, sem="release",
                           scope="sys")
        if WAIT:  # every peer's word of this rank's array
            seen = tl.atomic_add(flags_ptr + peer, 0, mask=mask, sem="acquire", scope="sys")
            pending = tl.max(tl.where(mask & (seen < epoch), 1, 0), axis=0)
            spins = 0
            while (pending != 0) & (spins < spin_limit):
                seen = tl.atomic_add(flags_ptr + peer, 0, mask=mask, sem="acquire", scope="sys")
                pending = tl.max(tl.where(mask & (seen < epoch), 1, 0), axis=0)
                spins += 1
            tl.atomic_max(status_ptr, pending)  # sticky: a later round that passes does not clear it

    return signal_round


def signal_round(flags: Tensor, flag_offsets: Tensor, epoch: Tensor, status: Tensor, rank: int, spin_limit: int,
                 phase: str = "round") -> None:
    """One round on this rank's stream: ``flags`` int64 [N] (this rank's),
    ``flag_offsets`` int64 [N] (every rank's flags, in elements from this
    one), ``epoch`` int64 [1] (the call's, on the device), ``status`` int32
    [1] (this rank's). ``phase``: "round" (publish and wait, one launch), or
    "publish" / "wait" (the interpreter's two launches)."""
    if phase not in PHASES:
        raise ValueError(f"signal round: argument 'phase': expected one of {PHASES}, got {phase!r}")
    n = flags.numel()
    if flag_offsets.numel() != n:
        raise ValueError(f"signal round: argument 'flag_offsets': expected {n} offsets, got {flag_offsets.numel()}")
    _kernel()[(1,)](flags, flag_offsets, epoch, status, rank, spin_limit, N=n, N_POW2=max(2, _pow2(n)),
                    PUBLISH=phase != "wait", WAIT=phase != "publish", num_warps=1)


def check_status(status: Tensor, rank: int, what: str) -> None:
    """Raise the RuntimeError for a round of ``what`` that gave up (synchronizes)."""
    if int(status[0]):
        raise RuntimeError(f"{what}: rank {rank}'s signal round gave up after its spin limit (a peer never "
                           "signalled; on one GPU: the ranks' grids were not all resident)")
