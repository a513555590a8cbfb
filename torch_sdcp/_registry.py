"""Process-local registry of live workspaces, by integer handle. The C++ side
keeps the mapping; this side answers what fake implementations and wrappers
need to know (world size) without touching device memory.

The registry holds its workspaces weakly: a workspace that is dropped without
``close()`` is garbage-collected, and its finalizer (torch_sdcp.workspaces.base)
unregisters it and releases its memory locally."""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

from torch_sdcp._checks import arg_error

_lock = threading.Lock()
_handles = itertools.count(1)
_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def new_handle() -> int:
    with _lock:
        return next(_handles)


def add(handle: int, workspace: Any) -> None:
    with _lock:
        _live[handle] = workspace


def remove(handle: int) -> None:
    with _lock:
        _live.pop(handle, None)


def handles() -> list[int]:
    """The handles of the workspaces alive in this process, ascending."""
    with _lock:
        return sorted(_live.keys())


def get(handle: int) -> Any:
    with _lock:
        ws = _live.get(handle)
    if ws is None:
        raise arg_error("workspace", "a live workspace handle", f"{handle} (never created, or already closed)")
    return ws


def world_size(handle: int) -> int:
    return get(handle).world_size
