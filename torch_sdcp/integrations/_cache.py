"""The process-local workspace cache of the engine faces: one :class:`Entry`
per workspace, keyed by (face, kind, group key, geometry, device,
micro-batch) in creation order, guarded by one lock; the faces by name, and
what reads them all: :func:`counters` and :func:`check_live_workspaces`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torch_sdcp.route import Why

__all__ = ["CACHE", "COUNTS", "FACES", "LOCK", "STEP_CHECK", "Entry", "check_live_workspaces", "counters",
           "failure_kind", "in_capture_or_tracing"]


@dataclass(eq=False)
class Entry:
    workspace: Any
    max_rows: int  # the rows bound it was made for (the workspace's own bound where it has one)
    was_peer: bool
    logged: set = field(default_factory=set)  # rows above the bound already logged, where a face logs per entry

    @property
    def bound(self) -> int:
        return getattr(self.workspace, "max_rows", self.max_rows)

    @property
    def peer(self) -> bool:  # what route() reads, with max_rows (an ExchangeWorkspace has no row bound)
        return bool(self.workspace.peer)




# (face, kind, group key, geometry, device, micro-batch) -> Entry, in creation order. The face is part of
# the key so that each face lists and tears down only what it created.
CACHE: dict[tuple, Entry] = {}
LOCK = threading.RLock()


#: What a seam's counters count: calls on peer memory, calls that took the
#: engine's function (by :class:`torch_sdcp.route.Why`), and peer calls that
#: raised: voided by a peer, timed out, any other error.
COUNTS = ("peer", *(f"fallback:{why.value}" for why in Why), "void", "timeout", "error")


#: The counters' name for failures the per-step check found (a kernel's
#: timeout inside a replayed CUDA graph reaches the host there, not at a call).
STEP_CHECK = "(step check)"


def failure_kind(error: BaseException) -> str:
    from torch_sdcp.workspaces import VoidedCallError

    if isinstance(error, VoidedCallError):
        return "void"
    return "timeout" if "timed out" in str(error) else "error"


def in_capture_or_tracing() -> str | None:
    """What forbids a collective workspace creation right now, or None."""
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"
    return None



class Counting(Protocol):
    """What the cache reads of a face: its counters, and a count."""

    def count(self, caller: str, what: str) -> None: ...

    def counters(self) -> dict[str, dict[str, int]]: ...


FACES: dict[str, Counting] = {}  # name -> face, for counters()


def counters() -> dict[str, dict[str, dict[str, int]]]:
    """Every face's counters in this process: face name -> seam -> count
    (:data:`COUNTS`: ``peer`` calls, ``fallback:<why>`` calls by
    :class:`torch_sdcp.route.Why`, ``void``, ``timeout`` and ``error`` peer
    calls). Cumulative from process start (or the face's ``forget()``)."""
    return {name: face.counters() for name, face in FACES.items()}


def check_live_workspaces(face: str | None = None) -> None:
    """Raise if a live peer workspace (of ``face``, or of every face) recorded
    a failure on this rank: a timed-out or mismatched call, a peer's abort, or
    a call that a peer voided (its result is not valid: VoidedCallError).
    Reads host memory only (``check()`` never synchronises), so an engine
    calls it once per step, after the step's own synchronisation, to stop a
    step whose kernels ran after a failure ("undefined output") from
    returning its result. Every workspace is checked; the error names how many
    failed and the first failure."""
    with LOCK:
        live = [(key[0], entry.workspace) for key, entry in CACHE.items() if face is None or key[0] == face]
    failures = []
    for name, workspace in live:
        if not workspace.peer:  # collective mode, or closed directly: nothing of ours runs on it
            continue
        try:
            workspace.check()
        except RuntimeError as e:
            failures.append(e)
            if name in FACES:  # on CUDA a timeout inside a replayed graph surfaces here, not at a call
                FACES[name].count(STEP_CHECK, failure_kind(e))
    if failures:
        raise RuntimeError(f"torch_sdcp: {len(failures)} of {len(live)} live workspace(s) recorded a failure; "
                           f"the step's output is not returned: {failures[0]}") from failures[0]
