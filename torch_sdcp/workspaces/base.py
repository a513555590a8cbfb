"""``PeerWorkspace``, the lifecycle that every workspace family shares:
collective creation and resize, close and the finalizer of a dropped
workspace, and the hooks of a family. Its calls are owned by a ``CallState``
(``_call.py``): entering, the path, leaving, failing, voiding, poisoning."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torch_sdcp import _registry
from torch_sdcp._checks import arg_error, call_tag, check_bool
from torch_sdcp.families import Family
from torch_sdcp.peer import PeerArena, liveness
from torch_sdcp.peer.agreements import creation_errors_posted, post_creation_error
from torch_sdcp.peer.groups import arena_count
from torch_sdcp.peer.plan import RankMismatchError
from torch_sdcp.peer.replacing import CLOSED_AGAINST_RESIZE
from torch_sdcp.peer.timeout import default_timeout_s, validate_timeout
from torch_sdcp.workspaces._call import CallRefused, CallState
from torch_sdcp.workspaces._guard import _Call
from torch_sdcp.workspaces._layout import WorkspaceKind, WorkspaceLayout, workspace_layout
from torch_sdcp.workspaces._lifetime import _Built, _owned, _release_dropped, _tell_exited
from torch_sdcp.workspaces._policy import resolve_group, validate_size_param
from torch_sdcp.workspaces._void import VoidedCallError

logger = logging.getLogger("torch_sdcp")

__all__ = ["CallRefused", "PeerWorkspace", "VoidedCallError"]


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

    A family is a subclass that sets ``family`` (its record in
    torch_sdcp/families.py, which gives it ``kind``, ``PARAMS`` and
    ``PARTS``) and the flags below, checks its creation arguments before
    calling this ``__init__``, and writes each call method as ``@call_method`` around
    ``with self._call(what):`` (argument checks, then ``self._take_path(rows,
    arg, tag)``, then its op with ``tag=tag`` or the collective path); every
    call method that makes a peer op's call takes ``tag: int | None = None``
    (keyword), the call tag its header carries; its hooks are
    ``void_placeholder`` and, where it has a precondition of resize,
    ``_require_resizable``.
    """

    #: The family's record; ``kind``, ``PARAMS`` and ``PARTS`` are read from it.
    family: Family
    kind: WorkspaceKind
    #: What ``params`` hold, in order (the C++ parameters of ``kind``).
    PARAMS: tuple[str, ...] = ()
    #: What ``layout.part_values`` hold, in order.
    PARTS: tuple[str, ...] = ()
    #: Data-as-flag buffers that start filled with the sentinel word.
    SENTINEL_FILLED = False
    #: Calls carry a call header and an error inside a call poisons the
    #: workspace on every rank (docs/PROTOCOL.md "Failure behaviour"); a
    #: family sets it once its kernels check headers and abort words.
    POISON_ON_ERROR = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        family = cls.__dict__.get("family")
        if family is not None:
            cls.kind, cls.PARAMS, cls.PARTS = family.kind, family.params, family.parts
        if "__init__" in cls.__dict__:  # a local check's error reaches the peers in creation's first step
            cls.__init__ = creation_errors_posted(cls.__init__)  # type: ignore[method-assign]

    def __init__(self, group: dist.ProcessGroup | None, params: list[int], *, backend: str = "auto",
                 device: torch.device | None = None, timeout_s: float | None = None,
                 allow_shared_device: bool = False, fallback: bool = False, rows_fallback: bool = True):
        # Everything local is checked before the first collective (the arena's creation).
        self._calls = CallState(self.POISON_ON_ERROR)  # closed until created
        self.handle: int | None = None
        self.arena: PeerArena | None = None
        self._finalizer: weakref.finalize | None = None
        group, self.rank, self.world_size = resolve_group(group)
        self.timeout_s = default_timeout_s() if timeout_s is None else validate_timeout(timeout_s, "timeout_s")
        check_bool(fallback, "fallback")
        self.rows_fallback = check_bool(rows_fallback, "rows_fallback")
        self.group = group
        self._init_kwargs: dict[str, Any] = {"backend": backend, "device": device,
                                             "allow_shared_device": allow_shared_device, "fallback": fallback}
        self._adopt(self._build([int(p) for p in params], fallback))
        self._calls.open()

    # -- creation -------------------------------------------------------------------------------

    def _build(self, params: list[int], fallback: bool) -> _Built:
        """Lay out, create (collectively), register and initialise a workspace
        for ``params`` without touching this one; on failure nothing is left."""
        layout = workspace_layout(self.kind, params, self.world_size)  # local: raises naming the argument
        kw = self._init_kwargs
        try:
            arena = PeerArena(self.group, layout.region_bytes, backend=kw["backend"], device=kw["device"],
                              allow_shared_device=kw["allow_shared_device"], timeout_s=self.timeout_s,
                              agree=self._agreement(params, fallback), watch=self._tell_peers_in_a_call(),
                              replacing=None if self.arena is None else self.arena.store_prefix)
        except Exception as e:  # the arena's failures are collective: every rank is here
            if not fallback or isinstance(e, RankMismatchError):  # disagreeing ranks are an error, not a fallback
                raise
            self._calls.log_once(self, "peer-unavailable",
                                 f"peer memory unavailable ({e}); using the collective path")
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

    def _tell_peers_in_a_call(self) -> Callable[[], None] | None:
        """While a resize creates the new arena: a peer inside a call of the current one (its header
        landed here) waits for this rank, which will not make that call; told at once (abort, with
        "left"), it fails instead of waiting timeout_s, and may resize too. None at creation."""
        if self.handle is None:
            return None
        if self.device.type == "cuda":  # this rank's calls are over: the header index is exact
            torch.cuda.synchronize(self.device)
        note = f"left: its {type(self).__name__} is being resized (resize()) in pid {os.getpid()}"
        return functools.partial(self._calls.tell_left, self, note)

    def _agreement(self, params: list[int], fallback: bool) -> dict:
        """What every rank must create alike, compared at creation (on every
        rank, before anything is allocated): the class, every parameter, the
        dtype and options of the family, and the path policies."""
        agree = {"workspace": type(self).__name__, **dict(zip(self.PARAMS, params, strict=False))}
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
        if built.handle is None:
            self._calls.attach(None, None)
            return
        assert built.arena is not None
        _registry.add(built.handle, self)
        # Weakly: the watcher must not keep a dropped workspace alive.
        watch = liveness.watch(built.arena.peer_pids, functools.partial(_tell_exited, weakref.ref(self)))
        self._calls.attach(torch.ops.sdcp.workspace_void_address(built.handle), watch)
        self._finalizer = weakref.finalize(self, _release_dropped, type(self).__name__, self.rank,
                                           built.handle, built.arena, watch)
        # At interpreter exit the process's memory goes with it: nothing to
        # release, and the CUDA context may already be going.
        self._finalizer.atexit = False
        _owned.add(self)

    def _fill_sentinel(self, arena: PeerArena, layout: WorkspaceLayout) -> None:
        """Data-as-flag buffers start as the sentinel (every byte 0xFF): each
        rank fills its own, then the group barriers before any peer may store
        into them (docs/PROTOCOL.md)."""
        size = layout.slots * layout.slot_bytes
        arena.local_view(torch.uint8, (size,), layout.data_offset).fill_(0xFF)
        if arena.device.type == "cuda":
            torch.cuda.synchronize(arena.device)
        arena.barrier()

    def _forget_inherited(self) -> None:
        """In a forked child (``_lifetime``): nothing of the parent's rank is
        released here."""
        finalizer, self._finalizer = self._finalizer, None
        self._calls.take_watch()
        if finalizer is not None:
            finalizer.detach()

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
        return self.layout.part_values[self.PARTS.index(name)]

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
    def peer_handle(self) -> int:
        """The handle that a call on the peer path passes to its op (the route step chose peer
        memory, so there is one)."""
        handle = self.handle
        if handle is None:
            raise RuntimeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank} has no peer memory "
                               "(collective mode, or closed)")
        return handle

    @property
    def closed(self) -> bool:
        return self._calls.closed

    @property
    def poisoned(self) -> bool:
        """True once a call failed after it was entered, or a peer aborted the
        workspace (as far as this rank knows: ``check()`` asks)."""
        return self._calls.poisoned is not None

    @property
    def physical_bytes(self) -> int:
        """Physical memory this rank owns for the workspace (granularity-rounded)."""
        return self.arena.stride if self.arena is not None else 0

    # -- health and abort -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise if the workspace is poisoned on this rank: a call of this
        rank failed after it was entered (timeout, call mismatch, an error),
        or a peer aborted it. Never synchronises: on CUDA it reads the error
        record that the kernels write into host-mapped memory, so it works
        between CUDA-graph replays and during capture; it reports what the
        kernels that already ran saw (synchronise the stream first for an
        exact answer). A closed workspace raises as every call does."""
        self._calls.health(self, "check")

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Abort the workspace on every rank: a call waiting in it on any rank
        raises at once, and every later call raises until it is re-created.
        Thread-safe and non-blocking (a watchdog or a signal handler may call
        it while another thread is inside a call); idempotent; nothing once
        closed. In collective mode it poisons this rank only."""
        self._calls.require_creator_process(self, "abort")
        if not isinstance(reason, str):
            raise arg_error("reason", "a str", type(reason).__name__)
        self._calls.abort(self, reason)

    def _peer_exited(self, rank: int, pid: int) -> None:
        """The liveness watcher saw peer ``rank`` exit (``_lifetime``)."""
        self._calls.peer_exited(self, rank, pid)

    # -- the family's hooks and the steps of a call ---------------------------------------------

    def void_placeholder(self, what: str, arguments: Mapping[str, Any],
                         rows: int | None = None) -> Callable[[], object] | None:
        """Family hook, not for callers: the stand-in for the call ``what``
        whose ``arguments`` (by parameter name, defaults included) failed the
        checks: the same call (rows, dtype, options, as the peers make it) on
        placeholder inputs, or None when the arguments do not say what the
        call would have been (docs/PROTOCOL.md "Void calls"). ``rows``: the
        placeholder's rows when they are not the call's own (a call over
        max_rows on this rank only takes the peers' rows)."""
        return None

    def _require_resizable(self) -> None:
        """Family hook: a family's own precondition of ``resize``: raise to refuse."""

    def _call(self, what: str, *, poison: bool = True) -> _Call:
        """The guard of the call ``what`` (a context manager, see ``_Call``)."""
        return _Call(self._calls, self, what, poison)

    def _take_path(self, rows: int | None, arg: str, tag: Any = None, header: str = "") -> bool:
        """After the call's argument checks: True for the peer path, False for
        the collective path (``CallState.take_path``; ``rows`` None for a call
        bounded in bytes). The call's ``tag`` is checked first, alike on both
        paths and before anything is published, so a bad tag is a void call.
        (The collective path carries no call header: its tag is checked, not
        compared, except in the agreement of a call over max_rows.) ``header``:
        what else the call's header carries that a peer's call may differ in
        (the LSE base, the RoPE style and the q_scale), in the words of a
        mismatch on the peer path, compared in that agreement too.)"""
        if tag is not None:  # untagged calls skip the check (a call's Python cost is what 1 row pays)
            call_tag(tag)
        return self._calls.take_path(self, rows, arg, tag, header)

    def _require_on_device(self, **tensors: Any) -> None:
        """The call's tensors live on the workspace's device. A meta tensor
        would otherwise run the op's fake implementation, which makes no call:
        this rank would fall a call behind its peers."""
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise arg_error(name, f"a tensor on {self.device} (the device of this {type(self).__name__})",
                                f"a tensor on {t.device}")

    # -- resize and teardown --------------------------------------------------------------------

    def resize(self, max_rows: int) -> None:
        """Re-create the workspace for a new row bound (collective; refused
        once the workspace was captured in a CUDA graph, once it is closed, and
        where ``_require_resizable`` refuses). The new workspace is created
        before the old one is released: if creation fails (on every rank: it
        is collective), the workspace stays as it was, still usable. A local
        refusal (a bad ``max_rows``, a family's precondition, a captured
        workspace, a layout too large) reaches the peers in the creation's
        first step, as at creation: every rank raises it at once, and the group
        stays in step. A peer that closes the workspace instead fails the
        resize at once, and the workspace is closed here too (RuntimeError)."""
        with self._call("resize", poison=False):
            begun = arena_count(self.group if self.group is not None else dist.group.WORLD)
            try:
                index = self._param_index("max_rows")
                self._require_resizable()
                validate_size_param(max_rows, "max_rows")
                if self._calls.captured:
                    raise RuntimeError(
                        f"torch_sdcp: argument 'max_rows': cannot resize {type(self).__name__} on rank {self.rank} "
                        f"to {max_rows}: it was captured in a CUDA graph, which keeps its addresses; create "
                        "a new workspace and capture again")
                params = list(self.params)
                params[index] = max_rows
                # A peer workspace keeps its memory if the new one cannot be created;
                # one in collective mode tries peer memory again under its own policy.
                built = self._build(params, self._init_kwargs["fallback"] and not self.peer)
            except Exception as e:
                # Refused before the creation began (no arena counted): the peers' resize waits in
                # its first step; post this rank's error there, then raise it.
                if arena_count(self.group if self.group is not None else dist.group.WORLD) == begun:
                    post_creation_error(self.group, e, self.timeout_s)
                closed = self.arena is not None and CLOSED_AGAINST_RESIZE in str(e)
                closing = self.arena.peers_closing() if closed and self.arena is not None else []
                if closing:  # they closed it instead (close() against resize()): close it here too
                    self._release(barrier=self._calls.close(self), why="closed (a peer closed it during resize())")
                    raise RuntimeError(
                        f"torch_sdcp: {type(self).__name__}.resize on rank {self.rank}: rank(s) "
                        f"{', '.join(map(str, closing))} closed the workspace instead of resizing it; every rank "
                        "must make the same calls in the same order; it is closed on this rank too") from e
                raise
            self._release(barrier=self._calls.poisoned is None, why="resized (resize())")
            self._adopt(built)
            self._calls.recreated()

    def _release(self, barrier: bool, why: str) -> None:
        """Synchronise, unregister, unmap and free this rank's current arena
        (with ``barrier``, collectively). A healthy workspace tells its peers
        first that this rank left it (``why``): a peer inside a call of it
        fails at once instead of after timeout_s (and closes without the
        barrier, which this rank's barrier counts)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        watch = self._calls.take_watch()
        if watch is not None:
            watch.cancel()
        tell: Callable[[], None] | None = None
        detach: Callable[[], None] | None = None
        if self.handle is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # this rank's calls are over: its abort words end none of them
            if barrier:  # a peer inside a call now, or one that enters a call while the close barrier waits
                tell = functools.partial(self._calls.tell_left, self,
                                         f"left: its {type(self).__name__} was {why} in pid {os.getpid()}")
                tell()
            # Once the barrier is over: no abort() stores into memory about to be unmapped.
            detach = functools.partial(self._calls.detach, self._unregister)
        if self.arena is not None:
            try:  # the arena stays this workspace's while the barrier waits: a "left" note goes through it
                self.arena.close(barrier=barrier, watch=tell, released=detach)
            finally:
                self.arena = None
        elif detach is not None:
            detach()

    def _unregister(self) -> None:
        assert self.handle is not None
        torch.ops.sdcp.workspace_unregister(self.handle)
        _registry.remove(self.handle)
        self.handle = None

    def close(self) -> None:
        """Synchronise, barrier, unregister, unmap and free. Idempotent; local
        only when torch.distributed is gone (interpreter exit). Every later call
        raises."""
        calls: CallState | None = getattr(self, "_calls", None)
        if calls is None or calls.closed:
            return
        calls.require_creator_process(self, "close")
        with self._call("close", poison=False):
            # A poisoned workspace is released locally: a peer may be gone, and
            # the barrier would wait out the timeout (the memory is reference-
            # counted by every process that maps it, so no peer store faults).
            self._release(barrier=calls.close(self), why="closed (close())")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "closed" if self._calls.closed else f"handle={self.handle}" if self.peer else "collective"
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, params={self.params}, "
                f"device={self.device}, {mode})")
