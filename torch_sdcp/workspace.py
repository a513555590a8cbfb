"""Workspaces: one peer arena per boundary, registered with the C++ ops under an
integer handle. Created collectively before any capture; capture and replay
never allocate, map or exchange anything.

Fallback policy (explicit, logged once per workspace and reason): a call with
more rows than ``max_rows`` runs the collective path of
:mod:`torch_sdcp.collective` (the default, ``rows_fallback=True``; with
``rows_fallback=False`` such a call is an error naming the input), and so does
every call of a workspace whose group cannot use peer memory when it was
created with ``fallback=True``. Nothing falls back as error recovery.

One caller at a time: the signalling protocol assumes that a workspace's calls
are ordered (docs/PROTOCOL.md). A call from a second stream while the first
still runs a call is an error, and so is a call from a second thread while
another thread is inside a call; switching streams or threads when the first
is idle (for example eager warm-up, then capture on a side stream) is fine. A
workspace that was captured in a CUDA graph cannot be resized: the graph keeps
its addresses. A closed workspace refuses every call.

Every wait on a peer is bounded by ``timeout_s`` (default
``DEFAULT_TIMEOUT_S`` = 300 s, or the environment variable ``SDCP_TIMEOUT_S``),
creation and teardown included. A workspace dropped without ``close()`` is
released locally when it is garbage-collected (no collective runs then).
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import os
import threading
import weakref
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import _registry, collective, ops
from torch_sdcp._checks import arg_error, check, check_bool, check_positive_int
from torch_sdcp.peer import PeerArena
from torch_sdcp.peer.plan import RankMismatchError

logger = logging.getLogger("torch_sdcp")

#: Bound of every wait on a peer when neither ``timeout_s`` nor
#: ``SDCP_TIMEOUT_S`` says otherwise: minutes, because engines skew by many
#: seconds at start (compilation, JIT, capture) and a false timeout is fatal.
DEFAULT_TIMEOUT_S = 300.0
#: The environment variable that overrides DEFAULT_TIMEOUT_S.
TIMEOUT_ENV = "SDCP_TIMEOUT_S"
#: Accepted range of a timeout, in seconds (1 ms to 24 h).
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 86400.0
#: Bound of one rank's region, in bytes (``kMaxRegionBytes`` in csrc/sdcp.h);
#: no single size parameter may exceed it either.
MAX_REGION_BYTES = 1 << 40


def check_timeout(value: object, arg: str = "timeout_s") -> float:
    """``value`` as a float number of seconds in [MIN_TIMEOUT_S, MAX_TIMEOUT_S]:
    a real number (not a string, not a bool), finite."""
    check(isinstance(value, numbers.Real) and not isinstance(value, bool), arg,
          "a number of seconds (an int or a float)", f"{type(value).__name__} {value!r}")
    seconds = float(value)
    check(math.isfinite(seconds) and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S, arg,
          f"a finite number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]", repr(value))
    return seconds


def default_timeout_s() -> float:
    """``SDCP_TIMEOUT_S`` when set (checked like ``timeout_s``), else
    DEFAULT_TIMEOUT_S. Read at every creation, so a bad value is reported by
    the workspace that would use it, not at import."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        return check_timeout(float(raw), TIMEOUT_ENV)
    except ValueError:
        raise ValueError(f"torch_sdcp: environment variable {TIMEOUT_ENV}: expected a finite number of seconds "
                         f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}], got {raw!r}") from None


def check_size_param(value: object, arg: str) -> int:
    """A size parameter of a workspace: an int (not a bool), >= 1 and at most
    MAX_REGION_BYTES (a larger one cannot fit in a region, and larger than
    int64 cannot reach the C++ layout)."""
    check_positive_int(value, arg)
    check(value <= MAX_REGION_BYTES, arg, f"a positive int of at most {MAX_REGION_BYTES} (2**40, the bound of a "
          "workspace region in bytes)", repr(value))
    return value


