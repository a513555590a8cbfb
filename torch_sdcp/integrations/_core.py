"""The one integration core under the engine faces: the adapters
(:mod:`.dcp`), the vLLM plugin (:mod:`.vllm`, :mod:`.vllm_calls`) and the
SGLang plugin (:mod:`.sglang`); what the two engine plugins share beyond this
is in :mod:`._engine`.

An engine face maps an engine's call shapes onto the four DCP boundaries; this
module holds everything the faces share:

- :data:`BOUNDARIES`: the table of boundaries (kind -> the geometry that keys
  its workspace, how to build that workspace, how to summarise it in a log);
- the process-local workspace cache, keyed by (face, kind, group, geometry,
  device, micro-batch) and guarded by one lock;
- bootstrap: a workspace per boundary and micro-batch, created collectively
  over the face's bootstrap group (:func:`engine_group`);
- the call (:meth:`Face.call`, one :class:`Seam` record per call site): the
  path is :func:`torch_sdcp.route.route`'s decision, the face acts on it: a
  call without a workspace either creates it / raises naming the
  ``prepare_*`` call (a face without fallback) or takes the engine's
  function; a workspace in collective mode or rows above its bound take the
  engine's function; each reason is logged once per seam and counted
  (:func:`counters`);
- teardown: close every cached workspace of a face, idempotent, closing the
  rest before reporting the first error.

``prepare`` means one thing in every face: create the workspace collectively
(every rank of the group, same order), or return the cached one.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torch_sdcp._checks import arg_error
from torch_sdcp.families import FAMILIES
from torch_sdcp.route import Why, route

__all__ = ["BOUNDARIES", "DEFAULT_MAX_ROWS", "OUTPUT_DTYPES", "Boundary", "Entry", "Face", "Group", "Seam", "Site",
           "check_live_workspaces", "counters", "engine_group", "normalise_device", "query_direct"]

#: Rows bound of a workspace a face creates on first use (the reference decode bound).
DEFAULT_MAX_ROWS = 128

#: Dtypes of the partial outputs the Output/LSE boundary combines.
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# ---------------------------------------------------------------------------
# The boundaries
# ---------------------------------------------------------------------------


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def query_direct(width: int, dtype: torch.dtype) -> bool:
    """Whether a gather-only query (``rope_dim=0``) runs on a QueryWorkspace
    (data-as-flag, final layout, 1x bytes): a dtype whose all-ones element is
    NaN and heads of whole 16-byte vectors. Anything else (float8_e4m3fnuz,
    raw bytes, odd widths) takes a tagged ExchangeWorkspace, which moves any
    bytes."""
    from torch_sdcp import ops

    return dtype in ops.QUERY_GATHER_DTYPES and width * _element_size(dtype) % 16 == 0


def _exchange(pg, max_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.ExchangeWorkspace(pg, max_rows * math.prod(row_shape) * _element_size(dtype), **options)


def _build_all_gather(pg, max_rows: int, g: dict, **options) -> Any:
    return _exchange(pg, max_rows, g["row_shape"], g["dtype"], **options)


def _build_query(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    if g["rope_dim"] == 0 and not query_direct(g["nope_dim"], g["out_dtype"]):
        return _exchange(pg, max_rows, (g["local_heads"], g["nope_dim"]), g["out_dtype"], **options)
    return torch_sdcp.QueryWorkspace(pg, max_rows, g["local_heads"], nope_dim=g["nope_dim"], rope_dim=g["rope_dim"],
                                     dtype=g["out_dtype"], rope_style=g["rope_style"], **options)


def _build_output_lse(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.OutputLSEWorkspace(pg, max_rows, g["total_heads"], g["head_dim"], dtype=g["dtype"], **options)


def _build_topk(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.TopKWorkspace(pg, max_rows, g["k"], candidates_per_rank=g["candidates_per_rank"], **options)


class Boundary(NamedTuple):
    """One row of :data:`BOUNDARIES`."""

    label: str  # how logs name it
    geometry: tuple[str, ...]  # the fields that key its workspace, in key order
    build: Callable[..., Any]  # (bootstrap group, max_rows, geometry dict, **workspace options) -> workspace
    summary: Callable[[dict], str]  # the geometry in a log line


# The faces' part of each family's boundary, keyed by the family record's ``integration``.
_FACE_ROWS: dict[str, Boundary] = {
    "all_gather": Boundary("exchange", ("row_shape", "dtype"), _build_all_gather,
                           lambda g: f"rows {list(g['row_shape'])} of {g['dtype']}"),
    # rope_dim=0: a gather-only query (a query produced by the engine).
    "query": Boundary("query", ("local_heads", "nope_dim", "rope_dim", "out_dtype", "rope_style"), _build_query,
                      lambda g: f"{g['local_heads']} heads x {g['nope_dim'] + g['rope_dim']} of {g['out_dtype']}"),
    "output_lse": Boundary("Output/LSE", ("total_heads", "head_dim", "dtype"), _build_output_lse,
                           lambda g: f"{g['total_heads']} heads x {g['head_dim']} of {g['dtype']}"),
    "topk": Boundary("top-K", ("k", "candidates_per_rank"), _build_topk,
                     lambda g: f"k={g['k']} over {g['candidates_per_rank']} local candidates"),
}

#: The boundaries the faces build, one per family record with an ``integration`` (torch_sdcp.families),
#: in family order: a family is a record plus its files, and its row here.
BOUNDARIES: dict[str, Boundary] = {f.integration: _FACE_ROWS[f.integration] for f in FAMILIES if f.integration}
if set(_FACE_ROWS) != set(BOUNDARIES):  # a row that no family names
    raise ImportError(f"torch_sdcp.integrations: boundary rows {sorted(set(_FACE_ROWS) - set(BOUNDARIES))} have "
                      "no family record (torch_sdcp.families)")


def _geometry(kind: str, geometry: dict) -> tuple:
    fields = BOUNDARIES[kind].geometry
    if tuple(geometry) != fields:
        raise AssertionError(f"torch_sdcp: the {kind} geometry is {fields}, got {tuple(geometry)}")
    return tuple(geometry.items())


# ---------------------------------------------------------------------------
# Groups and devices
# ---------------------------------------------------------------------------


class Group(NamedTuple):
    """A face's group, resolved: the cache key, the process group workspaces
    bootstrap over, the world size and (a callable for) this rank."""

    key: Any
    pg: Any
    world: int
    rank_of: Callable[[], int]

    @property
    def rank(self) -> int:
        return self.rank_of()


def engine_group(group: Any, via: str, arg: str) -> Group:
    """``group`` as a face bootstraps over it (its cache key, bootstrap
    process group, world and rank). ``via="device_group"``: a
    ProcessGroup, None (the default group) or an object with a
    ``device_group`` ProcessGroup; keyed by ``group_name``, which torch.compile
    traces (``id(group)`` it does not). ``via="cpu_group"``: a ProcessGroup
    (or None), or a vLLM-style GroupCoordinator bootstrapped over its
    ``cpu_group`` (gloo) and keyed by its ``unique_name``."""
    if via == "device_group":
        if not dist.is_initialized():
            raise RuntimeError("torch_sdcp: the integrations need an initialised torch.distributed "
                               "(call torch.distributed.init_process_group first)")
        if group is None:
            if dist.group.WORLD is None:
                raise RuntimeError("torch_sdcp: the integrations need an initialised default process group")
            pg = dist.group.WORLD
        elif isinstance(group, dist.ProcessGroup):
            pg = group
        elif isinstance(getattr(group, "device_group", None), dist.ProcessGroup):
            pg = group.device_group
        else:
            raise arg_error(arg, "a torch.distributed ProcessGroup, None, or an object with a 'device_group' "
                            "ProcessGroup (a vLLM GroupCoordinator)", type(group).__name__)
        return Group(pg.group_name, pg, dist.get_world_size(pg), lambda: dist.get_rank(pg))
    if isinstance(group, dist.ProcessGroup) or group is None:
        return Group(("pg", id(group)), group, dist.get_world_size(group), lambda: dist.get_rank(group))
    cpu = getattr(group, "cpu_group", None)
    if cpu is None:
        raise TypeError(f"torch_sdcp: argument '{arg}': expected a vLLM GroupCoordinator (with a cpu_group) "
                        f"or a ProcessGroup, got {type(group).__name__}")
    name = getattr(group, "unique_name", None)
    rank = int(group.rank_in_group)
    return Group(("coordinator", name if name is not None else id(group)), cpu, int(group.world_size), lambda: rank)


def normalise_device(device: torch.device | str | None) -> torch.device:
    """None: the current CUDA device, or cpu without CUDA; a cuda device
    without index: the current one."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise arg_error("device", "a torch.device, a device string or None", repr(device)) from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise arg_error("device", "a cpu or cuda device", device)
    return device


