"""Agreements over the c10d store of a process group: the steps of a PeerArena's creation, its
barriers and close, and the rows-fallback decision of a workspace call.

None of them runs a collective of the group's backend (gloo, NCCL): a wait that gives up leaves no
operation in flight that a later collective could pair with. Each agreement has its own keys; a
rank that gives up records that in the store (atomically against the last arrival, so every rank
reaches the same verdict), and a rank that comes later fails at once. After a timed-out creation
step or barrier this process refuses the group for torch_sdcp's use (docs/PROTOCOL.md, "Failure
behaviour")."""

from __future__ import annotations

import json
import pickle
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

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

    def __init__(self, by_rank: int, missing: List[int], waited_s: float, mine: bool,
                 reason: Optional[str] = None) -> None:
        super().__init__(f"rank {by_rank} gave up after {waited_s:.3g} s waiting for ranks {missing}"
                         + (f": {reason}" if reason else ""))
        self.by_rank, self.missing, self.waited_s, self.mine, self.reason = by_rank, missing, waited_s, mine, reason


# ---------------------------------------------------------------------------------------------
# the group: its store, its name, the arenas created on it, and whether it is refused
# ---------------------------------------------------------------------------------------------


class _GroupState:
    __slots__ = ("arenas", "refused")

    def __init__(self) -> None:
        self.arenas = 0  # PeerArena creations on the group in this process: the same on every rank
        self.refused: Optional[str] = None


_groups: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()
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
    text = (f"the process group {group_label(group)} is out of step after a timed-out {stage} on rank "
            f"{gave_up.by_rank} (waited for ranks {gave_up.missing}); re-create the process group")
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


# ---------------------------------------------------------------------------------------------
# one agreement: every rank's key, a verdict decided once, the last reader removes the keys
# ---------------------------------------------------------------------------------------------


class StoreSync:
    """The agreements of one PeerArena over a store, each under ``<prefix>/<name>/``: rank r's
    key ``r`` (its payload), the verdict ``v`` ("done" or the record of the rank that gave up,
    set once with compare_set) and the count ``n`` of ranks that read the verdict; the rank that
    completes the count removes every key of the agreement (a rank that leaves without a close
    barrier counts itself in: ``post``). What stays in the store: the verdict of an agreement
    given up (one key)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix

    def _keys(self, name: str) -> Tuple[str, List[str], str, str]:
        base = f"{self.prefix}/{name}"
        return base, [f"{base}/{r}" for r in range(self.world_size)], f"{base}/v", f"{base}/n"

    def meet(self, name: str, timeout_s: float, payload: bytes = b"",
             give_up: Optional[Callable[[], Optional[str]]] = None) -> List[bytes]:
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
            try:
                store.compare_set(verdict_key, "", _record(me, [], 0.0, f"interrupted on rank {me} ({e!r})"))
            except Exception:  # noqa: BLE001  (the error that interrupted is the one to raise)
                pass
            raise
        if verdict != _DONE:
            try:
                store.delete_key(keys[me])  # the verdict alone tells a late rank
            except Exception:  # noqa: BLE001  (what it tells the caller is the verdict)
                pass
            raise _abandoned(verdict, me)
        got = _multi_get(store, others) if payload else [b""] * len(others)
        got.insert(me, payload)
        if store.add(count_key, 1) == self.world_size:
            for k in keys + [verdict_key, count_key]:
                store.delete_key(k)
        return got

    def _verdict(self, keys: List[str], verdict_key: str, timeout_s: float,
                 give_up: Optional[Callable[[], Optional[str]]]) -> bytes:
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
            if store.check([verdict_key]):
                verdict = store.get(verdict_key)
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

    def post(self, name: str) -> Optional[AgreementAbandoned]:
        """Count this rank as come to ``name`` without waiting (a rank that leaves without the
        barrier its peers hold): their barrier completes instead of timing out. Returns the record
        of a peer that gave the barrier up before this rank came (nothing to complete then)."""
        if self.world_size == 1:
            return None
        store, me = self.store, self.rank
        _, keys, verdict_key, count_key = self._keys(name)
        if store.check([verdict_key]):
            verdict = store.get(verdict_key)
            if verdict != _DONE:
                return _abandoned(verdict, me)
        store.set(keys[me], "")
        if store.add(count_key, 1) == self.world_size:  # every peer has passed the verdict
            for k in keys + [verdict_key, count_key]:
                store.delete_key(k)
        return None


def _record(rank: int, missing: List[int], waited: float, reason: Optional[str]) -> str:
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


def peers_exited(pids: Dict[int, int], every_s: float = 0.02) -> Callable[[], Optional[str]]:
    """A ``give_up`` for StoreSync.meet: names the peers ({rank: pid}) that exited, looking at
    most every ``every_s`` seconds; None while they all run."""
    last = [0.0]

    def give_up() -> Optional[str]:
        now = time.monotonic()
        if now - last[0] < every_s:
            return None
        last[0] = now
        gone = [f"rank {r} (pid {p})" for r, p in sorted(pids.items()) if _process_gone(p)]
        return f"{', '.join(gone)} exited" if gone else None

    return give_up


def _multi_get(store: dist.Store, keys: List[str]) -> List[bytes]:
    multi_get = getattr(store, "multi_get", None)
    return list(multi_get(keys)) if multi_get is not None else [store.get(k) for k in keys]


# ---------------------------------------------------------------------------------------------
# creation: a status from every rank after each step, the same error on every rank
# ---------------------------------------------------------------------------------------------

_EXC_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError,
              "PermissionError": PermissionError, "RuntimeError": RuntimeError}


def _describe(e: BaseException) -> Tuple[str, str]:
    """(exception class name, message) of a local failure, as gathered from every rank."""
    name = type(e).__name__
    if name in _EXC_TYPES:
        return name, str(e) or repr(e)
    return "RuntimeError", f"{name}: {e}"


def _collective_error(stage: str, failures: Dict[int, Tuple[str, str]]) -> Exception:
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
        self.peer_pids: Dict[int, int] = {}  # once known (after 'validate'): a peer's exit ends a wait at once

    def agree(self, stage: str, local_error: Optional[BaseException], extra=None) -> list:
        """Gather (status, extra) from every rank; raise the same error everywhere if any rank
        failed; return the extras."""
        status = None if local_error is None else _describe(local_error)
        try:
            got = self.sync.meet(stage, self.timeout_s, pickle.dumps((status, extra)), peers_exited(self.peer_pids))
        except AgreementAbandoned as e:
            own = f"; this rank's own status: {status[1]}" if status else ""
            err = out_of_step(self.group, f"creation step '{stage}'", e, self.sync.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena creation failed at step '{stage}': {err}{own}") from None
        except Exception as e:  # the store itself failed (its server gone): nobody can agree any more
            gave_up = AgreementAbandoned(self.sync.rank, [], 0.0, True, f"the group's store failed: {e}")
            err = out_of_step(self.group, f"creation step '{stage}'", gave_up, self.sync.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena creation failed at step '{stage}': {err}") from e
        gathered = [pickle.loads(g) for g in got]
        failures = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
        if failures:
            raise _collective_error(stage, failures)
        return [x for _, x in gathered]
