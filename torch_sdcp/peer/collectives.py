"""Agreements over the c10d store of a process group: the steps of a PeerArena's creation, its
barriers and close, and the rows-fallback decision of a workspace call.

None of them runs a collective of the group's backend (gloo, NCCL): a wait that gives up leaves no
operation in flight that a later collective could pair with. Each agreement has its own keys; a
rank that gives up records that in the store (atomically against the last arrival, so every rank
reaches the same verdict), and a rank that comes later fails at once. After a timed-out creation
step or barrier this process refuses the group for torch_sdcp's use (docs/PROTOCOL.md, "Failure
behaviour")."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

#: Polling of the store: the first pause, its growth and its cap (seconds).
POLL_START_S, POLL_GROWTH, POLL_CAP_S = 100e-6, 1.5, 5e-3
_DONE = b"done"
_ABANDONED = "abandoned:"


class GroupOutOfStepError(RuntimeError):
    """A torch_sdcp agreement over a process group timed out, on this rank or on a peer that gave
    it up before this rank came: the ranks' torch_sdcp steps on the group no longer pair, and this
    process refuses the group for torch_sdcp's use. Re-create the process group."""


class AgreementAbandoned(Exception):
    """An agreement given up: by this rank (``mine``) or by rank ``by_rank`` before this rank came;
    ``missing``: the ranks it waited for; ``reason``: why it gave up (None: the timeout)."""

    def __init__(self, by_rank: int, missing: list[int], waited_s: float, mine: bool,
                 reason: str | None = None) -> None:
        super().__init__(f"rank {by_rank} gave up after {waited_s:.3g} s waiting for ranks {missing}"
                         + (f": {reason}" if reason else ""))
        self.by_rank, self.missing, self.waited_s, self.mine, self.reason = by_rank, missing, waited_s, mine, reason


# ---------------------------------------------------------------------------------------------
# the group: its store, its name, the arenas created on it, and whether it is refused
# ---------------------------------------------------------------------------------------------


class _GroupState:
    __slots__ = ("arenas", "order", "refused")

    def __init__(self) -> None:
        self.arenas = 0  # PeerArena creations on the group in this process: the same on every rank
        self.refused: str | None = None
        self.order: GroupOrder | None = None  # of the collective-path sections, once one ran


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
    group's order will not run here."""
    order = _state(group).order
    if order is not None:
        order.forget(prefix)


def group_order(group) -> GroupOrder:
    """The order of the collective-path sections on ``group`` in this process (one per group)."""
    state = _state(group)
    with _groups_lock:
        if state.order is None:
            state.order = GroupOrder(group_store(group), dist.get_rank(group), dist.get_world_size(group))
        return state.order


# ---------------------------------------------------------------------------------------------
# the order of the collective-path sections of a group: the same sequence on every rank
# ---------------------------------------------------------------------------------------------


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

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._cond = threading.Condition()
        self._next = 1  # the section to run next
        self._busy = False
        self._closed: set = set()  # prefixes of the arenas closed in this process: their sections will not run here

    def forget(self, prefix: str) -> None:
        """The arena of ``prefix`` is closed in this process: a section of it that rank 0 named and
        this rank never ran (rank 0 took the collective path alone, and its agreement was given up,
        whose verdict went with the arena) is skipped."""
        with self._cond:
            self._closed.add(prefix)
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


# ---------------------------------------------------------------------------------------------
# one agreement: every rank's key, a verdict decided once, the last reader removes the keys
# ---------------------------------------------------------------------------------------------