def resolve_group(group: object) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, this rank in it, its world size), or an error naming 'group':
    None (the default group) or a ProcessGroup this process is a member of."""
    if not dist.is_initialized():
        raise RuntimeError("torch_sdcp: workspaces are created collectively: initialise torch.distributed first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise arg_error("group", f"a process group that contains this process (global rank {dist.get_rank()})",
                            "the placeholder that new_group() returns to a process outside the group")
        hint = " (for a vLLM GroupCoordinator, pass its cpu_group or device_group)" if hasattr(group, "device_group") else ""
        raise arg_error("group", f"a torch.distributed ProcessGroup or None{hint}",
                        f"{type(group).__name__} {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise arg_error("group", f"a process group that contains this process (global rank {dist.get_rank()})",
                        "a group it is not a member of")
    return group, rank, dist.get_world_size(group)


class WorkspaceKind(enum.IntEnum):
    """The workspace families; the values are those of the C++ side
    (``WorkspaceKind`` in csrc/sdcp.h)."""

    EXCHANGE = 0
    OUTPUT_LSE = 1
    TOPK = 2
    QUERY = 3


class WorkspaceLayout(NamedTuple):
    """One rank's region as the C++ side lays it out (csrc/sdcp.h), identical
    on every rank: control (the data-as-flag call counters and abort word,
    4 KiB) in ``[0, control_bytes)``, then ``slots`` data slots of
    ``slot_bytes`` from ``data_offset``; ``region_bytes`` includes the tail pad,
    before granularity rounding. ``part_offsets`` are the family's values inside
    one slot; each workspace class names them in ``PARTS``."""

    control_bytes: int
    data_offset: int
    slots: int
    slot_bytes: int
    region_bytes: int
    part_offsets: Tuple[int, ...]


def workspace_layout(kind: WorkspaceKind, params: Sequence[int], world_size: int) -> WorkspaceLayout:
    """``torch.ops.sdcp.workspace_layout``, whose flat list follows the field
    order of ``WorkspaceLayout``, with its values named."""
    values = torch.ops.sdcp.workspace_layout(int(kind), list(params), world_size)
    fixed = len(WorkspaceLayout._fields) - 1
    return WorkspaceLayout(*values[:fixed], tuple(values[fixed:]))


class _Built(NamedTuple):
    """What one creation produced (collective mode: arena and handle None)."""

    params: list
    layout: WorkspaceLayout
    arena: Optional[PeerArena]
    handle: Optional[int]
    device: torch.device


def _release_dropped(name: str, rank: int, handle: int, arena: PeerArena) -> None:
    """Finalizer of a workspace garbage-collected without close(): local only
    (no collective from a finalizer or at interpreter exit)."""
    try:
        torch.ops.sdcp.workspace_unregister(handle)
    except Exception:  # noqa: BLE001  (interpreter exit: the library may be gone)
        pass
    _registry.remove(handle)
    try:
        arena.close(barrier=False)
    except Exception:  # noqa: BLE001
        pass
    try:
        logger.info("torch_sdcp %s workspace, rank %d: dropped without close(); released locally", name, rank)
    except Exception:  # noqa: BLE001
        pass


class _Call:
    """One call on a workspace, the guard of every public call method:
    ``with self._call("merge"): ...``. Entering starts the call (``_enter``:
    refuses a closed or poisoned workspace and a second thread); leaving with
    an error records the failure (``_failed``: poisons and aborts, unless
    ``poison`` is False, as for resize and close, which release a poisoned
    workspace), and leaving always ends the call (``_leave``). A plain class,
    so that torch.compile traces it (under tracing nothing is held, released
    or poisoned)."""

    __slots__ = ("held", "poison", "what", "workspace")

    def __init__(self, workspace: PeerWorkspace, what: str, poison: bool):
        self.workspace, self.what, self.poison, self.held = workspace, what, poison, False

    def __enter__(self) -> None:
        self.held = self.workspace._enter(self.what)

    def __exit__(self, exc_type, error, traceback) -> None:
        try:
            if error is not None and self.poison:
                self.workspace._failed(error, self.held)
        finally:
            self.workspace._leave(self.held)


class PeerWorkspace:
    """Base class: one arena of ``kind`` laid out by the C++ layout for
    ``params``, mapped into every rank of ``group``.

    ``backend``: "cuda", "host" or "auto". ``timeout_s`` bounds every wait of
    the device (or host) signals, and every step of creation and teardown; a
    timeout names rank, peer, buffer and call. Default: ``SDCP_TIMEOUT_S`` when
    set, else DEFAULT_TIMEOUT_S (300 s); accepted: a number of seconds in
    [1 ms, 24 h]. With ``fallback=True`` a group that fails the peer-memory
    capability gate gets a workspace in collective mode instead of an error
    (all ranks agree: the gate is collective). ``rows_fallback``: a call with
    more rows than ``max_rows`` takes the collective path (True, the default)
    or is an error (False).
    """

    kind: WorkspaceKind
    #: What ``params`` hold, in order (the C++ parameters of ``kind``).
    PARAMS: Tuple[str, ...] = ()
    #: What ``layout.part_offsets`` hold, in order.
    PARTS: Tuple[str, ...] = ()
    #: Data-as-flag buffers that start filled with the sentinel word.
    SENTINEL_FILLED = False
    #: Calls carry a call header and an error inside a call poisons the
    #: workspace on every rank (docs/PROTOCOL.md "Failure behaviour"); a
    #: family sets it once its kernels check headers and abort words.
    POISON_ON_ERROR = False

    def __init__(self, group: Optional[dist.ProcessGroup], params: list[int], *, backend: str = "auto",
                 device: Optional[torch.device] = None, timeout_s: Optional[float] = None,
                 allow_shared_device: bool = False, fallback: bool = False, rows_fallback: bool = True):
        # Everything local is checked before the first collective (the arena's creation).
        self._closed = True  # until created
        self.handle: Optional[int] = None
        self.arena: Optional[PeerArena] = None
        self._finalizer: Optional[weakref.finalize] = None
        group, self.rank, self.world_size = resolve_group(group)
        self.timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s, "timeout_s")
        check_bool(fallback, "fallback")
        self.rows_fallback = check_bool(rows_fallback, "rows_fallback")
        self.group = group
        self._init_kwargs = dict(backend=backend, device=device, allow_shared_device=allow_shared_device,
                                 fallback=fallback)
        self._stream: Optional[torch.cuda.Stream] = None
        self._captured = False
        self._call_lock = threading.Lock()
        self._caller: Optional[Tuple[int, str, str]] = None  # (thread id, thread name, call) inside a call
        self._logged: set[str] = set()
        self._poisoned: Optional[str] = None  # why, once a call failed after it was entered
        self._adopt(self._build([int(p) for p in params], fallback))
        self._closed = False

    # -- creation -------------------------------------------------------------------------------

    def _build(self, params: list[int], fallback: bool) -> _Built:
        """Lay out, create (collectively), register and initialise a workspace
        for ``params`` without touching this one; on failure nothing is left."""
        layout = workspace_layout(self.kind, params, self.world_size)  # local: raises naming the argument
        kw = self._init_kwargs
        try:
            arena = PeerArena(self.group, layout.region_bytes, backend=kw["backend"], device=kw["device"],
                              allow_shared_device=kw["allow_shared_device"], timeout_s=self.timeout_s,
                              agree=self._agreement(params, fallback))
        except Exception as e:  # the arena's failures are collective: every rank is here
            if not fallback or isinstance(e, RankMismatchError):  # disagreeing ranks are an error, not a fallback
                raise
            self._log_policy("peer-unavailable", f"peer memory unavailable ({e}); using the collective path")
            device = kw["device"] or (torch.device("cuda", torch.cuda.current_device())
                                      if kw["backend"] != "host" and torch.cuda.is_available()
                                      else torch.device("cpu"))
            return _Built(params, layout, None, None, torch.device(device))
        handle = None
        try:
            handle = _registry.new_handle()
            torch.ops.sdcp.workspace_register(handle, int(self.kind), params, arena.base_address, arena.stride,
                                              self.rank, self.world_size, arena.device, int(self.timeout_s * 1e9))
            if self.SENTINEL_FILLED:
                self._fill_sentinel(arena, layout)
        except BaseException:
            if handle is not None and handle in torch.ops.sdcp.workspace_handles():
                torch.ops.sdcp.workspace_unregister(handle)
            arena.close(barrier=False)
            raise
        return _Built(params, layout, arena, handle, arena.device)

    def _agreement(self, params: list[int], fallback: bool) -> dict:
        """What every rank must create alike, compared at creation (on every
        rank, before anything is allocated): the class, every parameter, the
        dtype and options of the family, and the path policies."""
        agree = {"workspace": type(self).__name__, **dict(zip(self.PARAMS, params))}
        for name in ("dtype", "rope_style"):
            if hasattr(self, name):
                agree[name] = str(getattr(self, name))
        agree.update(fallback=fallback, rows_fallback=self.rows_fallback)
        return agree

    def _adopt(self, built: _Built) -> None:
        self.params = built.params
        self.layout = built.layout
        self.nbytes_per_rank = built.layout.region_bytes
        self.arena, self.handle, self.device = built.arena, built.handle, built.device
        if built.handle is not None:
            _registry.add(built.handle, self)
            self._finalizer = weakref.finalize(self, _release_dropped, type(self).__name__, self.rank,
                                               built.handle, built.arena)
            # At interpreter exit the process's memory goes with it: nothing to
            # release, and the CUDA context may already be going.
            self._finalizer.atexit = False

    def _fill_sentinel(self, arena: PeerArena, layout: WorkspaceLayout) -> None:
        """Data-as-flag buffers start as the sentinel (every byte 0xFF): each
        rank fills its own, then the group barriers before any peer may store
        into them (docs/PROTOCOL.md)."""
        size = layout.slots * layout.slot_bytes
        arena.local_view(torch.uint8, (size,), layout.data_offset).fill_(0xFF)
        if arena.device.type == "cuda":
            torch.cuda.synchronize(arena.device)
        arena.barrier()

    # -- parameters -----------------------------------------------------------------------------

    def _param_index(self, name: str) -> int:
        if name not in self.PARAMS:
            raise AttributeError(f"torch_sdcp: {type(self).__name__} has no parameter '{name}' "
                                 f"(its parameters: {', '.join(self.PARAMS)})")
        return self.PARAMS.index(name)

    def param(self, name: str) -> int:
        """The creation parameter ``name`` (one of ``PARAMS``)."""
        return self.params[self._param_index(name)]

    def part(self, name: str) -> int:
        """The layout value ``name`` (one of ``PARTS``)."""
        return self.layout.part_offsets[self.PARTS.index(name)]

    @property
    def max_rows(self) -> int:
        """Rows bound of the peer path (every family but the exchange, which is
        bounded in bytes)."""
        return self.param("max_rows")

    @property
    def peer(self) -> bool:
        """True when calls use peer memory, False in collective mode (and once closed)."""
        return self.handle is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def poisoned(self) -> bool:
        """True once a call failed after it was entered, or a peer aborted the
        workspace (as far as this rank knows: ``check()`` asks)."""
        return self._poisoned is not None

    def check(self) -> None:
        """Raise if the workspace is poisoned on this rank: a call of this
        rank failed after it was entered (timeout, call mismatch, an error),
        or a peer aborted it. Never synchronises: on CUDA it reads the error
        record that the kernels write into host-mapped memory, so it works
        between CUDA-graph replays and during capture; it reports what the
        kernels that already ran saw (synchronise the stream first for an
        exact answer). A closed workspace raises as every call does."""
        self._check_open("check")
        if self._poisoned is None and self.handle is not None:
            try:
                torch.ops.sdcp.workspace_check(self.handle)
            except RuntimeError as e:
                self._poisoned = str(e)
        if self._poisoned is not None:
            raise RuntimeError(self._poisoned_message("check"))

    def _poisoned_message(self, what: str) -> str:
        reason = self._poisoned or ""
        return (f"torch_sdcp: {type(self).__name__} on rank {self.rank} is poisoned: {what}() after a failed call "
                f"({reason}); re-create the workspace (close() it and create a new one on every rank, or resize())")

    def _failed(self, error: BaseException, held: bool) -> None:
        """A call raised after it was entered: poison the workspace on this
        rank and abort it on every rank, so that a peer waiting in this call
        gives up at once instead of after its timeout. Refusals of the
        ordering rules (a second stream) are not failures of the call."""
        if not held or not self.POISON_ON_ERROR or self.handle is None or getattr(error, "_sdcp_refusal", False):
            return
        if self._poisoned is None:
            self._poisoned = f"{type(error).__name__}: {error}"
        try:
            torch.ops.sdcp.workspace_abort(self.handle)
        except Exception as e:  # noqa: BLE001  (the error of the call is what the caller needs)
            logger.warning("torch_sdcp %s workspace, rank %d: could not abort the workspace on the peers (%s)",
                           type(self).__name__, self.rank, e)

    @property
    def physical_bytes(self) -> int:
        """Physical memory this rank owns for the workspace (granularity-rounded)."""
        return self.arena.stride if self.arena is not None else 0

    def _log_policy(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("torch_sdcp %s workspace, rank %d: %s", type(self).__name__, self.rank, message)

    # -- one caller at a time -------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank} is closed: {what}() after "
                               "close(); create a new workspace")

    def _enter(self, what: str) -> bool:
        """Start a call: refuse a closed workspace, and a second thread while
        another one is inside a call (non-blocking). Returns whether the call
        lock is held (never under torch.compile tracing, which runs no call)."""
        if torch.compiler.is_compiling():
            self._check_open(what)
            return False
        if not self._call_lock.acquire(blocking=False):
            me = threading.current_thread()
            other = self._caller
            inside = f"thread {other[1]!r} (id {other[0]}) is inside {other[2]}()" if other is not None                 else "another thread is inside a call"
            raise RuntimeError(
                f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {what}() from thread {me.name!r} "
                f"(id {me.ident}) while {inside} on this workspace: calls on one workspace must be ordered; "
                "use one workspace per thread, or serialise the calls")
        try:
            self._check_open(what)
            if self._poisoned is not None and what not in ("resize", "close"):  # both release it
                raise RuntimeError(self._poisoned_message(what))
        except BaseException:
            self._call_lock.release()
            raise
        me = threading.current_thread()
        self._caller = (me.ident, me.name, what)
        return True

    def _leave(self, held: bool) -> None:
        if held:
            self._caller = None
            self._call_lock.release()

    def _call(self, what: str, *, poison: bool = True) -> _Call:
        """The guard of the call ``what`` (a context manager, see ``_Call``)."""
        return _Call(self, what, poison)

    def _rows_fit(self, rows: int, arg: str) -> bool:
        """True when this call takes the peer path (and may use the workspace)."""
        if not self.peer:
            return False
        if rows > self.max_rows:
            if not self.rows_fallback:
                raise arg_error(arg, f"at most max_rows = {self.max_rows} rows (this {type(self).__name__} was "
                                "created with rows_fallback=False)", rows)
            self._log_policy(f"rows-{rows}", f"{rows} rows exceed max_rows={self.max_rows}; "
                             "this call takes the collective path")
            if self.POISON_ON_ERROR:
                self.check()  # a peer's abort poisons the collective path too
            return False
        self._check_stream()
        return True

    def _check_stream(self) -> None:
        """Calls on one workspace must be ordered: refuse a second stream while
        the first still runs a call (docs/PROTOCOL.md)."""
        if self.device.type != "cuda" or torch.compiler.is_compiling():
            return
        stream = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        self._captured = self._captured or capturing
        last = self._stream
        # A capture starts from a synchronised device (torch.cuda.graph does
        # it); querying another stream during a global capture is not allowed.
        if last is not None and last != stream and not capturing and not last.query():
            refusal = RuntimeError(
                f"torch_sdcp: {type(self).__name__} on rank {self.rank} is used from stream "
                f"{stream.cuda_stream:#x} while stream {last.cuda_stream:#x} still runs an earlier call on it: "
                "calls on one workspace must be ordered; use one workspace per stream, or make this stream "
                "wait for the other (stream.wait_stream)")
            refusal._sdcp_refusal = True  # refused before the call touched the workspace: no poisoning
            raise refusal
        self._stream = stream

    # -- resize and teardown --------------------------------------------------------------------

    def resize(self, max_rows: int) -> None:
        """Re-create the workspace for a new row bound (collective; refused
        once the workspace was captured in a CUDA graph, once it is closed, and
        where ``_check_resizable`` refuses). The new workspace is created
        before the old one is released: if creation fails (on every rank: it
        is collective), the workspace stays as it was, still usable."""
        with self._call("resize", poison=False):
            index = self._param_index("max_rows")
            self._check_resizable()
            check_size_param(max_rows, "max_rows")
            if self._captured:
                raise RuntimeError(
                    f"torch_sdcp: argument 'max_rows': cannot resize {type(self).__name__} on rank {self.rank} "
                    f"to {max_rows}: it was captured in a CUDA graph, which keeps its addresses; create "
                    "a new workspace and capture again")
            params = list(self.params)
            params[index] = max_rows
            # A peer workspace keeps its memory if the new one cannot be created;
            # one in collective mode tries peer memory again under its own policy.
            built = self._build(params, self._init_kwargs["fallback"] and not self.peer)
            self._release(barrier=self._poisoned is None)
            self._adopt(built)
            self._poisoned = None

    def _check_resizable(self) -> None:
        """A family's own precondition of ``resize``: raise to refuse."""

    def _release(self, barrier: bool) -> None:
        """Synchronise, unregister, unmap and free this rank's current arena
        (with ``barrier``, collectively)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if self.handle is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            torch.ops.sdcp.workspace_unregister(self.handle)
            _registry.remove(self.handle)
            self.handle = None
        if self.arena is not None:
            arena, self.arena = self.arena, None
            arena.close(barrier=barrier)

    def close(self) -> None:
        """Synchronise, barrier, unregister, unmap and free. Idempotent; local
        only when torch.distributed is gone (interpreter exit). Every later call
        raises."""
        if getattr(self, "_closed", True):
            return
        with self._call("close", poison=False):
            if self._poisoned is None and self.handle is not None:
                try:
                    torch.ops.sdcp.workspace_check(self.handle)
                except RuntimeError as e:
                    self._poisoned = str(e)
            self._closed = True
            # A poisoned workspace is released locally: a peer may be gone, and
            # the barrier would wait out the timeout (the memory is reference-
            # counted by every process that maps it, so no peer store faults).
            self._release(barrier=self._poisoned is None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "closed" if self._closed else f"handle={self.handle}" if self.peer else "collective"
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, params={self.params}, "
                f"device={self.device}, {mode})")


class ExchangeWorkspace(PeerWorkspace):
    """A generic peer all-gather of up to ``max_bytes`` per rank: the
    signalling primitive the boundaries are built from."""

    kind = WorkspaceKind.EXCHANGE
    PARAMS = ("max_bytes",)
    # inbox [peer][word] of tagged 64-bit words (4 payload bytes each); bytes between two peers' entries;
    # call headers [peer][4 tagged words]
    PARTS = ("inbox", "source_stride", "headers")
    POISON_ON_ERROR = True

    def __init__(self, group: Optional[dist.ProcessGroup], max_bytes: int, **kwargs):
        super().__init__(group, [check_size_param(max_bytes, "max_bytes")], **kwargs)

    def all_gather(self, x: Tensor) -> Tensor:
        """[N, *x.shape] with every rank's x, rank-major."""
        with self._call("all_gather"):
            if not isinstance(x, Tensor):
                raise arg_error("x", "a Tensor", type(x).__name__)
            if not self.peer:
                out = [torch.empty_like(x) for _ in range(self.world_size)]
                dist.all_gather(out, x.contiguous(), group=self.group)
                return torch.stack(out)
            return ops.peer_all_gather(x, self.handle)