def _in_capture_or_tracing() -> str | None:
    """What forbids a collective workspace creation right now, or None."""
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"
    return None


# ---------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------


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
_cache: dict[tuple, Entry] = {}
_lock = threading.RLock()


class EngineHooks:
    """What a face's calls read from its engine, set by the face's install()
    or configure(): the engine's own functions by name (the fallbacks) and
    the engine's DCP group (a callable returning it)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.originals: dict[str, Callable] = {}
        self.dcp_group: Callable[[], Any] | None = None

    def configure(self, dcp_group: Callable[[], Any] | None, originals: dict[str, Callable] | None) -> None:
        with self.lock:
            if dcp_group is not None:
                self.dcp_group = dcp_group
            if originals:
                self.originals.update(originals)


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


#: What a seam's counters count: calls on peer memory, calls that took the
#: engine's function (by :class:`torch_sdcp.route.Why`), and peer calls that
#: raised: voided by a peer, timed out, any other error.
COUNTS = ("peer", *(f"fallback:{why.value}" for why in Why), "void", "timeout", "error")


#: The counters' name for failures the per-step check found (a kernel's
#: timeout inside a replayed CUDA graph reaches the host there, not at a call).
STEP_CHECK = "(step check)"


def _failure_kind(error: BaseException) -> str:
    from torch_sdcp.workspaces import VoidedCallError

    if isinstance(error, VoidedCallError):
        return "void"
    return "timeout" if "timed out" in str(error) else "error"


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
        _faces[name] = self

    # -- logging -------------------------------------------------------------

    def log_once(self, level: str, reason: Any, msg: str, *args: Any) -> None:
        """Log ``msg`` once per ``reason`` (per process)."""
        with _lock:
            if reason in self.logged:
                return
            self.logged.add(reason)
        if self.logger is None:
            self.logger = self.make_logger()
        # vLLM's *_once log on the node's first rank only: right for the
        # start-up lines, which every rank shares; a warning or an error may be
        # this rank's alone, so it is logged here (already once per reason).
        once = getattr(self.logger, f"{level}_once", None) if level in ("info", "debug") else None
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
        with _lock:
            seam = self.counts.get(caller)
            if seam is None:
                seam = self.counts[caller] = dict.fromkeys(COUNTS, 0)
            seam[what] += 1

    def counters(self) -> dict[str, dict[str, int]]:
        """A copy of this face's counters: seam -> :data:`COUNTS` -> calls."""
        with _lock:
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
        g = _geometry(kind, geometry)
        ubatch = int(self.ubatch_id())
        key = self._key(kind, group, g, device, ubatch)
        entry = _cache.get(key)
        if entry is not None and entry.was_peer and not entry.workspace.peer:
            # Closed directly (not through teardown): treat it as never prepared.
            with _lock:
                if _cache.get(key) is entry:
                    del _cache[key]
            return None
        if entry is None and ubatch > 0 and self._key(kind, group, g, device, 0) in _cache:
            raise RuntimeError(f"torch_sdcp: micro-batch {ubatch} has no {kind} workspace: the workspaces were "
                               "prepared for fewer micro-batches (num_ubatches) than the engine runs")
        return entry

    def _create(self, kind: str, group: Group, g: tuple, device: torch.device, max_rows: int, options: dict,
                caller: str) -> Entry:
        why = _in_capture_or_tracing()
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
        g = _geometry(kind, geometry)
        entry = self.lookup(kind, group, geometry, device)
        if entry is not None:
            if entry.bound != max_rows:
                raise arg_error("max_rows", f"{entry.bound} (the bound of the prepared "
                                f"{self.describe(kind, group, g, device)})", max_rows)
            return entry.workspace
        entry = self._create(kind, group, g, device, max_rows, options, caller)
        with _lock:
            _cache[self._key(kind, group, g, device, 0)] = entry
        return entry.workspace

    def try_prepare(self, kind: str, group: Group, geometry: dict, device: torch.device, max_rows: int,
                    num_ubatches: int, own_path: str) -> bool:
        """Prepare one peer workspace per micro-batch (cached ones are kept,
        with their bound). False when the group cannot use peer memory: then
        nothing is cached and ``own_path`` keeps the boundary (logged once)."""
        if not isinstance(num_ubatches, int) or num_ubatches < 1:
            raise ValueError(f"torch_sdcp: argument 'num_ubatches': expected a positive int, got {num_ubatches!r}")
        g = _geometry(kind, geometry)
        options = self.options()
        with _lock:
            if (kind, group.key, g, device) in self.unavailable:
                return False
            for ub in range(num_ubatches):
                key = self._key(kind, group, g, device, ub)
                entry = _cache.get(key)
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
                _cache[key] = entry
        return True

    # -- calls ---------------------------------------------------------------

    def call(self, seam: Seam, site: Site, rows: int, peer: Callable[[Any], Any],
             fallback: Callable[[], Any] | None = None) -> Any:
        """``peer(workspace)`` on the cached workspace, or the engine's
        ``fallback()``, as :func:`torch_sdcp.route.route` decides.

        No workspace: a face with ``create_missing`` creates it (bound
        :data:`DEFAULT_MAX_ROWS`), or raises naming ``seam.prepare_call``
        during capture or tracing; any other face logs ``seam.missing`` once
        per geometry and calls ``fallback()``. With a ``fallback``, a
        workspace in collective mode or ``rows`` above its bound calls
        ``fallback()``; without one, the workspace applies its own policy
        (the same decision, made inside the workspace). Every call is counted
        under ``seam.caller``."""
        kind, (group, geometry, device) = seam.kind, site
        entry = self.lookup(kind, group, geometry, device)
        if entry is None and self.create_missing:
            entry = self._create_on_first_use(seam, site)
        decision = route(entry, rows)
        if entry is not None and decision.peer:
            return self._peer_call(seam.caller, peer, entry.workspace)
        why = decision.why
        assert why is not None
        self.count(seam.caller, f"fallback:{why.value}")
        if fallback is None:
            if entry is None:
                raise AssertionError(f"torch_sdcp: {seam.caller}: no workspace and no fallback")
            return peer(entry.workspace)  # the workspace acts on the same decision (its collective path)
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
        return fallback()

    def _peer_call(self, caller: str, peer: Callable[[Any], Any], workspace: Any) -> Any:
        try:
            result = peer(workspace)
        except RuntimeError as e:
            self.count(caller, _failure_kind(e))
            raise
        self.count(caller, "peer")
        return result

    def _create_on_first_use(self, seam: Seam, site: Site) -> Entry:
        kind, caller, (group, geometry, device) = seam.kind, seam.caller, site
        prepare_call = seam.prepare_call(geometry) if seam.prepare_call is not None else "prepare_*(...)"
        g = _geometry(kind, geometry)
        why = _in_capture_or_tracing()
        if why is not None:
            raise RuntimeError(
                f"torch_sdcp: {caller}: no {self.describe(kind, group, g, device)} was prepared, and "
                f"workspaces cannot be created during {why} (creation is collective): call "
                f"torch_sdcp.integrations.{prepare_call} on every rank at model load, before capture and "
                "compilation")
        entry = self._create(kind, group, g, device, DEFAULT_MAX_ROWS, {}, caller)
        with _lock:
            _cache[self._key(kind, group, g, device, 0)] = entry
        return entry

    # -- the face's workspaces -----------------------------------------------

    def _entries(self) -> list[tuple[tuple, Entry]]:
        with _lock:
            return [(key, entry) for key, entry in _cache.items() if key[0] == self.name]

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
        with _lock:
            for key, _ in self._entries():
                del _cache[key]
            self.unavailable.clear()
            self.logged.clear()
            self.counts.clear()
            self.logger = None

    def _drain(self) -> list[tuple[tuple, Entry]]:
        """Take this face's entries out of the cache (their counters logged)."""
        with _lock:
            entries = self._entries()
            for key, _ in entries:
                del _cache[key]
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