class StoreSync:
    """The agreements of one PeerArena over a store, each under ``<prefix>/<name>/``: rank r's
    key ``r`` (its payload), the verdict ``v`` ("done" or the record of the rank that gave up,
    set once with compare_set) and the count ``n`` of ranks that read the verdict; the rank that
    completes the count removes every key of the agreement (a rank that leaves without a close
    barrier counts itself in: ``post``). What stays in the store: the verdict of an agreement
    given up (one key), until the closing agreement (``finish``) removes it."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.abandoned: set = set()  # names of the agreements this rank saw given up: their verdicts stay

    def _keys(self, name: str) -> tuple[str, list[str], str, str]:
        base = f"{self.prefix}/{name}"
        return base, [f"{base}/{r}" for r in range(self.world_size)], f"{base}/v", f"{base}/n"

    def meet(self, name: str, timeout_s: float, payload: bytes = b"",
             give_up: Callable[[], str | None] | None = None) -> list[bytes]:
        """Every rank's payload (rank-major) once every rank has come, or AgreementAbandoned
        (nothing left pending either way). ``give_up()``, polled while waiting, returns a reason
        to stop waiting before ``timeout_s``, or None."""
        if self.world_size == 1:
            return [payload]
        store, me = self.store, self.rank
        _, keys, verdict_key, count_key = self._keys(name)
        others = [k for r, k in enumerate(keys) if r != me]
        store.set(keys[me], payload)  # type: ignore[arg-type]  # the binding takes bytes as well
        try:
            verdict = self._verdict(keys, verdict_key, timeout_s, give_up)
        except BaseException as e:  # Ctrl-C, or the store failed: the peers need not wait it out
            self.abandoned.add(name)
            try:
                store.compare_set(verdict_key, "", _record(me, [], 0.0, f"interrupted on rank {me} ({e!r})"))
                store.delete_key(keys[me])
            except Exception:
                pass
            raise
        if verdict != _DONE:
            self.abandoned.add(name)
            with contextlib.suppress(Exception):
                store.delete_key(keys[me])  # the verdict alone tells a late rank
            raise _abandoned(verdict, me)
        got = _multi_get(store, others) if payload else [b""] * len(others)
        got.insert(me, payload)
        if store.add(count_key, 1) == self.world_size:
            for k in keys + [verdict_key, count_key]:
                store.delete_key(k)
        return got

    def give_up(self, name: str, reason: str) -> None:
        """Give ``name`` up for every rank at once (this rank was interrupted before it came to
        it): a peer waiting in it, or coming later, fails at once naming ``reason``."""
        if self.world_size == 1:
            return
        self.abandoned.add(name)
        with contextlib.suppress(Exception):
            self.store.compare_set(self._keys(name)[2], "", _record(self.rank, [], 0.0, reason))

    def _verdict(self, keys: list[str], verdict_key: str, timeout_s: float,
                 give_up: Callable[[], str | None] | None) -> bytes:
        """Poll until every peer's key is there (the verdict "done", unless a peer gave up first),
        a peer gave up, ``give_up()`` says so, or ``timeout_s`` passed (this rank gives up, unless
        the last peer came first)."""
        store, me = self.store, self.rank
        others = [k for r, k in enumerate(keys) if r != me]
        start = time.monotonic()
        pause = POLL_START_S
        while True:
            if store.check(others):
                return store.compare_set(verdict_key, "", _DONE.decode())
            verdict = peek(store, verdict_key)
            if verdict is not None:
                if verdict != _DONE:
                    return verdict
                continue  # decided while we looked: every key is there
            reason = give_up() if give_up is not None else None
            waited = time.monotonic() - start
            if reason is not None or waited >= timeout_s:
                missing = [r for r, k in enumerate(keys) if r != me and not store.check([k])]
                return store.compare_set(verdict_key, "", _record(me, missing, waited, reason))
            time.sleep(min(pause, max(timeout_s - waited, 0.0)))
            pause = min(pause * POLL_GROWTH, POLL_CAP_S)

    def post(self, name: str, payload: bytes = b"") -> AgreementAbandoned | None:
        """Count this rank as come to ``name`` without waiting (a rank that leaves without the
        barrier its peers hold): their barrier completes instead of timing out. Returns the record
        of a peer that gave the barrier up before this rank came (nothing to complete then; this
        rank's keys are taken back, so that nothing of it stays)."""
        if self.world_size == 1:
            return None
        store, me = self.store, self.rank
        _, keys, verdict_key, count_key = self._keys(name)
        verdict = peek(store, verdict_key)
        if verdict is not None and verdict != _DONE:
            self.abandoned.add(name)
            return _abandoned(verdict, me)
        store.set(keys[me], payload)  # type: ignore[arg-type]
        if store.add(count_key, 1) == self.world_size:  # every peer has passed the verdict
            self._complete(keys, verdict_key, count_key, payload)
            return None
        # A peer may have given the barrier up between the look above and the key: then nobody
        # completes the count, and this rank takes back what it wrote.
        verdict = peek(store, verdict_key)
        if verdict is not None and verdict != _DONE:
            self.abandoned.add(name)
            store.delete_key(keys[me])
            if store.add(count_key, -1) <= 0:
                store.delete_key(count_key)
            return _abandoned(verdict, me)
        return None

    def finish(self, name: str, timeout_s: float, barrier: bool, leftovers: list[str],
               give_up: Callable[[], str | None] | None = None) -> AgreementAbandoned | None:
        """The closing agreement of the prefix: with ``barrier`` a ``meet``, else a ``post``; each
        rank's payload names the keys it leaves under the prefix (``leftovers``: its notes, and the
        verdicts of the agreements it saw given up), and the rank that completes the agreement
        removes them all with the agreement's own keys, once no rank will read them. Returns what
        ``post`` returns (without ``barrier``); raises what ``meet`` raises (with it)."""
        given_up = [k for n in self.abandoned for k in self._keys(n)[1] + list(self._keys(n)[2:])]
        mine = sorted(set(leftovers) | set(given_up))  # a given-up agreement: its verdict, and any key a late rank left
        payload = json.dumps(mine).encode()
        if self.world_size == 1:
            for k in mine:
                self.store.delete_key(k)
            return None
        if not barrier:
            return self.post(name, payload)
        got = self.meet(name, timeout_s, payload, give_up)
        # Every rank has come to the closing agreement: none reads these keys any more (removing a
        # key twice is harmless, so every rank may do it)
        for k in sorted({k for g in got for k in json.loads(bytes(g).decode() or "[]")}):
            self.store.delete_key(k)
        return None

    def _complete(self, keys: list[str], verdict_key: str, count_key: str, payload: bytes) -> None:
        """This rank completed the count of a ``post``: remove the agreement's keys and the
        leftovers that every rank's payload names."""
        store = self.store
        got = _multi_get(store, [k for r, k in enumerate(keys) if r != self.rank])
        leftovers = set()
        for g in got + [payload]:
            with contextlib.suppress(ValueError):
                leftovers.update(json.loads(bytes(g).decode() or "[]"))
        for k in keys + [verdict_key, count_key] + sorted(leftovers):
            store.delete_key(k)


def _record(rank: int, missing: list[int], waited: float, reason: str | None) -> str:
    return _ABANDONED + json.dumps({"rank": rank, "missing": missing, "waited": waited, "reason": reason})


def _abandoned(verdict: bytes, me: int) -> AgreementAbandoned:
    record = json.loads(verdict.decode()[len(_ABANDONED):])
    return AgreementAbandoned(record["rank"], record["missing"], record["waited"], record["rank"] == me,
                              record["reason"])


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` (same pid namespace: creation checks it) has exited, a zombie included."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def peers_exited(pids: dict[int, int], every_s: float = 0.02,
                 lookup: Callable[[dict[int, int]], None] | None = None) -> Callable[[], str | None]:
    """A ``give_up`` for StoreSync.meet: names the peers ({rank: pid}) that exited, looking at
    most every ``every_s`` seconds; None while they all run. ``lookup(pids)``, called before each
    look, may add the pids of peers that became known meanwhile (published on the store)."""
    last = [0.0]

    def give_up() -> str | None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return None
        last[0] = now
        if lookup is not None:
            lookup(pids)
        gone = [f"rank {r} (pid {p})" for r, p in sorted(pids.items()) if _process_gone(p)]
        return f"{', '.join(gone)} exited" if gone else None

    return give_up


_MISSING = "\x00sdcp-missing"


def peek(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key``, or None when it is not there; never waits (``get`` waits for a missing
    key up to the store's own timeout, minutes, and a key that a peer removes between ``check``
    and ``get`` would make it wait). A compare_set whose expected and desired values are a value
    no key holds reads atomically and writes nothing."""
    value = bytes(store.compare_set(key, _MISSING, _MISSING))
    return None if value == _MISSING.encode() else value


def _multi_get(store: dist.Store, keys: list[str]) -> list[bytes]:
    multi_get = getattr(store, "multi_get", None)
    return list(multi_get(keys)) if multi_get is not None else [store.get(k) for k in keys]


# ---------------------------------------------------------------------------------------------
# creation: a status from every rank after each step, the same error on every rank
# ---------------------------------------------------------------------------------------------

_EXC_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError,
              "PermissionError": PermissionError, "RuntimeError": RuntimeError}


def _describe(e: BaseException) -> tuple[str, str]:
    """(exception class name, message) of a local failure, as gathered from every rank."""
    name = type(e).__name__
    if name in _EXC_TYPES:
        return name, str(e) or repr(e)
    return "RuntimeError", f"{name}: {e}"


def _collective_error(stage: str, failures: dict[int, tuple[str, str]]) -> Exception:
    """The error every rank raises when `failures` ({rank: (class name, message)}) failed
    `stage`: the class of the lowest failing rank, the messages of all of them."""
    first = min(failures)
    cls = _EXC_TYPES.get(failures[first][0], RuntimeError)
    detail = "; ".join(f"rank {r}: {failures[r][1]}" for r in sorted(failures))
    return cls(f"torch_sdcp: PeerArena creation failed at step '{stage}': {detail}")


def out_of_step(group, stage: str, gave_up: AgreementAbandoned, rank: int, timeout_s: float) -> GroupOutOfStepError:
    """Refuse ``group`` and describe the agreement ``stage`` given up (by this rank or a peer)."""
    refusal = refuse_group(group, stage, gave_up)
    if gave_up.mine:
        why = gave_up.reason or (f"waited timeout_s = {timeout_s:g} s (a rank may have died, hung for more than "
                                 "timeout_s, or not made the same torch_sdcp call)")
        detail = f"rank {rank} gave up waiting for ranks {gave_up.missing}: {why}"
    else:
        late = f" before rank {rank} came" if rank in gave_up.missing else ""
        why = f": {gave_up.reason}" if gave_up.reason else ""
        detail = (f"rank {gave_up.by_rank} gave up on it after {gave_up.waited_s:.3g} s waiting for ranks "
                  f"{gave_up.missing}{late}{why}")
    return GroupOutOfStepError(f"{detail}; {refusal}")


class _Agreement:
    """After each creation step every rank publishes its status on the store and reads every
    rank's, so that all ranks raise the same error and none hangs; a step that a rank does not
    reach within timeout_s is given up on every rank, and the group refused."""

    def __init__(self, group, sync: StoreSync, timeout_s: float) -> None:
        self.group, self.sync, self.timeout_s = group, sync, timeout_s
        self.peer_pids: dict[int, int] = {}  # a peer's exit ends a wait at once (published before any wait)

    def _pid_key(self, rank: int) -> str:
        return f"{self.sync.prefix}/pid/{rank}"

    def publish_pid(self) -> None:
        """Before any wait: this rank's pid, so that a peer killed in the first step is found by
        its exit, not by the timeout."""
        if self.sync.world_size > 1:
            self.sync.store.set(self._pid_key(self.sync.rank), str(os.getpid()))

    def unpublish_pid(self) -> None:
        """After the first step (every rank's pid is in its plan then, or creation is over)."""
        if self.sync.world_size > 1:
            with contextlib.suppress(Exception):
                self.sync.store.delete_key(self._pid_key(self.sync.rank))

    def _lookup_pids(self, pids: dict[int, int]) -> None:
        store = self.sync.store
        for r in range(self.sync.world_size):
            if r != self.sync.rank and r not in pids:
                value = peek(store, self._pid_key(r))  # removed meanwhile: that rank is past the step
                if value is not None:
                    pids[r] = int(value.decode())

    def interrupt(self, stage: str, e: BaseException) -> None:
        """Ctrl-C (or another BaseException) on this rank during ``stage``: give the step up for
        the peers, who fail at once, and refuse the group here as they do (a retry fails at once
        instead of waiting timeout_s for peers that no longer pair with it)."""
        reason = f"interrupted on rank {self.sync.rank} ({e!r})"
        self.sync.give_up(stage, reason)
        refuse_group(self.group, f"creation step '{stage}'", AgreementAbandoned(self.sync.rank, [], 0.0, True, reason))

    def agree(self, stage: str, local_error: BaseException | None, extra=None) -> list:
        """Gather (status, extra) from every rank; raise the same error everywhere if any rank
        failed; return the extras."""
        status = None if local_error is None else _describe(local_error)
        lookup = None if self.peer_pids else self._lookup_pids
        try:
            got = self.sync.meet(stage, self.timeout_s, pickle.dumps((status, extra)),
                                 peers_exited(self.peer_pids if self.peer_pids else {}, lookup=lookup))
        except AgreementAbandoned as e:
            own = f"; this rank's own status: {status[1]}" if status else ""
            err = out_of_step(self.group, f"creation step '{stage}'", e, self.sync.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena creation failed at step '{stage}': {err}{own}") from None
        except Exception as e:  # the store itself failed (its server gone): nobody can agree any more
            gave_up = AgreementAbandoned(self.sync.rank, [], 0.0, True, f"the group's store failed: {e}")
            err = out_of_step(self.group, f"creation step '{stage}'", gave_up, self.sync.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena creation failed at step '{stage}': {err}") from e
        except BaseException as e:  # Ctrl-C: meet() gave the step up for the peers; refuse the group here too
            refuse_group(self.group, f"creation step '{stage}'",
                         AgreementAbandoned(self.sync.rank, [], 0.0, True,
                                            f"interrupted on rank {self.sync.rank} ({e!r})"))
            raise
        gathered = [pickle.loads(g) for g in got]
        failures = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
        if failures:
            raise _collective_error(stage, failures)
        return [x for _, x in gathered]
