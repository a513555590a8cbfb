"""The engine faces' one core: :class:`Face`, under the adapters
(:mod:`.dcp`), the vLLM plugin (:mod:`.vllm`, :mod:`.vllm_calls`) and the
SGLang plugin (:mod:`.sglang`, :mod:`.sglang_calls`). The table of
boundaries and their builders is :mod:`._boundaries`, a face's group
:mod:`._groups`; what the two engine plugins share beyond this is in
:mod:`._engine`.

An engine face maps an engine's call shapes onto the four DCP boundaries; this
module holds what the faces share beyond the table:

- the process-local workspace cache, keyed by (face, kind, group, geometry,
  device, micro-batch) and guarded by one lock;
- bootstrap: a workspace per boundary and micro-batch, created collectively
  over the face's bootstrap group;
- the call's path (one :class:`Seam` record per call site): the face asks
  :func:`torch_sdcp.route.route` once and returns its decision, the caller
  acts on it. :meth:`Face.workspace_for` gives the workspace of a call on
  peer memory, or None: the engine's own function (no workspace, a workspace
  in collective mode, rows above its bound), each reason logged once per seam
  and counted (:func:`counters`); a face without the engine's function
  (:meth:`Face.workspace_of`) gives the workspace in every case, which then
  takes its own collective path. The caller runs the peer call under
  :meth:`Face.counted`;
- teardown: close every cached workspace of a face, idempotent, closing the
  rest before reporting the first error.

``prepare`` means one thing in every face: create the workspace collectively
(every rank of the group, same order), or return the cached one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torch_sdcp._checks import arg_error
from torch_sdcp.integrations._boundaries import BOUNDARIES, DEFAULT_MAX_ROWS, geometry_key
from torch_sdcp.integrations._cache import (
    CACHE,
    COUNTS,
    FACES,
    LOCK,
    Entry,
    check_live_workspaces,
    failure_kind,
    in_capture_or_tracing,
)
from torch_sdcp.integrations._groups import Group, engine_group
from torch_sdcp.route import Why, route

__all__ = ["Face", "Seam", "Site"]


class Site(NamedTuple):
    """Where a call's workspace lives: the face's group, the boundary's
    geometry (the fields of its :data:`BOUNDARIES` row, in order) and the
    device."""

    group: Group
    geometry: dict
    device: torch.device


@dataclass(frozen=True)
class Seam:
    """One call site of a face, built once: which boundary it calls, the name
    its logs, errors and counters use, and what its face says when the call
    takes the engine's function.

    ``missing``: what a call without a workspace does (a face with a
    fallback), e.g. "the query gather takes vLLM's own path".
    ``prepare_call``: the ``prepare_*`` call that creates the workspace, from
    the geometry (a face that creates workspaces on first use).
    ``over_bound``: ``(site, entry, rows)`` logs a call above the bound; None
    logs once per seam at INFO (an expected fallback: prefill chunks, eager
    batches above the captured ones)."""

    kind: str
    caller: str
    own_path: str = ""
    missing: str = ""
    prepare_call: Callable[[dict], str] | None = None
    over_bound: Callable[[Site, Entry, int], None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in BOUNDARIES:
            raise AssertionError(f"torch_sdcp: seam {self.caller}: unknown boundary {self.kind!r}")


class Face:
    """One engine face over the cache: how it resolves groups (``via``), what
    a call without a workspace does (``create_missing``: create it on first
    use, else take the call's fallback), where it logs, and which micro-batch
    is current. Holds what the face has logged and which geometries have no
    peer memory."""

    def __init__(self, name: str, *, via: str, create_missing: bool, make_logger: Callable[[], logging.Logger],
                 options: Callable[[], dict] = dict) -> None:
        self.name = name
        self.via = via
        self.create_missing = create_missing
        self.make_logger = make_logger
        self.options = options  # workspace options of a face-made workspace
        self.ubatch_id: Callable[[], int] = lambda: 0
        self.logger: logging.Logger | None = None
        self.logged: set = set()
        self.unavailable: set = set()  # (kind, group key, geometry, device) that failed the peer-memory gate
        self.counts: dict[str, dict[str, int]] = {}  # seam caller -> COUNTS -> calls
        FACES[name] = self

    # -- logging -------------------------------------------------------------

    def log_once(self, level: str, reason: Any, msg: str, *args: Any) -> None:
        """Log ``msg`` once per ``reason`` (per process)."""
        with LOCK:
            if reason in self.logged:
                return
            self.logged.add(reason)
        if self.logger is None:
            self.logger = self.make_logger()
        # vLLM's *_once log on the node's first rank only: right for the
        # start-up lines, which every rank shares; a warning or an error may be
        # this rank's alone, so it is logged here (already once per reason).
        # Only the engine's own logger's method (vLLM binds it on the logger):
        # a *_once a library installs on logging.Logger (transformers' cached
        # one) would drop a line this face logs again after forget().
        once = getattr(self.logger, "__dict__", {}).get(f"{level}_once") if level in ("info", "debug") else None
        if once is not None and callable(once):
            once(msg, *args)
        else:
            getattr(self.logger, level)(msg, *args)

    def count(self, caller: str, what: str) -> None:
        """Count one call of the seam ``caller`` under ``what`` (one of
        :data:`COUNTS`). Python calls only: nothing is counted while
        torch.compile traces, and a CUDA graph's replays run no Python (a
        captured call counts once, at capture)."""
        if torch.compiler.is_compiling():
            return
        with LOCK:
            seam = self.counts.get(caller)
            if seam is None:
                seam = self.counts[caller] = dict.fromkeys(COUNTS, 0)
            seam[what] += 1

    def counters(self) -> dict[str, dict[str, int]]:
        """A copy of this face's counters: seam -> :data:`COUNTS` -> calls."""
        with LOCK:
            return {caller: dict(c) for caller, c in self.counts.items()}

    def log_counters(self) -> None:
        """One INFO line of this face's counters (at teardown), when any call was counted."""
        counts = self.counters()
        if not counts:
            return
        if self.logger is None:
            self.logger = self.make_logger()
        self.logger.info("torch_sdcp: %s seams: %s", self.name, "; ".join(
            f"{caller}: " + ", ".join(f"{k} {v}" for k, v in c.items() if v) for caller, c in counts.items()))

    # -- the cache -----------------------------------------------------------

    def group(self, group: Any, arg: str = "group") -> Group:
        return engine_group(group, self.via, arg)

    def _key(self, kind: str, group: Group, geometry: tuple, device: torch.device, ubatch: int) -> tuple:
        return (self.name, kind, group.key, geometry, device, ubatch)

    def describe(self, kind: str, group: Group, geometry: tuple, device: torch.device) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in geometry + (("device", device),))
        return f"{kind} workspace for a group of world size {group.world} ({fields})"

    def lookup(self, kind: str, group: Group, geometry: dict, device: torch.device) -> Entry | None:
        """The current micro-batch's cached entry, or None. Lock-free: it runs
        on the hot path and under torch.compile tracing."""
        g = geometry_key(kind, geometry)
        ubatch = int(self.ubatch_id())
        key = self._key(kind, group, g, device, ubatch)
        entry = CACHE.get(key)
        if entry is not None and entry.was_peer and not entry.workspace.peer:
            # Closed directly (not through teardown): treat it as never prepared.
            with LOCK:
                if CACHE.get(key) is entry:
                    del CACHE[key]
            return None
        if entry is None and ubatch > 0 and self._key(kind, group, g, device, 0) in CACHE:
            raise RuntimeError(f"torch_sdcp: micro-batch {ubatch} has no {kind} workspace: the workspaces were "
                               "prepared for fewer micro-batches (num_ubatches) than the engine runs")
        return entry

    def _create(self, kind: str, group: Group, g: tuple, device: torch.device, max_rows: int, options: dict,
                caller: str) -> Entry:
        why = in_capture_or_tracing()
        if why is not None:
            raise RuntimeError(f"torch_sdcp: {caller}: cannot create the {self.describe(kind, group, g, device)} "
                               f"during {why} (creation is collective): prepare it at model load, before capture "
                               "and compilation")
        return self._build(kind, group, g, device, max_rows, options)

    def _build(self, kind: str, group: Group, g: tuple, device: torch.device, max_rows: int, options: dict) -> Entry:
        backend = "host" if device.type == "cpu" else "cuda"
        workspace = BOUNDARIES[kind].build(group.pg, max_rows, dict(g), backend=backend, device=device, **options)
        if workspace.peer:
            if self.logger is None:
                self.logger = self.make_logger()
            self.logger.info("torch_sdcp: %s: %s: %d bytes per rank (%d physical), %d rows", self.name,
                             self.describe(kind, group, g, device), getattr(workspace, "nbytes_per_rank", 0),
                             getattr(workspace, "physical_bytes", 0), max_rows)
        return Entry(workspace, max_rows, workspace.peer)

    def prepare(self, kind: str, group: Group, geometry: dict, device: torch.device, max_rows: int,
                options: dict, caller: str) -> Any:
        """Create (collectively) the workspace of ``kind`` for ``geometry``, or
        return the cached one (a different ``max_rows`` is an error). A group
        without peer memory gets a workspace in collective mode, cached too."""
        g = geometry_key(kind, geometry)
        entry = self.lookup(kind, group, geometry, device)
        if entry is not None:
            if entry.bound != max_rows:
                raise arg_error("max_rows", f"{entry.bound} (the bound of the prepared "
                                f"{self.describe(kind, group, g, device)})", max_rows)
            return entry.workspace
        entry = self._create(kind, group, g, device, max_rows, options, caller)
        with LOCK:
            CACHE[self._key(kind, group, g, device, 0)] = entry
        return entry.workspace

    def try_prepare(self, kind: str, group: Group, geometry: dict, device: torch.device, max_rows: int,
                    num_ubatches: int, own_path: str) -> bool:
        """Prepare one peer workspace per micro-batch (cached ones are kept,
        with their bound). False when the group cannot use peer memory: then
        nothing is cached and ``own_path`` keeps the boundary (logged once)."""
        if not isinstance(num_ubatches, int) or num_ubatches < 1:
            raise ValueError(f"torch_sdcp: argument 'num_ubatches': expected a positive int, got {num_ubatches!r}")
        g = geometry_key(kind, geometry)
        options = self.options()
        with LOCK:
            if (kind, group.key, g, device) in self.unavailable:
                return False
            for ub in range(num_ubatches):
                key = self._key(kind, group, g, device, ub)
                entry = CACHE.get(key)
                if entry is not None:
                    if entry.max_rows != max_rows:
                        self.log_once("warning", ("bound", key, max_rows), "torch_sdcp: the %s workspace of "
                                      "micro-batch %d keeps its rows bound %d (asked for %d): it may already be "
                                      "captured", kind, ub, entry.max_rows, max_rows)
                    continue
                entry = self._build(kind, group, g, device, max_rows, options)
                if not entry.workspace.peer:
                    # The gate is collective: every rank got here and agrees.
                    entry.workspace.close()
                    self.unavailable.add((kind, group.key, g, device))
                    self.log_once("warning", ("unavailable", kind), "torch_sdcp: peer memory is unavailable for "
                                  "the DCP group (rank %d of %d, %s); the %s boundary keeps %s path", group.rank,
                                  group.world, device, kind, own_path)
                    return False
                CACHE[key] = entry
        return True

    # -- calls ---------------------------------------------------------------

    def workspace_for(self, seam: Seam, site: Site, rows: int) -> Any | None:
        """The workspace a call of ``rows`` rows at ``seam`` runs on, on peer
        memory, as :func:`torch_sdcp.route.route` decides; or None: the call
        takes the engine's own function, already logged and counted.

        No workspace: a face with ``create_missing`` creates it (bound
        :data:`DEFAULT_MAX_ROWS`), or raises naming ``seam.prepare_call``
        during capture or tracing; any other face logs ``seam.missing`` once
        per geometry. A workspace in collective mode, or ``rows`` above its
        bound: None (counted under ``seam.caller``, by reason). The caller
        runs the peer call under :meth:`counted`."""
        entry = self._entry(seam, site)
        decision = route(entry, rows)
        if decision.peer and entry is not None:
            return entry.workspace
        why = decision.why
        assert why is not None
        self.count(seam.caller, f"fallback:{why.value}")
        self._log_own_path(seam, site, rows, entry, why)
        return None

    def workspace_of(self, seam: Seam, site: Site, rows: int) -> tuple[Any, bool]:
        """(the workspace of a call of ``rows`` rows at ``seam``, whether the
        call runs on peer memory), for a face that creates workspaces on
        first use and has no engine function to fall back to: a call not on
        peer memory (counted by reason) runs the workspace's own collective
        path, the same decision made inside the workspace. The caller runs
        the call under ``counted(seam, on_peer)``."""
        entry = self._entry(seam, site)
        if entry is None:
            raise AssertionError(f"torch_sdcp: {seam.caller}: no workspace and no fallback")
        decision = route(entry, rows)
        if not decision.peer:
            assert decision.why is not None
            self.count(seam.caller, f"fallback:{decision.why.value}")
        return entry.workspace, decision.peer

    def counted(self, seam: Seam, on_peer: bool = True) -> contextlib.AbstractContextManager:
        """The peer call of ``seam`` runs inside: counted under ``peer`` when
        it returns, under ``void``, ``timeout`` or ``error`` when it raises a
        RuntimeError (which goes on). ``on_peer`` False: nothing is counted
        (the call was counted by its reason)."""
        return _Counted(self, seam.caller) if on_peer else contextlib.nullcontext()

    def _entry(self, seam: Seam, site: Site) -> Entry | None:
        entry = self.lookup(seam.kind, *site)
        if entry is None and self.create_missing:
            entry = self._create_on_first_use(seam, site)
        return entry

    def _log_own_path(self, seam: Seam, site: Site, rows: int, entry: Entry | None, why: Why) -> None:
        """Log, once per reason, why a call takes the engine's own function."""
        kind, geometry = seam.kind, site.geometry
        if why is Why.NO_WORKSPACE:
            boundary = BOUNDARIES[kind]
            self.log_once("warning", ("no-workspace", kind) + tuple(geometry.values()), "torch_sdcp: no %s "
                          "workspace for %s (not prepared, or peer memory unavailable); %s", boundary.label,
                          boundary.summary(geometry), seam.missing)
        elif why is Why.ROWS_OVER_BOUND and entry is not None:
            if seam.over_bound is not None:
                seam.over_bound(site, entry, rows)
            else:
                self.log_once("info", ("rows", seam.caller), "torch_sdcp: %d rows exceed the %s bound of %d; "
                              "such calls take %s %s (counted in torch_sdcp.integrations.counters())", rows,
                              BOUNDARIES[kind].label, entry.max_rows, seam.own_path, seam.caller)

    def _create_on_first_use(self, seam: Seam, site: Site) -> Entry:
        kind, caller, (group, geometry, device) = seam.kind, seam.caller, site
        prepare_call = seam.prepare_call(geometry) if seam.prepare_call is not None else "prepare_*(...)"
        g = geometry_key(kind, geometry)
        why = in_capture_or_tracing()
        if why is not None:
            raise RuntimeError(
                f"torch_sdcp: {caller}: no {self.describe(kind, group, g, device)} was prepared, and "
                f"workspaces cannot be created during {why} (creation is collective): call "
                f"torch_sdcp.integrations.{prepare_call} on every rank at model load, before capture and "
                "compilation")
        entry = self._create(kind, group, g, device, DEFAULT_MAX_ROWS, {}, caller)
        with LOCK:
            CACHE[self._key(kind, group, g, device, 0)] = entry
        return entry

    # -- the face's workspaces -----------------------------------------------

    def _entries(self) -> list[tuple[tuple, Entry]]:
        with LOCK:
            return [(key, entry) for key, entry in CACHE.items() if key[0] == self.name]

    def workspaces(self) -> list[Any]:
        """The workspaces this face holds, in creation order."""
        return [entry.workspace for _, entry in self._entries()]

    def check(self) -> None:
        """:func:`check_live_workspaces` over this face's workspaces."""
        check_live_workspaces(self.name)

    def forget(self) -> None:
        """Drop this face's entries without closing them, its log-once reasons
        and its record of groups without peer memory: a fresh process, as far
        as this face knows."""
        with LOCK:
            for key, _ in self._entries():
                del CACHE[key]
            self.unavailable.clear()
            self.logged.clear()
            self.counts.clear()
            self.logger = None

    def _drain(self) -> list[tuple[tuple, Entry]]:
        """Take this face's entries out of the cache (their counters logged)."""
        with LOCK:
            entries = self._entries()
            for key, _ in entries:
                del CACHE[key]
            self.unavailable.clear()
        if entries:
            self.log_counters()
        return entries

    def teardown(self) -> None:
        """Close every workspace of this face, in creation order, and forget
        them. Collective like ``close()``; idempotent. A failing close does not
        stop the others: the first error is raised after all were tried."""
        entries = self._drain()
        errors = []
        for _, entry in entries:
            try:
                entry.workspace.close()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def release_local(self, reason: str) -> None:
        """Release every workspace of this face on this rank only, waiting
        for no peer (an engine's local abort, where a peer may be alive but
        not shutting down): each is aborted (a peer's call in it raises at
        once instead of waiting out the timeout) and closed without a
        barrier (unmapped, handles closed). Idempotent; never raises."""
        entries = self._drain()
        for _, entry in entries:
            try:
                if entry.workspace.peer:
                    entry.workspace.abort(reason)  # poisoned: close() releases locally, no barrier
                entry.workspace.close()
            except Exception as e:
                self.log_once("warning", ("release", type(e).__name__), "torch_sdcp: releasing a %s workspace "
                              "locally failed (%s: %s)", self.name, type(e).__name__, e)


class _Counted:
    """One peer call of a seam, counted when it ends (:meth:`Face.counted`)."""

    __slots__ = ("caller", "face")

    def __init__(self, face: Face, caller: str) -> None:
        self.face, self.caller = face, caller

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.face.count(self.caller, "peer")
        elif isinstance(exc, RuntimeError):
            self.face.count(self.caller, failure_kind(exc))
