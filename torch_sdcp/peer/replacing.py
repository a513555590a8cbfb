"""A resize on some ranks against a close on others of the same arena
(docs/PROTOCOL.md "Failure behaviour"): the resizing ranks wait in the first
step of the new arena's creation, the closing ranks in the old arena's close
barrier, and neither would come to the other's agreement. The resizing rank
says which arena its creation replaces (a key beside its pid, for the first
step only); a closing rank that finds such a creation while its close barrier
waits takes its part in that step with an error posted (post_creation_error),
so the creation fails at once on every rank and the group stays in step; the
resizing rank, seeing that a peer came to the old arena's close barrier,
closes the old arena too (docs: ``PeerWorkspace.resize``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.distributed as dist

from .agreements import post_creation_error
from .groups import arena_count
from .store_sync import StoreSync, peek

#: What the error a closing rank posts says (and what a resize that failed on it looks for).
CLOSED_AGAINST_RESIZE = "(close() against resize())"


def _replacing_key(number: int, rank: int) -> str:
    return f"sdcp/arena{number}/replacing/{rank}"


def publish_replacing(sync: StoreSync, number: int, old_prefix: str | None) -> None:
    """Before the first step of creation ``number``: the arena it replaces (a resize), if any."""
    if old_prefix is not None and sync.world_size > 1:
        sync.store.set(_replacing_key(number, sync.rank), old_prefix)


def unpublish_replacing(sync: StoreSync, number: int, old_prefix: str | None) -> None:
    """After the first step (every rank came to it, or it failed)."""
    if old_prefix is not None and sync.world_size > 1:
        with contextlib.suppress(Exception):
            sync.store.delete_key(_replacing_key(number, sync.rank))


def ranks_at(sync: StoreSync, name: str) -> list[int]:
    """The peers whose key of the agreement ``name`` is on the store (they came to it)."""
    return [r for r in range(sync.world_size) if r != sync.rank and peek(sync.store, f"{sync.prefix}/{name}/{r}")
            is not None]


class ReplacingPeers:
    """A watch for the close barrier of the arena of ``sync`` (polled while it waits, after the
    caller's ``watch``): a peer that has not come to the barrier but waits in the first step of
    the group's next creation, which replaces this arena (a resize against this close), is told
    once, with an error posted in that step. The barrier goes on waiting for the resizing peers,
    which close the old arena once their resize failed."""

    def __init__(self, group: dist.ProcessGroup | None, sync: StoreSync, timeout_s: float,
                 watch: Callable[[], None] | None = None) -> None:
        self.group, self.sync, self.timeout_s, self.watch = group, sync, timeout_s, watch
        self.told = False

    def __call__(self) -> None:
        if self.watch is not None:
            self.watch()
        if self.told:
            return
        number = arena_count(self.group) + 1  # the next creation of the group, on every rank
        came = set(ranks_at(self.sync, "close"))
        resizing = [r for r in range(self.sync.world_size) if r != self.sync.rank and r not in came
                    and peek(self.sync.store, _replacing_key(number, r)) == self.sync.prefix.encode()]
        if not resizing:
            return
        self.told = True
        who = ", ".join(map(str, resizing))
        post_creation_error(self.group, RuntimeError(
            f"rank {self.sync.rank} closed the workspace that rank(s) {who} resized {CLOSED_AGAINST_RESIZE}: "
            "every rank must make the same calls in the same order"), self.timeout_s)