def _require_tensor(t: object, arg: str, dims: int, names: str) -> None:
    """A Tensor of ``dims`` dimensions. The checks of a call build their
    message only when they fail, so that torch.compile traces none of it."""
    if not isinstance(t, Tensor):
        raise arg_error(arg, "a Tensor", type(t).__name__)
    if t.dim() != dims:
        raise arg_error(arg, f"{dims} dimensions {names}", f"{t.dim()} (shape {list(t.shape)})")


def _check_combine_inputs(ws: "OutputLSEWorkspace", partial_out: object, partial_lse: object) -> None:
    """The inputs of combine and combine_out, checked alike on the peer and the
    collective path (the C++ op checks the same, but cannot tell two dtypes of
    one element size apart)."""
    _require_tensor(partial_out, "partial_out", 3, "[T, H, D]")
    _require_tensor(partial_lse, "partial_lse", 2, "[T, H]")
    if partial_out.dtype != ws.dtype:
        raise arg_error("partial_out", f"dtype {ws.dtype} (the dtype of this OutputLSEWorkspace)",
                        f"dtype {partial_out.dtype}")
    if partial_lse.dtype != torch.float32:
        raise arg_error("partial_lse", "dtype torch.float32", f"dtype {partial_lse.dtype}")
    # The wording of csrc (check_size), so that both paths read alike.
    for d, want, what in ((1, ws.total_heads, "total_heads"), (2, ws.head_dim, "head_dim")):
        if partial_out.shape[d] != want:
            raise arg_error("partial_out", f"size {want} at dim {d} ({what} of this OutputLSEWorkspace)",
                            f"{partial_out.shape[d]} (shape {list(partial_out.shape)})")
    for d in (0, 1):
        if partial_lse.shape[d] != partial_out.shape[d]:
            raise arg_error("partial_lse", f"size {partial_out.shape[d]} at dim {d} (that of 'partial_out')",
                            f"{partial_lse.shape[d]} (shape {list(partial_lse.shape)})")
    if partial_lse.device != partial_out.device:
        raise arg_error("partial_lse", f"device {partial_out.device} (that of 'partial_out')",
                        f"device {partial_lse.device}")


