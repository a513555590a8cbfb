"""The owner of a workspace's calls (``CallState``), the guard of every public
call method (``with self._call(what)``), the decorator that keeps a call's
arguments (``call_method``) and the refusals that leave a workspace usable.

The call owner reads its workspace through ``CallHost`` only: public members
and the family's ``void_placeholder`` hook. It holds no reference to the
workspace (a dropped workspace is released at once, not by the cycle
collector): the workspace passes itself to every step that needs it."""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch

from torch_sdcp._checks import arg_error
from torch_sdcp.peer.collectives import AgreementAbandoned
from torch_sdcp.route import Why, route, route_without_rows
from torch_sdcp.workspaces._collective_path import (
    VIEW_CALLS,
    PeerPathTaken,
    agree_collective_path,
    describe_peer_rows,
    peer_path_probe,
    peer_rows,
    took_peer_path,
)

if TYPE_CHECKING:
    from torch_sdcp.peer import PeerArena, liveness

logger = logging.getLogger("torch_sdcp")

# How the C++ error of a call that met a peer's abort word names the peer.
_PEER_ABORTED = re.compile(r"peer (\d+) aborted")

#: A call's arguments as ``call_method`` keeps them: (thread id, the method's
#: signature without ``self``, positional arguments, keyword arguments).
KeptArguments = tuple[int, inspect.Signature, tuple, dict]


class VoidedCallError(RuntimeError):
    """A peer voided a call that this rank made (docs/PROTOCOL.md "Void
    calls"): that call's result is not valid here; the workspace is usable,
    and the next calls pair as before."""


class CallRefused(RuntimeError):
    """A call refused without any effect on the call sequence of any rank (a
    ``release()`` with no view open): the workspace is not poisoned, and every
    rank stays in step. A refusal that would leave this rank a call behind its
    peers (an open view, a second thread or stream) poisons and aborts the
    workspace instead (docs/PROTOCOL.md "Failure behaviour")."""


class CallHost(Protocol):
    """What the call owner reads of its workspace."""

    handle: int | None
    rank: int
    world_size: int
    timeout_s: float
    rows_fallback: bool
    arena: PeerArena | None
    device: torch.device

    @property
    def peer(self) -> bool: ...

    @property
    def max_rows(self) -> int: ...

    def void_placeholder(self, what: str, arguments: Mapping[str, Any],
                         rows: int | None = None) -> Callable[[], object] | None: ...


def named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by parameter name, defaults included. For a call
    whose arguments do not bind (a misspelt keyword, a missing argument), the
    ones that name a parameter: the positional ones in order, then the known
    keywords."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        params = signature.parameters
        named = {n: p.default for n, p in params.items() if p.default is not p.empty}
        positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named.update(zip(positional, args, strict=False))
        named.update((k, v) for k, v in kwargs.items() if k in params)
        return named
    bound.apply_defaults()
    return dict(bound.arguments)


