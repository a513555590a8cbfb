"""The process groups torch_sdcp agrees over, in this process: each one's store, name, the
PeerArenas created on it, its order of collective-path sections, and whether it is refused
(after a timed-out agreement this process refuses the group for torch_sdcp's use:
``GroupOutOfStepError``)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch.distributed as dist

from .group_order import GroupOrder
from .store_sync import AgreementAbandoned


class GroupOutOfStepError(RuntimeError):
    """A torch_sdcp agreement over a process group timed out, on this rank or on a peer that gave
    it up before this rank came: the ranks' torch_sdcp steps on the group no longer pair, and this
    process refuses the group for torch_sdcp's use. Re-create the process group."""



class _GroupState:
    __slots__ = ("arenas", "closed", "order", "pids", "refused")

    def __init__(self) -> None:
        self.arenas = 0  # PeerArena creations on the group in this process: the same on every rank
        self.refused: str | None = None
        self.order: GroupOrder | None = None  # of the collective-path sections, once one ran
        # The store prefixes of the group's arenas closed in this process, recorded from the first
        # close on, before this rank has an order: a section of one that rank 0 named is skipped.
        self.closed: set[str] = set()
        self.pids: dict[int, int] = {}  # rank -> pid of the peers, as the group's last creation learnt them


_groups: weakref.WeakKeyDictionary[Any, _GroupState] = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def _state(group) -> _GroupState:
    with _groups_lock:
        state = _groups.get(group)
        if state is None:
            state = _groups[group] = _GroupState()
        return state


def group_label(group) -> str:
    return f"'{getattr(group, 'group_name', None) or '?'}'"


def group_store(group) -> dist.Store:
    """The group's c10d store (a PrefixStore private to the group), whatever its backend."""
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"torch_sdcp: cannot find the c10d store of the process group {group_label(group)} "
                           f"({type(e).__name__}: {e}); torch_sdcp agrees over it") from None
    if store is None:
        raise RuntimeError(f"torch_sdcp: the process group {group_label(group)} has no c10d store")
    return store


def check_group(group, what: str) -> None:
    """Raise GroupOutOfStepError if this process refuses ``group`` (after a timed-out agreement)."""
    refused = _state(group).refused
    if refused is not None:
        raise GroupOutOfStepError(f"torch_sdcp: {refused} ({what} refused)")


def is_refused(group) -> bool:
    return _state(group).refused is not None


def refuse_group(group, stage: str, gave_up: AgreementAbandoned) -> str:
    """Refuse ``group`` from now on; returns the sentence that says why (the first one stays)."""
    if gave_up.reason is None:
        text = (f"the process group {group_label(group)} is out of step after a timed-out {stage} on rank "
                f"{gave_up.by_rank} (waited for ranks {gave_up.missing}); re-create the process group")
    else:  # not a timeout: say what ended the wait (a peer's exit, an interrupt, the store)
        text = (f"the process group {group_label(group)} is out of step after a {stage} given up on rank "
                f"{gave_up.by_rank} ({gave_up.reason}; waited for ranks {gave_up.missing}); re-create the "
                "process group")
    state = _state(group)
    with _groups_lock:
        if state.refused is None:
            state.refused = text
    return text


def next_arena_number(group) -> int:
    state = _state(group)
    with _groups_lock:
        state.arenas += 1
        return state.arenas


def arena_count(group) -> int:
    """The PeerArena creations begun on ``group`` in this process so far."""
    return _state(group).arenas


def forget_arena(group, prefix: str) -> None:
    """An arena of ``group`` (its store prefix) is closed in this process: its sections of the
    group's order will not run here (recorded even before this rank has an order: rank 0 may have
    named one that this rank never ran, whose verdict goes with the arena), and the names of those
    that rank 0 already named are read now, so that their keys go."""
    state = _state(group)
    with _groups_lock:
        state.closed.add(prefix)
    with contextlib.suppress(Exception):  # the group or its store is gone (interpreter exit): nothing to read
        group_order(group).forget(prefix)


def remember_pids(group, pids: dict[int, int]) -> None:
    """The peers' pids ({rank: pid}) that a creation on ``group`` learnt: the next creation watches
    them from its first step, before the peers publish theirs."""
    state = _state(group)
    with _groups_lock:
        state.pids = dict(pids)


def known_pids(group) -> dict[int, int]:
    """The peers' pids that the group's last creation learnt ({} before the first)."""
    state = _state(group)
    with _groups_lock:
        return dict(state.pids)


def group_order(group) -> GroupOrder:
    """The order of the collective-path sections on ``group`` in this process (one per group)."""
    state = _state(group)
    with _groups_lock:
        if state.order is None:
            state.order = GroupOrder(group_store(group), dist.get_rank(group), dist.get_world_size(group),
                                     state.closed)
        return state.order
