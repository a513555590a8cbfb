"""What outlives a workspace's calls: the result of one creation, the
finalizer of a workspace dropped without close(), the fork handler that makes
a child forget its parent's workspaces, and the liveness watcher's report of
a peer's exit."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import NamedTuple

import torch

from torch_sdcp import _registry
from torch_sdcp.peer import PeerArena, liveness
from torch_sdcp.peer.lifetime import interrupts_kept
from torch_sdcp.workspaces._layout import WorkspaceLayout

logger = logging.getLogger("torch_sdcp")


class _Built(NamedTuple):
    """What one creation produced (collective mode: arena and handle None)."""

    params: list
    layout: WorkspaceLayout
    arena: PeerArena | None
    handle: int | None
    device: torch.device


def _release_dropped(name: str, rank: int, handle: int, arena: PeerArena, watch: liveness.Watch) -> None:
    """Finalizer of a workspace garbage-collected without close(): local only
    (no collective from a finalizer or at interpreter exit); a Ctrl-C that
    arrives meanwhile is delivered again, not lost in the finalizer."""
    with interrupts_kept():
        _release_dropped_steps(name, rank, handle, arena, watch)


def _release_dropped_steps(name: str, rank: int, handle: int, arena: PeerArena, watch: liveness.Watch) -> None:
    watch.cancel()
    with contextlib.suppress(Exception):  # the peers fail at once naming this rank ("left")
        try:
            torch.ops.sdcp.workspace_check(handle)
        except RuntimeError:
            pass  # failed before: the peers were told (this rank's note of that failure stays)
        else:
            arena.post_note(f"left: its {name} was dropped without close() (garbage-collected) in pid "
                            f"{os.getpid()}")
        torch.ops.sdcp.workspace_abort(handle)
    with contextlib.suppress(Exception):  # interpreter exit: the library may be gone
        torch.ops.sdcp.workspace_unregister(handle)
    _registry.remove(handle)
    with contextlib.suppress(Exception):
        arena.close(barrier=False)
    with contextlib.suppress(Exception):
        logger.info("torch_sdcp: %s on rank %d: dropped without close(); released locally", name, rank)


# Every workspace with memory of its own, for the fork handler (a set of its own:
# the registry's lock may be held by a thread that the fork did not copy).
_owned: weakref.WeakSet = weakref.WeakSet()


def _forget_inherited() -> None:
    """In a forked child: the parent's workspaces are dead here (every entry
    refuses another process). Nothing is released: the mappings and the
    descriptors belong to the parent's rank, and CUDA does not survive a fork;
    they go with the child."""
    for ws in list(_owned):
        ws._forget_inherited()
    _owned.clear()


os.register_at_fork(after_in_child=_forget_inherited)


def _tell_exited(ref: weakref.ref, rank: int, pid: int) -> None:
    ws = ref()
    if ws is not None:
        ws._peer_exited(rank, pid)