_faces: dict[str, Face] = {}  # name -> face, for counters()


def counters() -> dict[str, dict[str, dict[str, int]]]:
    """Every face's counters in this process: face name -> seam -> count
    (:data:`COUNTS`: ``peer`` calls, ``fallback:<why>`` calls by
    :class:`torch_sdcp.route.Why`, ``void``, ``timeout`` and ``error`` peer
    calls). Cumulative from process start (or the face's ``forget()``)."""
    return {name: face.counters() for name, face in _faces.items()}


def check_live_workspaces(face: str | None = None) -> None:
    """Raise if a live peer workspace (of ``face``, or of every face) recorded
    a failure on this rank: a timed-out or mismatched call, a peer's abort, or
    a call that a peer voided (its result is not valid: VoidedCallError).
    Reads host memory only (``check()`` never synchronises), so an engine
    calls it once per step, after the step's own synchronisation, to stop a
    step whose kernels ran after a failure ("undefined output") from
    returning its result. Every workspace is checked; the error names how many
    failed and the first failure."""
    with _lock:
        live = [(key[0], entry.workspace) for key, entry in _cache.items() if face is None or key[0] == face]
    failures = []
    for name, workspace in live:
        if not workspace.peer:  # collective mode, or closed directly: nothing of ours runs on it
            continue
        try:
            workspace.check()
        except RuntimeError as e:
            failures.append(e)
            if name in _faces:  # on CUDA a timeout inside a replayed graph surfaces here, not at a call
                _faces[name].count(STEP_CHECK, _failure_kind(e))
    if failures:
        raise RuntimeError(f"torch_sdcp: {len(failures)} of {len(live)} live workspace(s) recorded a failure; "
                           f"the step's output is not returned: {failures[0]}") from failures[0]
