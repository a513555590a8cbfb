"""``PeerWorkspace``, the lifecycle that every workspace family shares:
collective creation and resize, close and the finalizer of a dropped
workspace, poisoning, the call guard (one caller at a time) and the rows and
stream policy of a call."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from torch_sdcp import _registry
from torch_sdcp._checks import arg_error, check_bool
from torch_sdcp.peer import PeerArena, liveness
from torch_sdcp.peer.arena import creation_errors_posted
from torch_sdcp.peer.plan import RankMismatchError
from torch_sdcp.workspaces._layout import WorkspaceKind, WorkspaceLayout, workspace_layout
from torch_sdcp.workspaces._call import CallRefused, VoidedCallError, _Call
from torch_sdcp.workspaces._lifetime import _Built, _owned, _release_dropped, _tell_exited
from torch_sdcp.workspaces._policy import (agree_collective_path, check_size_param, check_timeout, default_timeout_s,
                                           resolve_group)

logger = logging.getLogger("torch_sdcp")

# How the C++ error of a call that met a peer's abort word names the peer.
_PEER_ABORTED = re.compile(r"peer (\d+) aborted")

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
    """

    kind: WorkspaceKind
    #: What ``params`` hold, in order (the C++ parameters of ``kind``).
    PARAMS: tuple[str, ...] = ()
    #: What ``layout.part_offsets`` hold, in order.
    PARTS: tuple[str, ...] = ()
    #: Data-as-flag buffers that start filled with the sentinel word.
    SENTINEL_FILLED = False
    #: Calls carry a call header and an error inside a call poisons the
    #: workspace on every rank (docs/PROTOCOL.md "Failure behaviour"); a
    #: family sets it once its kernels check headers and abort words.
    POISON_ON_ERROR = False
    #: The group's collective-path turn that the call in progress holds (hook: released in _leave).
    _turn: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:  # hook: a local check's error reaches the peers in creation's first step
            cls.__init__ = creation_errors_posted(cls.__init__)  # type: ignore[method-assign]

    def __init__(self, group: dist.ProcessGroup | None, params: list[int], *, backend: str = "auto",
                 device: torch.device | None = None, timeout_s: float | None = None,
                 allow_shared_device: bool = False, fallback: bool = False, rows_fallback: bool = True):
        # Everything local is checked before the first collective (the arena's creation).
        self._closed = True  # until created
        self._pid = os.getpid()  # the process that is this rank: a fork's child is not
        self._abort_lock = threading.RLock()  # abort() against unregistration (RLock: a signal handler may abort)
        self.handle: int | None = None
        self.arena: PeerArena | None = None
        self._finalizer: weakref.finalize | None = None
        self._watch: liveness.Watch | None = None  # the peers' processes, while the workspace has memory
        self._void_word: ctypes.c_uint64 | None = None  # the C++ void word, read after every call
        self._call_args: tuple[int, tuple, dict] | None = None  # thread and arguments of the call (call_method)
        self._committed = False  # the call in progress reached its op or collective (no void call after that)
        group, self.rank, self.world_size = resolve_group(group)
        self.timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s, "timeout_s")
        check_bool(fallback, "fallback")
        self.rows_fallback = check_bool(rows_fallback, "rows_fallback")
        self.group = group
        self._init_kwargs: dict[str, Any] = {"backend": backend, "device": device,
                                             "allow_shared_device": allow_shared_device, "fallback": fallback}
        self._stream: torch.cuda.Stream | None = None
        self._captured = False
        self._call_lock = threading.Lock()
        self._caller: tuple[int, str, str] | None = None  # (thread id, thread name, call) inside a call
        self._logged: set[str] = set()
        self._poisoned: str | None = None  # why, once a call failed after it was entered
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
        self._collective_calls = 0  # calls of this arena that took the collective path: their agreements' names
        if built.handle is not None:
            assert built.arena is not None
            _registry.add(built.handle, self)
            self._void_word = ctypes.c_uint64.from_address(torch.ops.sdcp.workspace_void_address(built.handle))
            # Weakly: the watcher must not keep a dropped workspace alive.
            self._watch = liveness.watch(built.arena.peer_pids, functools.partial(_tell_exited, weakref.ref(self)))
            self._finalizer = weakref.finalize(self, _release_dropped, type(self).__name__, self.rank,
                                               built.handle, built.arena, self._watch)
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
        self._check_process("check")
        self._check_open("check")
        if self._poisoned is None and self.handle is not None:
            try:
                torch.ops.sdcp.workspace_check(self.handle)
            except RuntimeError as e:
                self._poisoned = self._with_peer_note(str(e))
        if self._poisoned is not None:
            raise RuntimeError(self._poisoned_message("check"))
        voided = self._voided_error("check")
        if voided is not None:
            raise voided

    # -- void calls (docs/PROTOCOL.md "Void calls") ---------------------------------------------

    def _placeholder(self, what: str, args: tuple, kwargs: dict) -> Callable[[], object] | None:
        """The family's stand-in for the call ``what`` whose arguments
        ``args``/``kwargs`` failed the checks: the same call (rows, dtype,
        options, as the peers make it) on placeholder inputs, or None when the
        arguments do not say what the call would have been."""
        return None

    def _void_call(self, what: str, error: BaseException) -> bool:
        """The call failed its argument checks before it reached its op: make
        its placeholder, marked void, so that every rank stays in step and the
        peers learn of this rank's error for that call only. True when done
        (the workspace is not poisoned); False to poison as before."""
        if (not self.peer or not self.POISON_ON_ERROR or self.handle is None or self._call_args is None
                or self._call_args[0] != threading.get_ident() or self._committed):
            return False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # a graph would replay the void mark
        try:
            placeholder = self._placeholder(what, *self._call_args[1:])
        except Exception:  # noqa: BLE001  (arguments too broken to tell: poison)
            return False
        if placeholder is None:
            return False
        self._leave_note(f"{type(error).__name__}: {error}")  # before the void header goes out
        torch.ops.sdcp.workspace_void_next(self.handle, True)
        try:
            placeholder()
            if self.device.type == "cuda":  # its kernel's outcome, before this rank says it is usable
                torch.cuda.current_stream(self.device).synchronize()
            torch.ops.sdcp.workspace_check(self.handle)
        except Exception as e:  # noqa: BLE001  (a peer's mismatch or abort: the call fails as before)
            logger.info("torch_sdcp %s workspace, rank %d: the void call of %s() failed (%s)",
                        type(self).__name__, self.rank, what, e)
            return False
        finally:
            torch.ops.sdcp.workspace_void_next(self.handle, False)
        torch.ops.sdcp.workspace_take_void(self.handle)  # a peer voided it too: this rank reports its own error
        return True

    def _voided_error(self, what: str) -> VoidedCallError | None:
        """The error of the first void call that this rank's calls met since
        the last report (taken: reported once), or None."""
        if self._void_word is None or not self._void_word.value:
            return None
        word = int(torch.ops.sdcp.workspace_take_void(self.handle))
        if word == 0:
            return None
        src, call = (word & 0xFFFFFFFF) - 1, word >> 32
        note = None
        if self.arena is not None:
            try:
                note = self.arena.peer_note(src)
            except Exception:  # noqa: BLE001  (the store may be gone with the peer)
                note = None
        return VoidedCallError(
            f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {what}(): rank {src} voided call {call} "
            "(its arguments failed their checks before it sent anything, so it took part with a placeholder): "
            "that call's result is not valid on this rank; the workspace stays usable"
            + ("" if note is None else f" [rank {src}: {note}]"))

    def _poisoned_message(self, what: str) -> str:
        reason = self._poisoned or ""
        return (f"torch_sdcp: {type(self).__name__} on rank {self.rank} is poisoned: {what}() after a failed call "
                f"({reason}); re-create the workspace (close() it and create a new one on every rank, or resize())")

    def _failed(self, error: BaseException, held: bool) -> None:
        """A call raised after it was entered: poison the workspace on this
        rank and abort it on every rank, so that a peer waiting in this call
        gives up at once instead of after its timeout. Refusals of the
        ordering rules (a second stream) are not failures of the call."""
        if not held or not self.POISON_ON_ERROR or self.handle is None or isinstance(error, CallRefused):
            return
        if self._poisoned is None:
            self._poisoned = f"{type(error).__name__}: {error}"
        self._leave_note(f"{type(error).__name__}: {error}")
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

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Abort the workspace on every rank: a call waiting in it on any rank
        raises at once, and every later call raises until it is re-created.
        Thread-safe and non-blocking (a watchdog or a signal handler may call
        it while another thread is inside a call); idempotent; nothing once
        closed. In collective mode it poisons this rank only."""
        self._check_process("abort")
        if not isinstance(reason, str):
            raise arg_error("reason", "a str", type(reason).__name__)
        with self._abort_lock:
            if self._closed:
                return
            if self._poisoned is None:
                self._poisoned = f"aborted on rank {self.rank}: {reason[:200]}"
            if self.handle is not None:
                self._leave_note(f"abort(): {reason}")
                torch.ops.sdcp.workspace_abort(self.handle)

    def _leave_note(self, text: str) -> None:
        """Best effort, before the abort words go out: this rank's error, for
        the peers' errors (a store that is gone with a peer is no error here)."""
        if self.arena is not None:
            try:
                self.arena.post_note(text)
            except Exception as e:  # noqa: BLE001
                logger.info("torch_sdcp %s workspace, rank %d: could not leave the error for the peers (%s)",
                            type(self).__name__, self.rank, e)

    def _with_peer_note(self, message: str) -> str:
        """``message`` with the error that the aborting peer it names left
        (``peer r aborted: ...`` -> ``... [rank r: ValueError: ...]``)."""
        found = _PEER_ABORTED.search(message)
        if found is None or self.arena is None:
            return message
        try:
            note = self.arena.peer_note(int(found.group(1)))
        except Exception:  # noqa: BLE001  (the store may be gone with the peer)
            return message
        return message if note is None else f"{message} [rank {found.group(1)}: {note}]"

    def _peer_exited(self, rank: int, pid: int) -> None:
        """The watcher thread saw peer ``rank`` exit: abort the workspace on
        every rank at once (a wait ends now, not after its timeout)."""
        with self._abort_lock:
            if self._closed or self.handle is None:
                return
            if self._poisoned is None:
                try:
                    torch.ops.sdcp.workspace_check(self.handle)
                    self._poisoned = f"peer {rank} (pid {pid}) exited"
                except RuntimeError as e:  # it failed before (maybe a peer's abort for this exit): both
                    self._poisoned = f"{e}; peer {rank} (pid {pid}) exited"
            torch.ops.sdcp.workspace_abort(self.handle)

    # -- one caller at a time -------------------------------------------------------------------

    def _check_process(self, what: str) -> None:
        """Refuse every use from a process other than the creator's (a fork's
        child would act as its parent's rank and pair with its parent's calls)."""
        pid = os.getpid()
        if pid != self._pid:
            raise RuntimeError(
                f"torch_sdcp: {type(self).__name__} of rank {self.rank} belongs to process {self._pid}: {what}() "
                f"from process {pid} (a fork of it) is refused; create workspaces in the process that uses them")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank} is closed: {what}() after "
                               "close(); create a new workspace")

    def _enter(self, what: str) -> bool:
        """Start a call: refuse a closed workspace, and a second thread while
        another one is inside a call (non-blocking). Returns whether the call
        lock is held (never under torch.compile tracing, which runs no call)."""
        if torch.compiler.is_compiling():  # tracing runs no call (and cannot trace os.getpid)
            self._check_open(what)
            return False
        self._check_process(what)  # before the lock: a fork may have copied it held
        if not self._call_lock.acquire(blocking=False):
            me = threading.current_thread()
            other = self._caller
            inside = (f"thread {other[1]!r} (id {other[0]}) is inside {other[2]}()" if other is not None
                      else "another thread is inside a call")
            raise RuntimeError(
                f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {what}() from thread {me.name!r} "
                f"(id {me.ident}) while {inside} on this workspace: calls on one workspace must be ordered; "
                "use one workspace per thread, or serialise the calls")
        try:
            self._check_open(what)  # poisoning is reported when the call ends, after its arguments (_Call)
        except BaseException:
            self._call_lock.release()
            raise
        me = threading.current_thread()
        self._caller = (me.ident, me.name, what)
        self._committed = False
        return True

    def _leave(self, held: bool) -> None:
        if held:
            turn, self._turn = self._turn, None  # hook: the group's collective-path order
            if turn is not None:
                turn.release()
            self._caller = None
            self._call_lock.release()

    def _call(self, what: str, *, poison: bool = True) -> _Call:
        """The guard of the call ``what`` (a context manager, see ``_Call``)."""
        return _Call(self, what, poison)

    def _check_devices(self, **tensors: Any) -> None:
        """The call's tensors live on the workspace's device. A meta tensor
        would otherwise run the op's fake implementation, which makes no call:
        this rank would fall a call behind its peers."""
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise arg_error(name, f"a tensor on {self.device} (the device of this {type(self).__name__})",
                                f"a tensor on {t.device}")

    def _refuse_poisoned(self) -> None:
        """Before a collective-mode call's collective: a workspace poisoned by
        abort() enters none (its peers may not)."""
        if self._poisoned is not None:
            raise RuntimeError(self._poisoned_message(self._caller[2] if self._caller is not None else "call"))

    def _rows_fit(self, rows: int, arg: str) -> bool:
        """True when this call takes the peer path (and may use the workspace).
        The call's argument checks are over: an error from here on poisons."""
        self._committed = True
        if not self.peer:
            self._refuse_poisoned()
            return False
        if rows > self.max_rows:
            if not self.rows_fallback:
                raise arg_error(arg, f"at most max_rows = {self.max_rows} rows (this {type(self).__name__} was "
                                "created with rows_fallback=False)", rows)
            self._log_policy(f"rows-{rows}", f"{rows} rows exceed max_rows={self.max_rows}; "
                             "this call takes the collective path")
            if self.POISON_ON_ERROR:
                self.check()  # a peer's abort poisons the collective path too
            agree_collective_path(self, rows)  # every rank says so on the store before any collective
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
            raise CallRefused(
                f"torch_sdcp: {type(self).__name__} on rank {self.rank} is used from stream "
                f"{stream.cuda_stream:#x} while stream {last.cuda_stream:#x} still runs an earlier call on it: "
                "calls on one workspace must be ordered; use one workspace per stream, or make this stream "
                "wait for the other (stream.wait_stream)")
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
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
        if self.handle is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with self._abort_lock:  # no abort() stores into memory about to be unmapped
                self._void_word = None  # its memory goes with the registration
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
        self._check_process("close")
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