def _check_combine_outputs(ws: "OutputLSEWorkspace", partial_out: Tensor, out: object, out_lse: object) -> None:
    """combine_out's caller-owned outputs, checked alike on both paths (as
    csrc/output_lse.cpp checks them): exact shape, dtype, contiguous, device."""
    rows, hl, d = partial_out.shape[0], ws.local_heads, ws.head_dim
    for t, arg, shape, dtype in ((out, "out", (rows, hl, d), partial_out.dtype),
                                 (out_lse, "out_lse", (rows, hl), torch.float32)):
        if not isinstance(t, Tensor):
            raise arg_error(arg, "a Tensor", type(t).__name__)
        if tuple(t.shape) != shape:
            raise arg_error(arg, f"shape {list(shape)}", f"shape {list(t.shape)}")
        if t.dtype != dtype:
            raise arg_error(arg, f"dtype {dtype}", f"dtype {t.dtype}")
        if not t.is_contiguous():
            raise arg_error(arg, "a contiguous tensor", f"strides {list(t.stride())} for shape {list(t.shape)}")
        if t.device != partial_out.device:
            raise arg_error(arg, f"device {partial_out.device} (that of 'partial_out')", f"device {t.device}")


class OutputLSEWorkspace(PeerWorkspace):
    """Output/LSE boundary: each producer stores every destination's head shard
    and LSE straight into that owner's inbox; the owner waits for every
    producer, corrects with the LSEs in fp32 and rounds once.

    Data-as-flag (docs/PROTOCOL.md): each producer stores every peer's head
    shard straight into that peer's buffer; this rank's own shard is read in
    place from ``partial_out``.

    Physical memory per rank: 4 KiB control + 2 buffers x (N - 1) x max_rows x
    H/N x (head_dim x element size + 4) bytes + 64 KiB tail, granularity-rounded.
    """

    kind = WorkspaceKind.OUTPUT_LSE
    PARAMS = ("max_rows", "total_heads", "head_dim", "elem_bytes")
    # One entry per peer: out [peer][row][h_loc][d]; lse [peer][row][h_loc] fp32; call headers [peer][16 bytes]
    PARTS = ("out_inbox", "lse_inbox", "headers")
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, total_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, **kwargs):
        check(dtype in (torch.bfloat16, torch.float16, torch.float32), "dtype", "bfloat16, float16 or float32",
              dtype)
        _, _, world = resolve_group(group)
        check_size_param(max_rows, "max_rows")
        check(check_size_param(total_heads, "total_heads") % world == 0, "total_heads",
              f"a multiple of the world size {world}", total_heads)
        check_size_param(head_dim, "head_dim")
        self.dtype = dtype
        self.total_heads, self.head_dim = total_heads, head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [max_rows, total_heads, head_dim, elem], **kwargs)

    @property
    def local_heads(self) -> int:
        return self.total_heads // self.world_size

    def combine(self, partial_out: Tensor, partial_lse: Tensor, *, lse_base: str = "e",
                return_lse: bool = False):
        """partial_out [T, H, D] of the workspace dtype, partial_lse [T, H] fp32
        over this rank's KV shard -> this rank's heads [T, H/N, D] (and their
        LSE [T, H/N])."""
        with self._call("combine"):
            _check_combine_inputs(self, partial_out, partial_lse)
            base2 = ops.lse_is_base2(lse_base)
            if self._rows_fit(partial_out.shape[0], "partial_out"):
                out, lse = ops.output_lse_combine(partial_out, partial_lse, self.handle, lse_base=lse_base)
            else:  # the fused collective path; its output is a [T, H/N, D] view of head-major storage
                out, lse = collective.lse_all_gather_correct_reduce_scatter(
                    partial_out, partial_lse, base2=base2, return_lse=True, group=self.group)
            return (out, lse) if return_lse else out

    def combine_out(self, partial_out: Tensor, partial_lse: Tensor, out: Tensor, out_lse: Tensor, *,
                    lse_base: str = "e") -> None:
        """As combine, written into caller-owned out [T, H/N, D] (the workspace
        dtype) and out_lse [T, H/N] fp32, both contiguous, on the inputs'
        device; the same checks on the peer and the collective path."""
        with self._call("combine_out"):
            _check_combine_inputs(self, partial_out, partial_lse)
            _check_combine_outputs(self, partial_out, out, out_lse)
            base2 = ops.lse_is_base2(lse_base)
            if self._rows_fit(partial_out.shape[0], "partial_out"):
                ops.output_lse_combine_out(partial_out, partial_lse, self.handle, out, out_lse, lse_base=lse_base)
            else:
                collective.lse_all_gather_correct_reduce_scatter(
                    partial_out, partial_lse, base2=base2, return_lse=True, group=self.group, out=out,
                    out_lse=out_lse)


