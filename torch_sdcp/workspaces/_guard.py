"""The guard of a workspace's public call methods: ``call_method`` keeps a
call's arguments (a void call's placeholder gets them by name,
``named_arguments``) and turns a call whose arguments cannot bind into an
argument error inside the call; ``_Call`` (``with self._call(what)``) starts
and ends the call on its ``CallState``."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

if TYPE_CHECKING:
    from torch_sdcp.workspaces._host import CallHost, CallSteps


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

    def __init__(self, calls: CallSteps, host: CallHost, what: str, poison: bool):
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
        calls: CallSteps = self._calls
        calls.arguments = (threading.get_ident(), signature, args, kwargs)
        try:
            return fn(self, *args, **kwargs)
        except TypeError as e:
            if _binds(signature, args, kwargs):
                raise  # raised inside the method, by its own guard
            with _Call(calls, self, what, True):  # the binding failed here, before the method ran
                raise TypeError(f"torch_sdcp: {type(self).__name__} on rank {self.rank}: {e}") from None
        finally:
            calls.arguments = None

    return method
