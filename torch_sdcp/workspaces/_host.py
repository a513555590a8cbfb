"""What the parts of a call see of each other, as protocols: ``CallHost``
(what the call owner reads of its workspace) and ``CallSteps`` (what the
guard of a call and a void call use of the call owner, ``_call.CallState``),
so that the guard (``_guard``), void calls (``_void``) and the peer notes
(``_notes``) import this module, not the call owner that imports them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch_sdcp.peer import PeerArena

#: A call's arguments as ``call_method`` keeps them: (thread id, the method's
#: signature without ``self``, positional arguments, keyword arguments).
KeptArguments = tuple[int, inspect.Signature, tuple, dict]


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


class CallSteps(Protocol):
    """What the guard of a call and a void call use of the call owner."""

    arguments: KeptArguments | None
    poisoned: str | None
    committed: bool
    poison_on_error: bool
    void_rows: int | None

    def enter(self, host: CallHost, what: str) -> bool: ...

    def finish(self, host: CallHost, what: str, error: BaseException | None, held: bool, poison: bool,
               poisoned_before: bool) -> None: ...

    def count_call(self) -> None: ...