class TopKWorkspace(PeerWorkspace):
    """Top-K boundary: each owner sorts its candidates once and pushes its best
    min(C, k) keys into every peer's buffer; every consumer merges the lists
    as they land with its own (identical result on every rank).

    Data-as-flag (docs/PROTOCOL.md): the buffers start as the sentinel (every
    byte 0xFF), which no 64-bit selection key can take; the consumer writes it
    back as it takes each list. Every call carries a call header, so ranks
    whose calls differ raise on every rank, and an error inside a call
    poisons the workspace on every rank.

    Physical memory per rank: 4 KiB control + 2 buffers x ((N - 1) x max_rows
    x min(C, k) x 8 bytes + the call headers) + 64 KiB tail, granularity-rounded
    (DCP2, 128 rows, C = k = 2048: 6 MiB with a 2 MiB granularity).
    """

    kind = WorkspaceKind.TOPK
    PARAMS = ("max_rows", "candidates_per_rank", "k")
    # One entry per peer: a peer's sorted best keys [peer][row][min(C, k)]; min(C, k);
    # call headers [peer][16 bytes]
    PARTS = ("keys", "keys_per_row", "headers")
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, k: int,
                 candidates_per_rank: Optional[int] = None, **kwargs):
        check_size_param(max_rows, "max_rows")
        self.k = check_size_param(k, "k")
        self.candidates_per_rank = check_size_param(k if candidates_per_rank is None else candidates_per_rank,
                                                    "candidates_per_rank")
        super().__init__(group, [max_rows, self.candidates_per_rank, self.k], **kwargs)

    def merge(self, scores: Tensor, ids: Tensor) -> Tensor:
        """scores [T, C] fp32, global ids [T, C] int32 (-1: none) -> the global
        top-k ids [T, k] int32 in selection order, identical on every rank."""
        with self._call("merge"):
            _require_tensor(scores, "scores", 2, "[T, C]")
            if not isinstance(ids, Tensor):
                raise arg_error("ids", "a Tensor", type(ids).__name__)
            if self._rows_fit(scores.shape[0], "scores"):
                return ops.topk_merge(scores, ids, self.handle, self.k)
            return collective.topk_all_gather_merge(scores, ids, self.k, group=self.group)


