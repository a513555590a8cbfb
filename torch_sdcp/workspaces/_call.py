"""The owner of a workspace's calls (``CallState``): entering, the path,
leaving, failing, poisoning, and the refusals that leave a workspace usable
(the guard of a public call method: ``_guard``; a void call: ``_void``; the
agreement of a call over max_rows: ``_collective_path``).

The call owner reads its workspace through ``CallHost`` only: public members
and the family's ``void_placeholder`` hook. It holds no reference to the
workspace (a dropped workspace is released at once, not by the cycle
collector): the workspace passes itself to every step that needs it."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torch_sdcp._checks import arg_error
from torch_sdcp.families import WorkspaceKind
from torch_sdcp.route import Why, route, route_without_rows
from torch_sdcp.workspaces._collective_path import VOID_CLAIM, VOID_FAILED, agree_over_rows, peer_in_a_call
from torch_sdcp.workspaces._host import CallHost, KeptArguments
from torch_sdcp.workspaces._notes import leave_note, with_peer_note
from torch_sdcp.workspaces._void import void_call, voided_error

if TYPE_CHECKING:
    from torch_sdcp.peer import liveness
    from torch_sdcp.peer.group_order import Turn

logger = logging.getLogger("torch_sdcp")


class CallRefused(RuntimeError):
    """A call refused without any effect on the call sequence of any rank (a
    ``release()`` with no view open): the workspace is not poisoned, and every
    rank stays in step. A refusal that would leave this rank a call behind its
    peers (an open view, a second thread or stream) poisons and aborts the
    workspace instead (docs/PROTOCOL.md "Failure behaviour")."""


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
        self.turn: Any = None  # the group's collective-path turn the call in progress holds (peer.group_order)
        self.logged: set[str] = set()

    # -- the arena's part (the workspace's lifecycle: base.py) ------------------------------------

    def attach(self, void_address: int | None, watch: liveness.Watch | None) -> None:
        """A new arena (or collective mode: None, None): its void word and its
        peers' liveness watch; its calls count from 0."""
        self.void_word = None if void_address is None else ctypes.c_uint64.from_address(void_address)
        self.watch = watch
        self.sequence = 0

    def open(self) -> None:
        """Creation is over: calls are accepted."""
        self.closed = False

    def recreated(self) -> None:
        """resize() replaced the arena: a poisoned workspace is healthy again."""
        self.poisoned = None

    def take_watch(self) -> liveness.Watch | None:
        """The peers' liveness watch, which this state no longer holds (the caller cancels it, or a
        forked child drops its parent's)."""
        watch, self.watch = self.watch, None
        return watch

    def detach(self, unregister: Callable[[], None]) -> None:
        """``unregister()`` the arena's C++ workspace, with no abort() storing into its memory
        meanwhile; its void word goes with it."""
        with self.abort_lock:
            self.void_word = None
            unregister()

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
                voided = void_call(self, host, what, error)
            except BaseException:  # Ctrl-C inside the placeholder's wait (which aborted the workspace)
                self.leave(held)
                raise
            if voided:
                self.leave(held)
                return
        # A call that met a peer's abort: the error that peer left, in this one.
        noted = None
        if type(error) is RuntimeError and held:
            text = with_peer_note(host, str(error))
            noted = RuntimeError(text) if text != str(error) else None
        met = None
        try:
            if error is not None and poison:
                self.fail(host, noted or error, held)
            elif error is None and held:  # a peer voided a call this rank made (this one, or before on CUDA)
                met = voided_error(host, what, self.void_word)
        finally:
            self.leave(held)
        if met is not None:
            raise met
        if isinstance(error, ValueError) and self.poisoned is not None and VOID_CLAIM in str(error):
            raise ValueError(str(error).replace(VOID_CLAIM, VOID_FAILED)) from error  # no void: tell the truth
        gone = self.watch.exited_now() if self.watch is not None and type(error) is RuntimeError else None
        if gone is not None:  # what ended the call: the peer's exit
            raise RuntimeError(f"torch_sdcp: {_name(host)} on rank {host.rank}: {what}() failed: peer "
                               f"{gone[0]} (pid {gone[1]}) exited; re-create the workspace without it") from error
        if noted is not None:
            raise noted from error

    # -- the path of a call (torch_sdcp.route decides) ------------------------------------------

    def take_path(self, host: CallHost, rows: int | None, arg: str, tag: int | None = None,
                  header: str = "") -> bool:
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
            self.collective_over_rows(host, rows, arg, tag, header)
        else:  # collective mode: its calls run collectives at once
            self.refuse_poisoned(host)
        return False

    def count_call(self) -> None:
        """The call in progress pairs with the peers' (once per call)."""
        if not self.counted:
            self.counted = True
            self.sequence += 1

    def collective_over_rows(self, host: CallHost, rows: int, arg: str, tag: int | None = None,
                             header: str = "") -> None:
        """A peer workspace's call of more rows than max_rows: an error with
        rows_fallback=False; else logged once per workspace, refused when the
        workspace is poisoned (a peer's abort poisons the collective path too)
        and agreed on by every rank before any collective (``agree_over_rows``:
        a call whose peers took the peer path is voided with their rows)."""
        if not host.rows_fallback:
            raise arg_error(arg, f"at most max_rows = {host.max_rows} rows (this {_name(host)} was "
                            "created with rows_fallback=False)", rows)
        self.log_once(host, "rows-over-bound", f"{rows} rows exceed max_rows={host.max_rows}; this call and "
                      "every later call over the bound take the collective path (logged once per workspace)")
        if self.poison_on_error:
            self.health(host, "check")
        what = self.caller[2] if self.caller is not None else "call"
        differ = agree_over_rows(host, _name(host), what, rows, arg, self.sequence, tag, header, self.hold_turn)
        if differ is not None:
            self.void_rows, self.committed = differ.peer_rows, False
            raise differ.error

    def hold_turn(self, turn: Turn) -> None:
        """The group's collective-path turn of the call in progress, released when the call ends."""
        self.turn = turn

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
                self.poisoned = with_peer_note(host, str(e))
        if self.poisoned is not None:
            raise RuntimeError(self.poisoned_message(host, what))
        voided = voided_error(host, what, self.void_word)
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
            leave_note(host, f"{type(error).__name__}: {error}")
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
                leave_note(host, f"abort(): {reason}")
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

    def tell_left(self, host: CallHost, note: str) -> None:
        """This rank leaves the workspace (close, resize) with every call of it over: a peer whose
        call header of a call that this rank will not make has landed here is inside that call,
        waiting for this rank. Then leave ``note`` for it and abort the workspace on every rank: its
        call fails at once naming this rank's leaving, not after timeout_s. A peer that is not in a
        call is left alone (it may still check() or release() before it closes)."""
        with self.abort_lock:
            if self.poisoned is not None or host.handle is None:
                return
            try:
                torch.ops.sdcp.workspace_check(host.handle)
            except RuntimeError:
                return  # a failure of this rank or a peer's abort: the peers were told
            if not peer_in_a_call(host.handle, host.rank, getattr(host, "kind", None) == WorkspaceKind.QUERY):
                return
            leave_note(host, note)
            torch.ops.sdcp.workspace_abort(host.handle)
