"""The capability gate of a PeerArena's creation: a write-and-verify probe through the mapping."""

from __future__ import annotations

from typing import Protocol

import torch

from .agreements import _Agreement, _hook
from .backend import MemoryBackend


class ProbedArena(Protocol):
    """What the probe uses of the PeerArena being created (arena.py, which imports this module)."""

    world_size: int
    rank: int
    stride: int

    def _raw_words(self, r: int, offset: int, count: int) -> torch.Tensor: ...

    def _sync(self) -> None: ...


def _word(src: int, dst: int) -> int:
    """Probe word that rank src writes into rank dst's region (distinct per pair, non-zero)."""
    return 0x5344_4350_0000_0000 | ((src & 0xFFFF) << 16) | (dst & 0xFFFF)


def probe_mapping(arena: ProbedArena, steps: _Agreement, mem: MemoryBackend, infos: list) -> bool | None:
    """The capability gate of a PeerArena's creation (its last step): every rank writes a word
    distinct per pair into the head and the tail of every region through the mapping, then
    verifies the words in its own region and re-zeroes them, and checks the backend's peer
    capabilities; each half is agreed on by every rank. Returns native_peer_atomics (True, False
    or None: unknown)."""
    N, me, stride = arena.world_size, arena.rank, arena.stride
    tail = stride - 8 * N if stride >= 16 * N else None
    # write: word(me, dst) at 8*me of the head and of the tail of every region
    err: Exception | None = None
    try:
        _hook("probe")
        for dst in range(N):
            for off in (0, tail):
                if off is not None:
                    arena._raw_words(dst, off, N)[me:me + 1].fill_(_word(me, dst))
        arena._sync()
    except Exception as e:
        err = RuntimeError(f"probe write through the mapping failed: {e}")
    steps.agree("probe write", err)
    # verify our region, re-zero the probe words, check peer capabilities
    err = None
    atomics: bool | None = True
    try:
        bad = []
        for off in (0, tail):
            if off is None:
                continue
            words = arena._raw_words(me, off, N)
            got = words.cpu().tolist()
            for src in range(N):
                want = _word(src, me)
                if got[src] != want:
                    bad.append(f"word of rank {src} at offset {off + 8 * src}: got "
                               f"0x{got[src] & (2**64 - 1):016x}, expected 0x{want:016x}")
            words.zero_()
        arena._sync()
        if bad:
            raise RuntimeError("write-and-verify probe: stores through the peer mapping did "
                               "not arrive (" + "; ".join(bad) + ")")
        atomics = mem.check_peer_access(infos)
    except Exception as e:
        err = e
    extras = steps.agree("probe verify", err, atomics)
    # host: every rank reports True
    return None if any(a is None for a in extras) else all(extras)
