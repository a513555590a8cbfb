"""The interface every memory backend of :class:`~torch_sdcp.peer.PeerArena` implements.

``PeerArena`` runs one creation sequence for every backend and agrees over the group after each
step, so a step that fails on one rank fails on all of them:

1. plan: ``local_plan()`` on every rank; the infos are gathered and ``plans_error()`` decides,
   identically on every rank, whether the backend can serve the group;
2. allocate: ``allocate(stride)``, then ``export_fd()`` gives the descriptor the peers import;
3. (the arena exchanges the descriptors)
4. map: ``map_peers(fds)`` maps every rank's memory at ``base + r * stride`` and zeroes ours;
5. probe: (the arena writes and verifies through the views) ``check_peer_access(infos)``.

``release()`` frees whatever the steps so far set up. A new backend is one new module with a
subclass, listed in ``plan.BACKENDS``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .lifetime import _interpreter_exiting

logger = logging.getLogger("torch_sdcp")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class MemoryBackend:
    """One rank's memory of one arena, and this process's mapping of every rank's memory."""

    name: ClassVar[str]         # the value of PeerArena(backend=...)
    label: ClassVar[str]        # how log messages name it
    device_type: ClassVar[str]  # type of the local device of the views

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stride = 0
        self.base = 0     # address of rank 0's region in this process, once mapped
        self.own_fd = -1  # the exported descriptor, closed once every peer has imported it
        self._released = False
        self._lock = threading.Lock()

    # -- choice of the backend (before anything is allocated) --------------------------------

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ValueError if `device` cannot be the local device of an explicit request."""

    @classmethod
    def wanted_for_auto(cls, device: torch.device | None) -> bool:
        """Whether backend "auto" should plan this backend for `device`."""
        return True

    @classmethod
    def plans_error(cls, infos: list[dict[str, Any]],
                    allow_shared_device: bool) -> Exception | None:
        """The error that rules this backend out for the gathered `infos` (one per rank), or
        None. Runs on identical data on every rank."""
        return None

    def local_plan(self, nbytes_per_rank: int, device: torch.device | None) -> dict[str, Any]:
        """Check that this rank can use the backend; return what the peers need to know (picklable),
        at least "stride": nbytes_per_rank rounded up to the allocation granularity."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Local device of the views (valid after local_plan)."""
        raise NotImplementedError

    # -- creation steps -------------------------------------------------------------------------

    def allocate(self, stride: int) -> None:
        """Allocate `stride` bytes owned by this rank."""
        raise NotImplementedError

    def export_fd(self) -> int:
        """A descriptor of our allocation for the peers to import; kept in own_fd."""
        raise NotImplementedError

    def map_peers(self, fds: dict[int, int]) -> int:
        """Map the memory of every rank r (fds[r]; ours included) at base + r * stride of one
        reserved range, zero our region and wait for it. Returns base."""
        raise NotImplementedError

    def check_peer_access(self, infos: list[dict[str, Any]]) -> bool | None:
        """Capability checks after the write-and-verify probe; raise if a peer is unusable.
        Returns whether every peer supports native atomics (None: unknown)."""
        return True

    def synchronize(self) -> None:
        """Wait for the work in flight on the local device."""

    # -- release ------------------------------------------------------------------------------

    def close_own_fd(self) -> None:
        if self.own_fd >= 0:
            fd, self.own_fd = self.own_fd, -1
            os.close(fd)

    def release(self) -> None:
        """Free everything the steps so far set up. Idempotent; failures are logged, not raised
        (it runs from destructors and after failed creations)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        quiet = _interpreter_exiting()

        def attempt(what: str, fn: Callable, *args):
            try:
                return fn(*args)
            except BaseException as e:
                with contextlib.suppress(BaseException):  # logging itself may be torn down at interpreter exit
                    (logger.debug if quiet else logger.warning)(
                        "torch_sdcp: PeerArena rank %d: %s failed during release: %s",
                        self.rank, what, e)
                return None

        self._release_memory(attempt)
        attempt("close", self.close_own_fd)

    def _release_memory(self, attempt: Callable) -> None:
        """Unmap and free, each call through attempt(what, fn, *args)."""
        raise NotImplementedError