def _check_query_inputs(ql_nope: object, q_pe: object) -> None:
    _require_tensor(ql_nope, "ql_nope", 3, "[T, H, nope]")
    if not isinstance(q_pe, Tensor):
        raise arg_error("q_pe", "a Tensor", type(q_pe).__name__)


class QueryWorkspace(PeerWorkspace):
    """Query boundary: the fused RoPE/FP8 producer stores this rank's head shard
    straight into every peer's memory; the gathered query is
    ``[T, N*H_loc, nope+rope]`` (head ``src*H_loc + h``) on every rank.

    Three ways to use it: ``gather`` returns a fresh tensor (safe anywhere,
    torch.compile included); ``gather_view`` returns a zero-copy view of this
    rank's inbox, valid until ``release()``; ``all_gather_heads`` gathers a
    query produced elsewhere (RoPE already applied, maybe quantised; no
    producer), for example vLLM's.

    Data-as-flag (docs/PROTOCOL.md, version 4). ``gather`` and
    ``all_gather_heads`` use two rotating buffers of peer entries (a rank's own
    heads go straight into the result). The view is one buffer at a fixed
    address (a CUDA graph captures its reader with it) in the final layout: no
    producer stores the next view call's query into it before this rank's
    ``release()`` has re-filled the rows that were read and said so, so a late
    reader never sees an overwritten view. Every non-NaN value arrives
    bit-exact; an aligned 4-byte word of all-ones bytes (a NaN) arrives as the
    canonical NaN word.

    ``dtype``: bf16 or float8_e4m3fn for the producer; ``all_gather_heads``
    also moves fp16, fp32 and float8_e5m2 (every dtype whose all-ones element
    is NaN). ``rope_dim=0`` makes a workspace for ``all_gather_heads`` only
    (heads of ``nope_dim`` elements).

    Physical memory per rank: 4 KiB control + max_rows x N x local_heads x
    (nope + rope) x element size (the view) + 2 x max_rows x (N - 1) x
    local_heads x (nope + rope) x element size (the buffers) + 64 KiB tail,
    granularity-rounded.
    """

    kind = WorkspaceKind.QUERY
    PARAMS = ("max_rows", "local_heads", "head_dim", "elem_bytes")
    # the view [row][src*H_loc + h][nope + rope]; buffer 0 [peer][row][h][nope + rope] (buffer 1 follows);
    # bytes of one buffer; call headers [buffer 0, buffer 1, view][peer][16 bytes]
    PARTS = ("inbox", "buffers", "buffer_bytes", "headers")
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, local_heads: int, nope_dim: int = 512,
                 rope_dim: int = 64, dtype: torch.dtype = torch.float8_e4m3fn, rope_style: str = "interleaved",
                 **kwargs):
        check(dtype in ops.QUERY_GATHER_DTYPES, "dtype", f"one of {ops.QUERY_GATHER_DTYPES}", dtype)
        ops.rope_is_neox(rope_style)
        check_size_param(max_rows, "max_rows")
        check_size_param(local_heads, "local_heads")
        check_size_param(nope_dim, "nope_dim")
        if not (type(rope_dim) is int and rope_dim == 0):  # 0: a workspace for all_gather_heads only
            check(check_size_param(rope_dim, "rope_dim") % 2 == 0, "rope_dim", "an even value", rope_dim)
        self.dtype, self.rope_style = dtype, rope_style
        self.local_heads = local_heads
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self._open_view: Optional[Tensor] = None
        self._inbox_view: Optional[Tensor] = None
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [max_rows, local_heads, nope_dim + rope_dim, elem], **kwargs)

    @property
    def inbox(self) -> Optional[Tensor]:
        """This rank's whole inbox, the view buffer [max_rows, N*H_loc,
        nope+rope] (None in collective mode). Read it only between
        gather_view() and release(), and only the rows that gather_view()
        returned (the rest holds the sentinel)."""
        if self.arena is None:
            return None
        width = self.nope_dim + self.rope_dim
        elem = torch.empty((), dtype=self.dtype).element_size()
        raw = self.arena.local_view(torch.uint8, (self.max_rows, self.world_size * self.local_heads, width * elem),
                                    self.layout.data_offset + self.part("inbox"))
        return raw.view(self.dtype)

    def _check_resizable(self) -> None:
        if self._open_view is not None:
            raise RuntimeError("torch_sdcp: QueryWorkspace.resize: a view from gather_view() is still open; "
                               "release() it first")

    def _release(self, barrier: bool) -> None:
        """As PeerWorkspace._release; an open view becomes invalid."""
        self._open_view = self._inbox_view = None
        super()._release(barrier)

    def _check_no_open_view(self, what: str) -> None:
        if self._open_view is not None:
            refusal = RuntimeError(f"torch_sdcp: QueryWorkspace.{what} on rank {self.rank}: the view returned by "
                                   "the last gather_view() is still open; call release() once its reader is done, "
                                   "before producing the next query")
            refusal._sdcp_refusal = True  # refused before the call touched the workspace: no poisoning
            raise refusal

    def gather(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
               q_scale: Optional[Tensor] = None) -> Tensor:
        """A fresh gathered query [T, N*H_loc, nope+rope] (head = src*H_loc + h),
        bit-identical to producing locally then all_gather on heads."""
        with self._call("gather"):
            if not torch.compiler.is_compiling():
                self._check_no_open_view("gather")
            return self._gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)

    def _gather(self, ql_nope, q_pe, positions, cos_sin_cache, q_scale) -> Tensor:
        _check_query_inputs(ql_nope, q_pe)
        if self._rows_fit(ql_nope.shape[0], "ql_nope"):
            return ops.query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.handle,
                                    rope_style=self.rope_style, out_dtype=self.dtype)
        return collective.query_all_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale,
                                           neox=self.rope_style == "neox", out_dtype=self.dtype, group=self.group)

    def gather_view(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                    q_scale: Optional[Tensor] = None) -> Tensor:
        """Zero-copy: as gather, but returns a view [T, N*H_loc, nope+rope] of
        this rank's inbox. The view stays valid until ``release()``, which the
        caller must call after the last kernel that reads it has been enqueued
        (same stream) and before the next gather or gather_view. Eager and CUDA
        graphs only: under torch.compile use ``gather``. A call with more rows
        than max_rows takes the collective path and returns a fresh tensor
        (release() is still required, and does nothing on the device)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("torch_sdcp: QueryWorkspace.gather_view is not traceable by torch.compile (its "
                               "result aliases workspace memory); use gather() inside compiled regions")
        with self._call("gather_view"):
            self._check_no_open_view("gather_view")
            _check_query_inputs(ql_nope, q_pe)
            rows = ql_nope.shape[0]
            if self._rows_fit(rows, "ql_nope"):
                ops.query_publish(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.handle,
                                  rope_style=self.rope_style, out_dtype=self.dtype)
                if self._inbox_view is None:
                    self._inbox_view = self.inbox
                view = self._inbox_view[:rows]
            else:
                view = self._gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)
            self._open_view = view
            return view

    def release(self) -> None:
        """The reader of the last gather_view() is done: this rank's view rows
        are re-filled and the producers told that they may store the next view
        call's query. Enqueued on the current stream (capturable)."""
        with self._call("release"):
            if self._open_view is None:
                refusal = RuntimeError(f"torch_sdcp: QueryWorkspace.release on rank {self.rank}: no view is open "
                                       "(gather_view() was not called, or release() was already called)")
                refusal._sdcp_refusal = True  # nothing was touched: no poisoning
                raise refusal
            view, self._open_view = self._open_view, None
            if self.peer and self._inbox_view is not None and view.data_ptr() == self._inbox_view.data_ptr():
                self._check_stream()
                ops.query_release(view, self.handle)  # re-fills the rows the view had

    def all_gather_heads(self, q: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """A query produced elsewhere, ``q [T, H_loc, nope+rope]`` of the
        workspace dtype on every rank -> ``[T, N*H_loc, nope+rope]``, head
        ``src*H_loc + h``: ``all_gather(q, dim=1)`` with every non-NaN value
        bit-exact (an aligned 4-byte word of all-ones bytes, a NaN, arrives as
        the canonical NaN word). Written into ``out`` when given (contiguous,
        that shape and dtype, for example a view of larger storage), which is
        returned. Rows above max_rows take the collective path."""
        with self._call("all_gather_heads"):
            if not torch.compiler.is_compiling():
                self._check_no_open_view("all_gather_heads")
            _require_tensor(q, "q", 3, "[T, H_loc, W]")
            if q.dtype != self.dtype:
                raise arg_error("q", f"dtype {self.dtype} (the dtype of this QueryWorkspace)", f"dtype {q.dtype}")
            if out is not None and not isinstance(out, Tensor):
                raise arg_error("out", "a Tensor or None", type(out).__name__)
            if self._rows_fit(q.shape[0], "q"):
                if out is None:
                    return ops.query_all_gather_heads(q, self.handle)
                ops.query_all_gather_heads_out(q, self.handle, out)
                return out
            return collective.all_gather_heads(q, self.group, out)
