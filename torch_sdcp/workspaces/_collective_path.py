"""The agreement of the ranks on the collective path of a call with more rows
than ``max_rows``: every rank says on the group's store that it takes that
path, with which call and how many rows, before any rank enters a collective
(docs/PROTOCOL.md "Failure behaviour"); a call whose peers took the peer path
of it instead (their rows within the bound) is voided with their rows
(``agree_over_rows``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from torch_sdcp._checks import arg_error
from torch_sdcp.peer.store_sync import AgreementAbandoned

if TYPE_CHECKING:
    from torch_sdcp.peer import PeerArena
    from torch_sdcp.peer.group_order import Turn

#: Calls whose collective paths run the same collectives: alike for the agreement on that path.
_SAME_COLLECTIVES = {"combine_out": "combine", "gather_view": "gather"}
#: Calls whose peer path is a view call (its own call index and header set).
VIEW_CALLS = frozenset({"gather_view"})
#: Calls of a workspace with both kinds of call (a view call, a copying call), each with its own headers.
_TWO_KINDS = frozenset({"gather", "gather_view", "all_gather_heads"})
#: How a reason to give the agreement up starts when a peer took the peer path of the call.
_PEER_PATH = "took the peer path of this call"
#: What the error of a call over max_rows on this rank only claims, true once its void call is done.
VOID_CLAIM = "the call is void on every rank, and the workspace stays usable"
#: What it says instead when the void call failed (a peer's call differs in more than the rows).
VOID_FAILED = ("its void call failed (a peer's call differs in more than the rows), so the workspace is poisoned "
               "on this rank and aborted on every rank; re-create it")
#: The sentinel word: a header word that has not landed (csrc/dataflag.h kSentinel).
_SENTINEL = 0xFFFFFFFF
#: The void bit of a header's dtype word (csrc/dataflag.h kHeaderVoidBit).
_VOID_BIT = 0x80000000


class PeerPathTaken(Exception):
    """A call over max_rows on this rank met a peer that took the peer path
    of the same call (its rows are within the bound there): no rank entered a
    collective; the call is to be voided with the peers' rows."""


