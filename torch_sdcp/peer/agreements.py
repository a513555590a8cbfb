"""The agreements of a PeerArena's creation: after each step every rank publishes its status on
the group's store and reads every rank's, so that all ranks raise the same error and none hangs;
a peer's exit ends a wait at once; a rank whose creation fails its local checks posts its error in
the first step (``creation_errors_posted``), so the peers raise it at once and the group stays in
step. A step that a rank does not reach within timeout_s is given up on every rank, and the group
refused (docs/PROTOCOL.md, "Failure behaviour")."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .groups import (
    GroupOutOfStepError,
    arena_count,
    group_store,
    is_refused,
    known_pids,
    next_arena_number,
    refuse_group,
)
from .store_sync import AgreementAbandoned, StoreSync, peek
from .timeout import DEFAULT_TIMEOUT_S, default_timeout_s, validate_timeout

logger = logging.getLogger("torch_sdcp")


def _hook(stage: str) -> None:
    # Fault injection for the tests: torch_sdcp.peer._TEST_HOOK, set on the package.
    hook = getattr(sys.modules[__package__], "_TEST_HOOK", None)
    if hook is not None:
        hook(stage)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` (same pid namespace: creation checks it) has exited, a zombie included."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def peers_exited(pids: dict[int, int], every_s: float = 0.02, lookup: Callable[[dict[int, int]], None] | None = None,
                 watch: Callable[[], None] | None = None) -> Callable[[], str | None]:
    """A ``give_up`` for StoreSync.meet: names the peers ({rank: pid}) that exited, looking at
    most every ``every_s`` seconds; None while they all run. ``lookup(pids)``, called before each
    look, may add the pids of peers that became known meanwhile (published on the store);
    ``watch()`` is called before each look too."""
    last = [0.0]

    def give_up() -> str | None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return None
        last[0] = now
        if watch is not None:
            with contextlib.suppress(Exception):  # best effort: the wait goes on as before
                watch()
        if lookup is not None:
            lookup(pids)
        gone = [f"rank {r} (pid {p})" for r, p in sorted(pids.items()) if _process_gone(p)]
        return f"{', '.join(gone)} exited" if gone else None

    return give_up


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

    def __init__(self, group, sync: StoreSync, timeout_s: float, watch: Callable[[], None] | None = None) -> None:
        self.group, self.sync, self.timeout_s, self.watch = group, sync, timeout_s, watch
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
        # Before the first step's plans: the pids of the group's last creation, and the ones published meanwhile.
        pids = self.peer_pids or known_pids(self.group)
        lookup = None if self.peer_pids else self._lookup_pids
        try:
            got = self.sync.meet(stage, self.timeout_s, pickle.dumps((status, extra)),
                                 peers_exited(pids, lookup=lookup, watch=self.watch))
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


def post_creation_error(group: dist.ProcessGroup | None, error: BaseException, timeout_s: float) -> None:
    """This rank's creation of a PeerArena on ``group`` failed its local checks (``error``) before
    the arena was created: take this rank's part in the creation's first step ('validate') with
    ``error`` posted, so that every peer raises it at once (PeerArena creation failed at step
    'validate': rank r: ...) instead of waiting ``timeout_s``, and the group stays in step. Returns
    when the step is over (or was given up: the group is then refused, as any timed-out step
    does); the caller raises ``error`` itself. Nothing happens for a group this process cannot
    agree on (none initialised, not a member, refused)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup) or dist.get_rank(group) < 0 or is_refused(group):
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        next_arena_number(group)
        return
    number = next_arena_number(group)
    steps = _Agreement(group, StoreSync(group_store(group), rank, world, f"sdcp/arena{number}"), timeout_s)
    steps.publish_pid()
    try:
        steps.agree("validate", error if isinstance(error, Exception) else RuntimeError(repr(error)), None)
    except Exception as e:
        if isinstance(e, GroupOutOfStepError):
            logger.warning("torch_sdcp: rank %d: the peers did not come to creation step 'validate' to learn "
                           "this rank's error (%s): %s", rank, error, e)
    finally:
        steps.unpublish_pid()


def _timeout_of(kwargs: dict[str, Any]) -> float:
    """The bound of the posted step: the caller's ``timeout_s``, else SDCP_TIMEOUT_S, else the
    default (a bad value is the error being posted: the default bounds it)."""
    try:
        return validate_timeout(kwargs["timeout_s"])
    except (KeyError, ValueError):
        pass
    try:
        return default_timeout_s()
    except ValueError:
        return DEFAULT_TIMEOUT_S


def creation_errors_posted(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap the ``__init__(self, group, ...)`` of a class that creates one PeerArena on ``group``
    (collectively, on every rank): an exception raised before the arena's creation began (a
    local argument check) is posted to the peers in the creation's first step
    (post_creation_error), then raised. Errors of the creation itself are collective already."""

    def wrapped(self, *args: Any, **kwargs: Any) -> None:
        group = args[0] if args else kwargs.get("group")
        valid = group is None or isinstance(group, dist.ProcessGroup)
        begun = arena_count(group if group is not None else dist.group.WORLD) \
            if valid and dist.is_available() and dist.is_initialized() else None
        try:
            init(self, *args, **kwargs)
        except Exception as e:
            if begun is not None and arena_count(group if group is not None else dist.group.WORLD) == begun:
                post_creation_error(group, e, _timeout_of(kwargs))
            raise

    wrapped.__wrapped__ = init  # type: ignore[attr-defined]
    wrapped.__name__, wrapped.__qualname__, wrapped.__doc__ = init.__name__, init.__qualname__, init.__doc__
    return wrapped
