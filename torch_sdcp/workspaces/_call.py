"""The call guard of every public workspace method (``with self._call(what)``)
and the refusal that leaves a workspace usable."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Callable, Concatenate, ParamSpec, TypeVar

import torch

if TYPE_CHECKING:
    from torch_sdcp.workspaces.base import PeerWorkspace

_W = TypeVar("_W", bound="PeerWorkspace")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class VoidedCallError(RuntimeError):
    """A peer voided a call that this rank made (docs/PROTOCOL.md "Void
    calls"): that call's result is not valid here; the workspace is usable,
    and the next calls pair as before."""


class CallRefused(RuntimeError):
    """A call refused before it touched the workspace (the ordering rules, an
    open view): the workspace is not poisoned."""


class _Call:
    """One call on a workspace, the guard of every public call method:
    ``with self._call("merge"): ...``. Entering starts the call (``_enter``:
    refuses a closed workspace and a second thread; a poisoned one raises when
    the call ends, unless its arguments were wrong, so that every rank reports
    its own argument error before a peer's abort); leaving with an argument
    error found before the call reached its op makes it a void call
    (``_void_call``: its placeholder keeps every rank in step, nothing is
    poisoned); leaving with any other error records the failure (``_failed``:
    poisons and aborts, unless ``poison`` is False, as for resize and close,
    which release a poisoned workspace); leaving without one raises the void
    that a peer's call met here, if any (``_voided_error``); and leaving
    always ends the call (``_leave``). A plain class,
    so that torch.compile traces it (under tracing nothing is held, released
    or poisoned)."""

    __slots__ = ("held", "poison", "poisoned", "what", "workspace")

    def __init__(self, workspace: PeerWorkspace, what: str, poison: bool):
        self.workspace, self.what, self.poison, self.held, self.poisoned = workspace, what, poison, False, False

    def __enter__(self) -> None:
        self.held = self.workspace._enter(self.what)
        # Poisoned before the call: the call checks its arguments (each rank
        # reports its own bad argument first, not a peer's abort), then raises
        # "poisoned" (the ops check health after their arguments).
        self.poisoned = self.held and self.workspace._poisoned is not None and self.what not in ("resize", "close")

    def __exit__(self, exc_type, error, traceback) -> None:
        ws = self.workspace
        if self.poisoned and not isinstance(error, (ValueError, TypeError)):
            ws._leave(self.held)
            raise RuntimeError(ws._poisoned_message(self.what)) from error
        # An argument error before the call reached its op: a void call keeps
        # every rank in step, and nothing is poisoned (the error propagates).
        if isinstance(error, (ValueError, TypeError)) and self.held and self.poison and not self.poisoned:
            try:
                voided = ws._void_call(self.what, error)
            except BaseException:  # Ctrl-C inside the placeholder's wait (which aborted the workspace)
                ws._leave(self.held)
                raise
            if voided:
                ws._leave(self.held)
                return
        # A call that met a peer's abort: the error that peer left, in this one.
        noted = None
        if type(error) is RuntimeError and self.held:
            text = ws._with_peer_note(str(error))
            noted = RuntimeError(text) if text != str(error) else None
        met = None
        try:
            if error is not None and self.poison:
                ws._failed(noted or error, self.held)
            elif error is None and self.held:  # a peer voided a call this rank made (this one, or before on CUDA)
                met = ws._voided_error(self.what)
        finally:
            ws._leave(self.held)
        if met is not None:
            raise met
        gone = ws._watch.exited_now() if ws._watch is not None and type(error) is RuntimeError else None
        if gone is not None:  # what ended the call: the peer's exit
            raise RuntimeError(f"torch_sdcp: {type(ws).__name__} on rank {ws.rank}: {self.what}() failed: peer "
                               f"{gone[0]} (pid {gone[1]}) exited; re-create the workspace without it") from error
        if noted is not None:
            raise noted from error


def call_method(fn: Callable[Concatenate[_W, _P], _R]) -> Callable[Concatenate[_W, _P], _R]:
    """A public call method: its arguments are kept for the call's guard
    (a void call's placeholder is built from them), and a call whose
    arguments cannot bind (a misspelt keyword, a missing argument) fails like
    any other argument error inside the call: its TypeError is raised in the
    guard, instead of this rank silently staying a call behind its peers
    (which would pair every later call wrongly)."""
    what = fn.__name__

    @functools.wraps(fn)
    def method(self: _W, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():  # traced: nothing to pair
            return fn(self, *args, **kwargs)
        self._call_args = (threading.get_ident(), args, kwargs)
        try:
            return fn(self, *args, **kwargs)
        except TypeError as e:
            if e.__traceback__ is None or e.__traceback__.tb_next is not None:
                raise  # raised inside the method, by its own guard
            with self._call(what):  # the binding failed here, before the method ran
                raise TypeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {e}") from None
        finally:
            self._call_args = None

    return method