def peer_rows(handle: int, rank: int, view: bool) -> dict[int, int]:
    """The rows of the peers whose call header of this rank's next call (view
    call with ``view``) has landed here: the peers on the peer path of it
    (csrc/workspace.cpp workspace_peer_headers; on CUDA the caller has
    synchronised its stream). When only void headers landed (another rank
    over the bound voided the call first, with a placeholder of the rows of
    the peers it saw), theirs; else only the others."""
    words = torch.ops.sdcp.workspace_peer_headers(handle, view)
    header = words[1:]
    landed: dict[int, int] = {}
    void: dict[int, int] = {}
    for r in range(len(header) // 4):
        w = header[4 * r:4 * r + 4]
        if r != rank and _SENTINEL not in w:
            (void if w[1] & _VOID_BIT else landed)[r] = int(w[0])
    return landed or void


def peer_in_a_call(handle: int, rank: int, two_kinds: bool) -> bool:
    """Whether a peer's call header of this rank's next call has landed here (of either kind of
    call, for a workspace with ``two_kinds``): that peer is inside a call this rank has not made."""
    return bool(peer_rows(handle, rank, False) or (two_kinds and peer_rows(handle, rank, True)))


def describe_peer_rows(landed: dict[int, int]) -> str:
    """``rank 0 with 100 rows, rank 2 with 100 rows``."""
    return ", ".join(f"rank {r} with {rows} rows" for r, rows in sorted(landed.items()))


def peer_path_probe(handle: int, rank: int, view: bool, two_kinds: bool,
                    peer_failure: Callable[[], str | None]) -> Callable[[], str | None]:
    """A ``give_up`` for the agreement of a call over max_rows: why the peers
    will not come (``peer_failure``), or that one of them took the peer path
    of this call (its header landed here), or, for a workspace with
    ``two_kinds`` of call, that one took the peer path of a call of the other
    kind (a view call against a copying one: a call mismatch, which no void
    call can stand for), or None."""
    def give_up() -> str | None:
        failure = peer_failure()
        if failure is not None:
            return failure
        landed = peer_rows(handle, rank, view)
        if landed:
            return f"{_PEER_PATH}: {describe_peer_rows(landed)}"
        other = peer_rows(handle, rank, not view) if two_kinds else {}
        if other:
            kind = "a copying call (gather or all_gather_heads)" if view else "a view call (gather_view)"
            return (f"call mismatch: {describe_peer_rows(other)} took the peer path of {kind} instead; every rank "
                    "must make the same calls in the same order")
        return None
    return give_up


def took_peer_path(e: AgreementAbandoned) -> bool:
    """Whether an agreement was given up because a peer took the peer path."""
    return e.reason is not None and e.reason.startswith(_PEER_PATH)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "the peers"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def agree_collective_path(arena: PeerArena, *, name: str, rank: int, max_rows: int,
                          timeout_s: float, what: str, rows: int, index: int,
                          peer_failure: Callable[[], str | None], tag: int | None = None,
                          header: str = "") -> None:
    """Before the collectives of the call ``what`` of ``rows`` rows (the
    ``index``-th call of this workspace), every rank says on the
    group's store that it takes the collective path and waits, within
    ``timeout_s``, for every peer to say the same: a rank that made a
    different call is named on every rank and no rank enters a collective, so
    none is left waiting in one. ``peer_failure`` says why the peers will not
    come (a peer aborted the workspace, or exited, or took the peer path of
    this call: ``peer_path_probe``; then PeerPathTaken), or None.
    The caller skips it where there is no peer (one rank) and under tracing.
    The call's ``tag`` (None: untagged) and ``header`` (the rest of what the
    peer path's call header carries: the LSE base, the RoPE style and the
    q_scale, as a mismatch there names them) are part of what the ranks
    compare; a mismatch names the header's two sides only where they differ."""
    where = (f"torch_sdcp: {name} on rank {rank}: {what}() has {rows} rows > max_rows = "
             f"{max_rows} on this rank and takes the collective path")
    mine = f"{_SAME_COLLECTIVES.get(what, what)}() with {rows} rows" + ("" if tag is None else f" (call tag {tag})")
    mine += f"\n{header}"
    try:
        got = arena.agree_call(f"collective{index}", mine.encode(), timeout_s, peer_failure)
    except AgreementAbandoned as e:
        if took_peer_path(e):
            raise PeerPathTaken(e.reason) from None
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
        calls = [g.decode().partition("\n") for g in got]
        same_header = all(c[2] == calls[0][2] for c in calls)
        sides = ", ".join(f"rank {r}: {c[0]}" + ("" if same_header else f", {c[2]}") for r, c in enumerate(calls))
        raise RuntimeError(f"torch_sdcp: {name} on rank {rank}: call mismatch on the collective "
                           f"path (more rows than max_rows = {max_rows}): {sides}; no rank entered a collective")


class OverRowsHost(Protocol):
    """What the agreement of a call over max_rows reads of its workspace."""

    handle: int | None
    rank: int
    world_size: int
    timeout_s: float
    arena: PeerArena | None
    device: torch.device

    @property
    def max_rows(self) -> int: ...


class RowsDiffer(NamedTuple):
    """A call over max_rows on this rank whose peers took the peer path of it: the rows of its
    void placeholder (the peers' rows) and the argument error the call raises."""

    peer_rows: int
    error: ValueError


def _peer_failure(handle: int | None) -> str | None:
    """Why the peers of the workspace ``handle`` will not come (a peer aborted
    it, or exited), or None."""
    if handle is None:
        return None
    try:
        torch.ops.sdcp.workspace_check(handle)
    except RuntimeError as e:
        return str(e)
    return None


def agree_over_rows(host: OverRowsHost, name: str, what: str, rows: int, arg: str, index: int,
                    tag: int | None, header: str, hold: Callable[[Turn], None]) -> RowsDiffer | None:
    """The collective path of the call ``what`` of ``rows`` rows > max_rows (the ``index``-th
    call of the workspace ``host``, named ``name``): its turn in the group's order (handed to
    ``hold``, which keeps it until the call ends), then the agreement of every rank
    (``agree_collective_path``). None when every rank agreed (or there is no peer to agree
    with); a ``RowsDiffer`` when the peers took the peer path of the call instead."""
    arena = host.arena
    if arena is None or host.world_size == 1 or torch.compiler.is_compiling():
        return None  # no peer to agree with (under tracing, no call to agree on)
    handle = host.handle
    peer_failure = functools.partial(_peer_failure, handle)
    give_up: Callable[[], str | None] = peer_failure
    view = what in VIEW_CALLS
    capturing = host.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if handle is not None and not capturing:
        # A peer within the bound takes the peer path of this call: its header lands here,
        # for this rank's next call, whose index is exact once no call of this rank runs.
        if host.device.type == "cuda":
            torch.cuda.current_stream(host.device).synchronize()
        give_up = peer_path_probe(handle, host.rank, view, what in _TWO_KINDS, peer_failure)
    try:
        # One order of these sections per group in this process (two workspaces of one group
        # on two threads), held from the agreement until the call ends.
        hold(arena.collective_turn(f"collective{index}", host.timeout_s, give_up))
        agree_collective_path(arena, name=name, rank=host.rank, max_rows=host.max_rows,
                              timeout_s=host.timeout_s, what=what, rows=rows, index=index,
                              peer_failure=give_up, tag=tag, header=header)
    except AgreementAbandoned as e:  # the turn's
        if not took_peer_path(e):
            raise RuntimeError(f"torch_sdcp: {name} on rank {host.rank}: {what}() has {rows} rows > max_rows = "
                               f"{host.max_rows} on this rank and takes the collective path; {e.reason}; no rank "
                               "entered a collective") from None
        return rows_differ(host, name, rows, arg, view, peer_failure)
    except PeerPathTaken:
        return rows_differ(host, name, rows, arg, view, peer_failure)
    return None


def rows_differ(host: OverRowsHost, name: str, rows: int, arg: str, view: bool,
                peer_failure: Callable[[], str | None]) -> RowsDiffer:
    """A call of ``rows`` rows, over max_rows on this rank, whose peers (some of them) took the
    peer path of the same call with rows within the bound: no rank entered a collective, so
    the call is voided (its placeholder takes the peers' rows, every peer's call raises
    VoidedCallError naming this error) and the workspace stays usable. The rows mismatch is
    this call's argument error, once the peers' rows are known (their headers landed here:
    bounded by timeout_s)."""
    assert host.handle is not None
    start = time.monotonic()
    landed = peer_rows(host.handle, host.rank, view)
    while not landed:
        failure = peer_failure()
        waited = time.monotonic() - start
        if failure is not None or waited >= host.timeout_s:
            raise RuntimeError(
                f"torch_sdcp: {name} on rank {host.rank}: {rows} rows > max_rows = {host.max_rows} "
                f"on this rank, and a peer took the peer path of the call, but no peer's call header came "
                f"within {waited:.3g} s" + (f": {failure}" if failure is not None else ""))
        time.sleep(1e-3)
        landed = peer_rows(host.handle, host.rank, view)
    theirs = landed[min(landed)]
    if theirs > host.max_rows:  # no peer sends a header over the bound: the header is not this call's
        raise RuntimeError(f"torch_sdcp: {name} on rank {host.rank}: a peer's call header of "
                           f"{theirs} rows > max_rows = {host.max_rows} ({describe_peer_rows(landed)})")
    return RowsDiffer(theirs, arg_error(
        arg, f"{theirs} rows ({describe_peer_rows(landed)}, the peer path)",
        f"{rows} rows (over max_rows = {host.max_rows} on this rank only): every rank must call "
        f"with the same rows; {VOID_CLAIM}"))
