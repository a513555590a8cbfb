"""The order of the collective-path sections of a group (``GroupOrder``): the same sequence on
every rank, so that two workspaces of one group used from two threads enter their collectives in
one order (docs/PROTOCOL.md, "Failure behaviour")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .store_sync import _DONE, POLL_CAP_S, POLL_GROWTH, POLL_START_S, AgreementAbandoned, peek


class Turn:
    """One collective-path section of a group, held by the thread that entered it until
    ``release()`` (idempotent; a Turn that holds nothing: the section's agreement was already
    given up, which the agreement itself reports)."""

    def __init__(self, order: GroupOrder | None, seq: int) -> None:
        self._order, self.seq = order, seq

    def release(self) -> None:
        order, self._order = self._order, None
        if order is not None:
            order._release(self.seq)


class GroupOrder:
    """The collective-path sections (a store agreement and the collectives that follow it) of the
    workspaces of one group in this process, in one sequence alike on every rank: two workspaces
    of a group used from two threads would otherwise enter their collectives in an order that
    differs by rank, and the group's backend would pair one workspace's collectives with the
    other's. Rank 0 of the group runs its sections in the order its threads come (one at a time)
    and names each on the group's store (``sdcp/order/<n>``: the agreement's name); every other
    rank runs section n when its thread for that name comes, one at a time as well. A section
    whose agreement was given up is skipped. Every wait is bounded by the caller's timeout."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, closed: set[str] | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._cond = threading.Condition()
        self._next = 1  # the section to run next
        self._busy = False
        # Prefixes of the arenas closed in this process (the group's record, shared): their sections
        # will not run here.
        self._closed = closed if closed is not None else set()

    def forget(self, prefix: str) -> None:
        """The arena of ``prefix`` is closed in this process: a section of it that rank 0 named and
        this rank never ran (rank 0 took the collective path alone, and its agreement was given up,
        whose verdict went with the arena) is skipped; those already named are read now (and their
        keys removed by the last reader), not at this rank's next collective-path call."""
        with self._cond:
            self._closed.add(prefix)
            while self.rank != 0 and self.world_size > 1 and not self._busy:
                value = peek(self.store, f"sdcp/order/{self._next}")
                if value is None or value.decode().rsplit("/", 1)[0] not in self._closed:
                    break
                self._read(self._next)
                self._next += 1
            self._cond.notify_all()

    def enter(self, name: str, timeout_s: float, give_up: Callable[[], str | None] | None = None) -> Turn:
        """Wait for the turn of the section ``name`` (the full name of its store agreement, alike on
        every rank) and hold it; AgreementAbandoned (``mine``, with its reason) when the turn does not
        come within ``timeout_s`` or ``give_up()`` returns a reason."""
        if self.world_size == 1:
            return Turn(None, 0)
        start = time.monotonic()
        pause = POLL_START_S
        with self._cond:
            while True:
                if not self._busy:
                    seq = self._next
                    if self.rank == 0:
                        self._busy = True
                        self.store.set(f"sdcp/order/{seq}", name)
                        return Turn(self, seq)
                    value = peek(self.store, f"sdcp/order/{seq}")
                    if value is not None:
                        named = value.decode()
                        if named == name:
                            self._busy = True
                            self._read(seq)
                            return Turn(self, seq)
                        if named.rsplit("/", 1)[0] in self._closed or self._given_up(named):  # over everywhere
                            self._read(seq)
                            self._next += 1
                            continue
                if self._given_up(name):  # this section is over: its agreement says so at once
                    return Turn(None, 0)
                reason = give_up() if give_up is not None else None
                waited = time.monotonic() - start
                if reason is not None or waited >= timeout_s:
                    what = (reason if reason is not None else
                            f"its turn in the group's order of collective-path calls did not come within "
                            f"timeout_s = {timeout_s:g} s (section {self._next} of this process: "
                            f"{self._running()})")
                    raise AgreementAbandoned(self.rank, [0] if self.rank else [], waited, True, what)
                self._cond.wait(min(pause, max(timeout_s - waited, 0.0)))
                pause = min(pause * POLL_GROWTH, POLL_CAP_S)

    def _running(self) -> str:
        value = peek(self.store, f"sdcp/order/{self._next}")
        return "rank 0 has not named it yet" if value is None else f"rank 0 runs {value.decode()!r}"

    def _given_up(self, name: str) -> bool:
        verdict = peek(self.store, f"{name}/v")
        return verdict is not None and verdict != _DONE

    def _read(self, seq: int) -> None:
        """A rank other than 0 has read section ``seq``'s name: the last of them removes it."""
        key = f"sdcp/order/{seq}"
        if self.store.add(f"{key}/n", 1) == self.world_size - 1:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/n")

    def _release(self, seq: int) -> None:
        with self._cond:
            if self._busy and self._next == seq:
                self._busy = False
                self._next += 1
                self._cond.notify_all()