def _binds(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _name(host: CallHost) -> str:
    return type(host).__name__


class CallState:
    """Everything one workspace knows about its calls, and every step of one:
    entering (one caller at a time), the path a call takes, leaving, failing
    (poison and abort), voiding, the error a peer left, the peer's exit.

    A plain class with plain attributes, so that torch.compile traces the
    steps a traced call takes (under tracing nothing is held, released or
    poisoned). The attributes are the workspace's call state:

    - ``closed``: the workspace was closed (or not created yet);
    - ``pid``: the process that is this rank (a fork's child is not);
    - ``lock``, ``caller``: the call lock and (thread id, thread name, call)
      of the call inside it;
    - ``arguments``: the call's arguments (``KeptArguments``), for its void
      placeholder;
    - ``committed``: the call took the collective path (no void call after
      that: peers may be inside its collectives); a call on the peer path is
      not committed, since a peer op's argument errors publish nothing
      (csrc/README.md "The argument contract of the peer ops");
    - ``sequence``, ``counted``: the calls of the current arena that paired
      with the peers' (either path, or void), alike on every rank: it names
      the agreement of a call over max_rows; whether the call in progress
      is counted;
    - ``void_rows``: the rows of the call's void placeholder when they are
      not the call's own (a call over max_rows on this rank only: the rows
      the peers called with), else None;
    - ``poisoned``: why, once a call failed after it was entered or a peer
      aborted;
    - ``abort_lock``: abort() against unregistration (an RLock: a signal
      handler may abort);
    - ``void_word``, ``watch``: the C++ void word (read after every call) and
      the peers' liveness watch, while the workspace has peer memory;
    - ``stream``, ``captured``: the stream of the last call, and whether one
      was captured in a CUDA graph;
    - ``logged``: the policy messages already logged.
    """

    def __init__(self, poison_on_error: bool):
        self.poison_on_error = poison_on_error
        self.closed = True  # until created
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.caller: tuple[int, str, str] | None = None
        self.arguments: KeptArguments | None = None
        self.committed = False
        self.poisoned: str | None = None
        self.abort_lock = threading.RLock()
        self.void_word: ctypes.c_uint64 | None = None
        self.watch: liveness.Watch | None = None
        self.stream: torch.cuda.Stream | None = None
        self.captured = False
        self.sequence = 0
        self.counted = False
        self.void_rows: int | None = None
        self.turn: Any = None  # the group's collective-path turn the call in progress holds (peer.collectives)
        self.logged: set[str] = set()

    def guard(self, host: CallHost, what: str, poison: bool = True) -> _Call:
        """The guard of the call ``what`` (a context manager, see ``_Call``)."""
        return _Call(self, host, what, poison)

    # -- the arena's part ----------------------------------------------------------------------

    def attach(self, void_address: int | None, watch: liveness.Watch | None) -> None:
        """A new arena (or collective mode: None, None): its void word and its
        peers' liveness watch; its calls count from 0."""
        self.void_word = None if void_address is None else ctypes.c_uint64.from_address(void_address)
        self.watch = watch
        self.sequence = 0

    # -- refusals -------------------------------------------------------------------------------

    def require_creator_process(self, host: CallHost, what: str) -> None:
        """Refuse every use from a process other than the creator's (a fork's
        child would act as its parent's rank and pair with its parent's calls)."""
        pid = os.getpid()
        if pid != self.pid:
            raise RuntimeError(
                f"torch_sdcp: {_name(host)} of rank {host.rank} belongs to process {self.pid}: {what}() "
                f"from process {pid} (a fork of it) is refused; create workspaces in the process that uses them")

    def require_open(self, host: CallHost, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"torch_sdcp: {_name(host)} on rank {host.rank} is closed: {what}() after "
                               "close(); create a new workspace")

    def refuse_poisoned(self, host: CallHost) -> None:
        """Before a collective-mode call's collective: a workspace poisoned by
        abort() enters none (its peers may not)."""
        if self.poisoned is not None:
            raise RuntimeError(self.poisoned_message(host, self.caller[2] if self.caller is not None else "call"))

    def require_ordered_stream(self, host: CallHost) -> None:
        """Calls on one workspace must be ordered: refuse a second stream while
        the first still runs a call (docs/PROTOCOL.md)."""
        if host.device.type != "cuda" or torch.compiler.is_compiling():
            return
        stream = torch.cuda.current_stream(host.device)
        capturing = torch.cuda.is_current_stream_capturing()
        self.captured = self.captured or capturing
        last = self.stream
        # A capture starts from a synchronised device (torch.cuda.graph does
        # it); querying another stream during a global capture is not allowed.
        if last is not None and last != stream and not capturing and not last.query():
            # Inside the call guard: it poisons and aborts (the call is skipped
            # on this rank only, which would pair every later call wrongly).
            raise RuntimeError(
                f"torch_sdcp: {_name(host)} on rank {host.rank} is used from stream "
                f"{stream.cuda_stream:#x} while stream {last.cuda_stream:#x} still runs an earlier call on it: "
                "calls on one workspace must be ordered; use one workspace per stream, or make this stream "
                "wait for the other (stream.wait_stream); the workspace is aborted on every rank")
        self.stream = stream

    # -- entering and leaving -------------------------------------------------------------------

    def enter(self, host: CallHost, what: str) -> bool:
        """Start a call: refuse a closed workspace, and a second thread while
        another one is inside a call (non-blocking). Returns whether the call
        lock is held (never under torch.compile tracing, which runs no call)."""
        if torch.compiler.is_compiling():  # tracing runs no call (and cannot trace os.getpid)
            self.require_open(host, what)
            return False
        self.require_creator_process(host, what)  # before the lock: a fork may have copied it held
        if not self.lock.acquire(blocking=False):
            me = threading.current_thread()
            other = self.caller
            inside = (f"thread {other[1]!r} (id {other[0]}) is inside {other[2]}()" if other is not None
                      else "another thread is inside a call")
            message = (f"torch_sdcp: {_name(host)} on rank {host.rank}: {what}() from thread {me.name!r} "
                       f"(id {me.ident}) while {inside} on this workspace: calls on one workspace must be "
                       "ordered; use one workspace per thread, or serialise the calls")
            # This rank's call sequence is no longer the peers' (this call is
            # skipped here, or the two threads' calls interleave): abort on
            # every rank, so that no rank returns a result of a mis-paired call.
            self.abort(host, message)
            raise RuntimeError(f"{message}; the workspace is aborted on every rank")
        try:
            self.require_open(host, what)  # poisoning is reported when the call ends, after its arguments
        except BaseException:
            self.lock.release()
            raise
        me = threading.current_thread()
        self.caller = (threading.get_ident(), me.name, what)
        self.committed = self.counted = False
        self.void_rows = None
        return True

    def leave(self, held: bool) -> None:
        if held:
            turn, self.turn = self.turn, None  # the group's collective-path order
            if turn is not None:
                turn.release()
            self.caller = None
            self.lock.release()

    def finish(self, host: CallHost, what: str, error: BaseException | None, held: bool, poison: bool,
               poisoned_before: bool) -> None:
        """End the call ``what`` that ``error`` (or None) ended; raises what
        the caller must see instead (``_Call`` says which)."""
        if poisoned_before and not isinstance(error, (ValueError, TypeError)):
            self.leave(held)
            raise RuntimeError(self.poisoned_message(host, what)) from error
        # An argument error before this rank published anything: a void call
        # keeps every rank in step, and nothing is poisoned (the error propagates).
        if isinstance(error, (ValueError, TypeError)) and held and poison and not poisoned_before:
            try:
                voided = self.void(host, what, error)
            except BaseException:  # Ctrl-C inside the placeholder's wait (which aborted the workspace)
                self.leave(held)
                raise
            if voided:
                self.leave(held)
                return
        # A call that met a peer's abort: the error that peer left, in this one.
        noted = None
        if type(error) is RuntimeError and held:
            text = self.with_peer_note(host, str(error))
            noted = RuntimeError(text) if text != str(error) else None
        met = None
        try:
            if error is not None and poison:
                self.fail(host, noted or error, held)
            elif error is None and held:  # a peer voided a call this rank made (this one, or before on CUDA)
                met = self.voided_error(host, what)
        finally:
            self.leave(held)
        if met is not None:
            raise met
        gone = self.watch.exited_now() if self.watch is not None and type(error) is RuntimeError else None
        if gone is not None:  # what ended the call: the peer's exit
            raise RuntimeError(f"torch_sdcp: {_name(host)} on rank {host.rank}: {what}() failed: peer "
                               f"{gone[0]} (pid {gone[1]}) exited; re-create the workspace without it") from error
        if noted is not None:
            raise noted from error

    # -- the path of a call (torch_sdcp.route decides) ------------------------------------------

    def take_path(self, host: CallHost, rows: int | None, arg: str, tag: int | None = None) -> bool:
        """The call's Python argument checks are over: True when it takes
        the peer path, False when it takes the collective path, after acting
        on why. ``rows`` None: a call bounded in bytes, not rows (the
        exchange: more bytes than its bound is an argument error of its op,
        never a reason to fall back).

        On the peer path the call stays void-able: a ``ValueError`` or
        ``TypeError`` from the peer op is raised before the op publishes
        anything (csrc/README.md "The argument contract of the peer ops"), so
        it voids like a Python-side argument error; every other error
        poisons. On the collective path the call is committed from here on:
        every error poisons (its agreement and collectives involve the peers).
        ``tag``: the call's checked call tag, compared in the agreement of a
        call over the bound as the peer path's header compares it."""
        decision = route(host, rows) if rows is not None else route_without_rows(host)
        self.count_call()
        if decision.peer:
            self.require_ordered_stream(host)
            return True
        self.committed = True
        if decision.why is Why.ROWS_OVER_BOUND:
            assert rows is not None
            self.collective_over_rows(host, rows, arg, tag)
        else:  # collective mode: its calls run collectives at once
            self.refuse_poisoned(host)
        return False

    def count_call(self) -> None:
        """The call in progress pairs with the peers' (once per call)."""
        if not self.counted:
            self.counted = True
            self.sequence += 1

    def collective_over_rows(self, host: CallHost, rows: int, arg: str, tag: int | None = None) -> None:
        """A peer workspace's call of more rows than max_rows: an error with
        rows_fallback=False; else logged once per workspace, refused when the
        workspace is poisoned (a peer's abort poisons the collective path too)
        and agreed on by every rank before any collective."""
        if not host.rows_fallback:
            raise arg_error(arg, f"at most max_rows = {host.max_rows} rows (this {_name(host)} was "
                            "created with rows_fallback=False)", rows)
        self.log_once(host, "rows-over-bound", f"{rows} rows exceed max_rows={host.max_rows}; this call and "
                      "every later call over the bound take the collective path (logged once per workspace)")
        if self.poison_on_error:
            self.health(host, "check")
        arena = host.arena
        if arena is None or host.world_size == 1 or torch.compiler.is_compiling():
            return  # no peer to agree with (under tracing, no call to agree on)
        handle = host.handle
        what = self.caller[2] if self.caller is not None else "call"
        peer_failure = functools.partial(_peer_failure, handle)
        give_up: Callable[[], str | None] = peer_failure
        view = what in VIEW_CALLS
        capturing = host.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if handle is not None and not capturing:
            # A peer within the bound takes the peer path of this call: its header lands here,
            # for this rank's next call, whose index is exact once no call of this rank runs.
            if host.device.type == "cuda":
                torch.cuda.current_stream(host.device).synchronize()
            give_up = peer_path_probe(handle, host.rank, view, peer_failure)
        try:
            # One order of these sections per group in this process (two workspaces of one group
            # on two threads), held from the agreement until the call ends (leave).
            self.turn = arena.collective_turn(f"collective{self.sequence}", host.timeout_s, give_up)
            agree_collective_path(arena, name=_name(host), rank=host.rank,
                                  max_rows=host.max_rows, timeout_s=host.timeout_s, what=what, rows=rows,
                                  index=self.sequence, peer_failure=give_up, tag=tag)
        except AgreementAbandoned as e:  # the turn's
            if not took_peer_path(e):
                raise
            self.rows_differ(host, rows, arg, view, peer_failure)
        except PeerPathTaken:
            self.rows_differ(host, rows, arg, view, peer_failure)

    def rows_differ(self, host: CallHost, rows: int, arg: str, view: bool,
                    peer_failure: Callable[[], str | None]) -> None:
        """A call of ``rows`` rows, over max_rows on this rank, whose peers (some of them) took the
        peer path of the same call with rows within the bound: no rank entered a collective, so
        the call is voided (its placeholder takes the peers' rows, every peer's call raises
        VoidedCallError naming this error) and the workspace stays usable. Raises the rows
        mismatch as this call's argument error, once the peers' rows are known (their headers
        landed here: bounded by timeout_s)."""
        assert host.handle is not None
        start = time.monotonic()
        landed = peer_rows(host.handle, host.rank, view)
        while not landed:
            failure = peer_failure()
            waited = time.monotonic() - start
            if failure is not None or waited >= host.timeout_s:
                raise RuntimeError(
                    f"torch_sdcp: {_name(host)} on rank {host.rank}: {rows} rows > max_rows = {host.max_rows} "
                    f"on this rank, and a peer took the peer path of the call, but no peer's call header came "
                    f"within {waited:.3g} s" + (f": {failure}" if failure is not None else ""))
            time.sleep(1e-3)
            landed = peer_rows(host.handle, host.rank, view)
        theirs = landed[min(landed)]
        if theirs > host.max_rows:  # no peer sends a header over the bound: the header is not this call's
            raise RuntimeError(f"torch_sdcp: {_name(host)} on rank {host.rank}: a peer's call header of "
                               f"{theirs} rows > max_rows = {host.max_rows} ({describe_peer_rows(landed)})")
        self.void_rows, self.committed = theirs, False
        raise arg_error(arg, f"{theirs} rows ({describe_peer_rows(landed)}, the peer path)",
                        f"{rows} rows (over max_rows = {host.max_rows} on this rank only): every rank must call "
                        "with the same rows; the call is void on every rank, and the workspace stays usable")

    def log_once(self, host: CallHost, key: str, message: str) -> None:
        """Log a policy decision once per workspace and ``key``."""
        if key not in self.logged:
            self.logged.add(key)
            logger.warning("torch_sdcp: %s on rank %d: %s", _name(host), host.rank, message)

    # -- health, poisoning and the peers' notes -------------------------------------------------

    def health(self, host: CallHost, what: str) -> None:
        """Raise if the workspace is poisoned on this rank, or a peer voided a
        call of this rank (``PeerWorkspace.check``)."""
        self.require_creator_process(host, what)
        self.require_open(host, what)
        if self.poisoned is None and host.handle is not None:
            try:
                torch.ops.sdcp.workspace_check(host.handle)
            except RuntimeError as e:
                self.poisoned = self.with_peer_note(host, str(e))
        if self.poisoned is not None:
            raise RuntimeError(self.poisoned_message(host, what))
        voided = self.voided_error(host, what)
        if voided is not None:
            raise voided

    def poisoned_message(self, host: CallHost, what: str) -> str:
        reason = self.poisoned or ""
        return (f"torch_sdcp: {_name(host)} on rank {host.rank} is poisoned: {what}() after a failed call "
                f"({reason}); re-create the workspace (close() it and create a new one on every rank, or resize())")

    def fail(self, host: CallHost, error: BaseException, held: bool) -> None:
        """A call raised after it was entered: poison the workspace on this
        rank and abort it on every rank, so that a peer waiting in this call
        gives up at once instead of after its timeout. A ``CallRefused``
        (a refusal with no effect on any rank's call sequence) is not a
        failure of the call."""
        if not held or not self.poison_on_error or host.handle is None or isinstance(error, CallRefused):
            return
        if self.poisoned is None:  # the first failure is the one the peers are told of
            self.poisoned = f"{type(error).__name__}: {error}"
            self.leave_note(host, f"{type(error).__name__}: {error}")
        try:
            torch.ops.sdcp.workspace_abort(host.handle)
        except Exception as e:
            logger.warning("torch_sdcp: %s on rank %d: could not abort the workspace on the peers (%s)",
                           _name(host), host.rank, e)

    def abort(self, host: CallHost, reason: str) -> None:
        """``PeerWorkspace.abort``: poison, leave the reason, abort on every rank."""
        with self.abort_lock:
            if self.closed:
                return
            if self.poisoned is None:
                self.poisoned = f"aborted on rank {host.rank}: {reason[:200]}"
            if host.handle is not None:
                self.leave_note(host, f"abort(): {reason}")
                torch.ops.sdcp.workspace_abort(host.handle)

    def peer_exited(self, host: CallHost, rank: int, pid: int) -> None:
        """The watcher thread saw peer ``rank`` exit: abort the workspace on
        every rank at once (a wait ends now, not after its timeout)."""
        with self.abort_lock:
            if self.closed or host.handle is None:
                return
            if self.poisoned is None:
                try:
                    torch.ops.sdcp.workspace_check(host.handle)
                    self.poisoned = f"peer {rank} (pid {pid}) exited"
                except RuntimeError as e:  # it failed before (maybe a peer's abort for this exit): both
                    self.poisoned = f"{e}; peer {rank} (pid {pid}) exited"
            torch.ops.sdcp.workspace_abort(host.handle)

    def close(self, host: CallHost) -> bool:
        """Mark the workspace closed (inside its close() call); True when it is
        healthy, so that its release may barrier with the peers."""
        if self.poisoned is None and host.handle is not None:
            try:
                torch.ops.sdcp.workspace_check(host.handle)
            except RuntimeError as e:
                self.poisoned = str(e)
        self.closed = True
        return self.poisoned is None

    def leave_note(self, host: CallHost, text: str) -> None:
        """Best effort, before the abort words go out: this rank's error, for
        the peers' errors (a store that is gone with a peer is no error here)."""
        if host.arena is not None:
            try:
                host.arena.post_note(text)
            except Exception as e:
                logger.info("torch_sdcp: %s on rank %d: could not leave the error for the peers (%s)",
                            _name(host), host.rank, e)

    def with_peer_note(self, host: CallHost, message: str) -> str:
        """``message`` with the error that the aborting peer it names left
        (``peer r aborted: ...`` -> ``... [rank r: ValueError: ...]``)."""
        found = _PEER_ABORTED.search(message)
        if found is None or host.arena is None:
            return message
        try:
            note = host.arena.peer_note(int(found.group(1)))
        except Exception:
            return message
        return message if note is None else f"{message} [rank {found.group(1)}: {note}]"

    # -- void calls (docs/PROTOCOL.md "Void calls") ---------------------------------------------

    def void(self, host: CallHost, what: str, error: BaseException) -> bool:
        """The call failed its argument checks before this rank published
        anything (in Python, or in its peer op): make its placeholder, marked
        void, so that every rank stays in step and the peers learn of this
        rank's error for that call only. True when done (the workspace is not
        poisoned); False to poison as before."""
        kept = self.arguments
        if (not host.peer or not self.poison_on_error or host.handle is None or kept is None
                or kept[0] != threading.get_ident() or self.committed):
            return False
        if host.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # a graph would replay the void mark
        try:
            placeholder = host.void_placeholder(what, named_arguments(*kept[1:]), rows=self.void_rows)
        except Exception:
            return False
        if placeholder is None:
            return False
        self.count_call()
        self.leave_note(host, f"{type(error).__name__}: {error}")  # before the void header goes out
        torch.ops.sdcp.workspace_void_next(host.handle, True)
        try:
            placeholder()
            if host.device.type == "cuda":  # its kernel's outcome, before this rank says it is usable
                torch.cuda.current_stream(host.device).synchronize()
            torch.ops.sdcp.workspace_check(host.handle)
        except Exception as e:
            logger.info("torch_sdcp: %s on rank %d: the void call of %s() failed (%s)",
                        _name(host), host.rank, what, e)
            return False
        finally:
            torch.ops.sdcp.workspace_void_next(host.handle, False)
        torch.ops.sdcp.workspace_take_void(host.handle)  # a peer voided it too: this rank reports its own error
        return True

    def voided_error(self, host: CallHost, what: str) -> VoidedCallError | None:
        """The error of the first void call that this rank's calls met since
        the last report (taken: reported once), or None."""
        if self.void_word is None or not self.void_word.value:
            return None
        word = int(torch.ops.sdcp.workspace_take_void(host.handle))
        if word == 0:
            return None
        src, call = (word & 0xFFFFFFFF) - 1, word >> 32
        note = None
        if host.arena is not None:
            try:
                note = host.arena.peer_note(src)
            except Exception:
                note = None
        return VoidedCallError(
            f"torch_sdcp: {_name(host)} on rank {host.rank}: {what}(): rank {src} voided call {call} "
            "(its arguments failed their checks before it sent anything, so it took part with a placeholder): "
            "that call's result is not valid on this rank; the workspace stays usable"
            + ("" if note is None else f" [rank {src}: {note}]"))


def _peer_failure(handle: int | None) -> str | None:
    """Why the peers of the workspace ``handle`` will not come (a peer aborted
    it, or exited), or None."""
    if handle is None:
        return None
    try:
        torch.ops.sdcp.workspace_check(handle)
    except RuntimeError as e:
        return str(e)
    return None


class _Call:
    """One call on a workspace, the guard of every public call method:
    ``with self._call("merge"): ...``. Entering starts the call
    (``CallState.enter``: refuses a closed workspace and a second thread; a
    poisoned one raises when the call ends, unless its arguments were wrong,
    so that every rank reports its own argument error before a peer's abort);
    leaving ends it (``CallState.finish``): an argument error found before
    this rank published anything (Python checks, or the peer op's own) makes
    it a void call (its placeholder keeps every rank
    in step, nothing is poisoned); any other error poisons and aborts, unless
    ``poison`` is False, as for resize and close, which release a poisoned
    workspace; a call without one raises the void that a peer's call met
    here, if any. A plain class, so that torch.compile traces it."""

    __slots__ = ("calls", "held", "host", "poison", "poisoned_before", "what")

    def __init__(self, calls: CallState, host: CallHost, what: str, poison: bool):
        self.calls, self.host, self.what, self.poison = calls, host, what, poison
        self.held = self.poisoned_before = False

    def __enter__(self) -> None:
        calls = self.calls
        self.held = calls.enter(self.host, self.what)
        # Poisoned before the call: the call checks its arguments (each rank
        # reports its own bad argument first, not a peer's abort), then raises
        # "poisoned" (the ops check health after their arguments).
        self.poisoned_before = self.held and calls.poisoned is not None and self.what not in ("resize", "close")

    def __exit__(self, exc_type, error, traceback) -> None:
        self.calls.finish(self.host, self.what, error, self.held, self.poison, self.poisoned_before)


_W = TypeVar("_W")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def call_method(fn: Callable[Concatenate[_W, _P], _R]) -> Callable[Concatenate[_W, _P], _R]:
    """A public call method: its arguments are kept for the call's guard (a
    void call's placeholder gets them by name, ``named_arguments``), and a
    call whose arguments cannot bind (a misspelt keyword, a missing argument)
    fails like any other argument error inside the call: its TypeError is
    raised in the guard, instead of this rank silently staying a call behind
    its peers (which would pair every later call wrongly). The arguments are
    named only when a placeholder needs them: binding every call would cost
    more than the rest of the guard."""
    what = fn.__name__
    full = inspect.signature(fn)
    signature = full.replace(parameters=list(full.parameters.values())[1:])  # without self

    @functools.wraps(fn)
    def method(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():  # traced: nothing to pair
            return fn(self, *args, **kwargs)
        calls: CallState = self._calls
        calls.arguments = (threading.get_ident(), signature, args, kwargs)
        try:
            return fn(self, *args, **kwargs)
        except TypeError as e:
            if _binds(signature, args, kwargs):
                raise  # raised inside the method, by its own guard
            with calls.guard(self, what):  # the binding failed here, before the method ran
                raise TypeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {e}") from None
        finally:
            calls.arguments = None

    return method
