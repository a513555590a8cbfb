"""One agreement over the c10d store of a process group (``StoreSync``): every rank's key, a
verdict decided once, the last reader removes the keys. The agreements of a PeerArena's
creation, its barriers and close, and of a workspace's rows-fallback decision are built on it
(``agreements``, ``groups``, ``group_order``).

None of them runs a collective of the group's backend (gloo, NCCL): a wait that gives up leaves no
operation in flight that a later collective could pair with. Each agreement has its own keys; a
rank that gives up records that in the store (atomically against the last arrival, so every rank
reaches the same verdict), and a rank that comes later fails at once (docs/PROTOCOL.md, "Failure
behaviour")."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

import torch.distributed as dist

#: Polling of the store: the first pause, its growth and its cap (seconds).
POLL_START_S, POLL_GROWTH, POLL_CAP_S = 100e-6, 1.5, 5e-3
_DONE = b"done"
_ABANDONED = "abandoned:"


class AgreementAbandoned(Exception):
    """An agreement given up: by this rank (``mine``) or by rank ``by_rank`` before this rank came;
    ``missing``: the ranks it waited for; ``reason``: why it gave up (None: the timeout)."""

    def __init__(self, by_rank: int, missing: list[int], waited_s: float, mine: bool,
                 reason: str | None = None) -> None:
        super().__init__(f"rank {by_rank} gave up after {waited_s:.3g} s waiting for ranks {missing}"
                         + (f": {reason}" if reason else ""))
        self.by_rank, self.missing, self.waited_s, self.mine, self.reason = by_rank, missing, waited_s, mine, reason


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
