"""The agreement of the ranks on the collective path of a call with more rows
than ``max_rows``: every rank says on the group's store that it takes that
path, with which call and how many rows, before any rank enters a collective
(docs/PROTOCOL.md "Failure behaviour")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch_sdcp.peer.collectives import AgreementAbandoned

if TYPE_CHECKING:
    from torch_sdcp.peer import PeerArena

#: Calls whose collective paths run the same collectives: alike for the agreement on that path.
_SAME_COLLECTIVES = {"combine_out": "combine", "gather_view": "gather"}


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "the peers"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def agree_collective_path(arena: PeerArena, *, name: str, rank: int, max_rows: int,
                          timeout_s: float, what: str, rows: int, index: int,
                          peer_failure: Callable[[], str | None], tag: int | None = None) -> None:
    """Before the collectives of the call ``what`` of ``rows`` rows (the
    ``index``-th collective-path call of this arena), every rank says on the
    group's store that it takes the collective path and waits, within
    ``timeout_s``, for every peer to say the same: a rank that took the peer
    path, or a different call, is named on every rank and no rank enters a
    collective, so none is left waiting in one. ``peer_failure`` says why the
    peers will not come (a peer aborted the workspace, or exited), or None.
    The caller skips it where there is no peer (one rank) and under tracing.
    The call's ``tag`` (None: untagged) is part of what the ranks compare, as
    the peer path's call header carries it."""
    where = (f"torch_sdcp: {name} on rank {rank}: {what}() has {rows} rows > max_rows = "
             f"{max_rows} on this rank and takes the collective path")
    mine = f"{_SAME_COLLECTIVES.get(what, what)}() with {rows} rows" + ("" if tag is None else f" (call tag {tag})")
    try:
        got = arena.agree_call(f"collective{index}", mine.encode(), timeout_s, peer_failure)
    except AgreementAbandoned as e:
        missing = _ranks(e.missing)
        if not e.mine:
            late = " before this rank came" if rank in e.missing else ""
            why = f": {e.reason}" if e.reason else ""
            raise RuntimeError(f"{where}, but rank {e.by_rank} gave up on this call after {e.waited_s:.3g} s "
                               f"waiting for {missing}{late}{why}; no rank entered a collective") from None
        if e.reason is not None:
            raise RuntimeError(f"{where}; it stopped waiting for {missing} to take it: {e.reason}; no rank "
                               "entered a collective") from None
        raise RuntimeError(f"{where}, but {missing} did not take the collective path within timeout_s = "
                           f"{timeout_s:g} s (took the peer path for this call, or did not call); no rank "
                           "entered a collective") from None
    if any(g != got[0] for g in got):
        sides = ", ".join(f"rank {r}: {g.decode()}" for r, g in enumerate(got))
        raise RuntimeError(f"torch_sdcp: {name} on rank {rank}: call mismatch on the collective "
                           f"path (more rows than max_rows = {max_rows}): {sides}; no rank entered a collective")
