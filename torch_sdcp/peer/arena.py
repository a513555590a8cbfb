"""PeerArena: every rank's memory mapped rank-major into every rank, and views over it.

Creation is collective and every failure is collective (see agreements._Agreement: every step
agreed on the group's c10d store, never a collective of its backend); the memory itself comes from
a backend (backend.MemoryBackend). The view lifetime policy is described in
docs/DESIGN.md, section "Peer-addressable objects": in short, views hold a reference on the
mapping, close() is idempotent and collective only outside destructors and interpreter exit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .agreements import _Agreement, _hook, out_of_step, peers_exited
from .backend import MemoryBackend
from .dlpack import _byte_tensor
from .fd_exchange import _exchange_fds, _ExchangeSocket
from .group_order import Turn
from .groups import (
    GroupOutOfStepError,
    check_group,
    forget_arena,
    group_order,
    group_store,
    is_refused,
    next_arena_number,
    refuse_group,
    remember_pids,
)
from .lifetime import _interpreter_exiting, _Mapping, interrupts_kept
from .plan import local_plan, verdict
from .probe import probe_mapping
from .replacing import ReplacingPeers, publish_replacing, ranks_at, unpublish_replacing
from .store_sync import AgreementAbandoned, StoreSync, peek
from .views import contiguous_strides, view_geometry

__all__ = ["PeerArena"]

logger = logging.getLogger("torch_sdcp")


class PeerArena:
    """nbytes_per_rank of memory owned by each rank, mapped into every rank of the group at
    base + r * stride (one contiguous virtual range, rank-major).

    Args:
        group: the process group (None: the default group). Must be initialised; creation is
            collective over it.
        nbytes_per_rank: bytes each rank owns (> 0). Identical on every rank.
        backend: "cuda", "host" or "auto" ("cuda" when every rank has CUDA and the ranks are on
            distinct GPUs, or share GPUs with allow_shared_device=True; "host" otherwise).
        device: cuda: the local GPU (default torch.device("cuda", torch.cuda.current_device())).
            host: None or cpu.
        allow_shared_device: cuda: explicit opt-in for several ranks on one GPU (correct but slow;
            docs/DESIGN.md section 6).
        timeout_s: bound on every blocking step of creation, barrier() and close(). A step or
            barrier that times out makes this process refuse the group for torch_sdcp's use
            (GroupOutOfStepError, "re-create the process group"); nothing is left in flight.
        agree: values that must be equal on every rank ({name: value}, e.g. the parameters of
            the workspace built on the arena); creation raises RankMismatchError on every rank,
            naming each value that differs and every rank's value, before anything is allocated.
        watch: called while creation waits for the peers (at most every 20 ms; a resize tells a
            peer inside a call of the workspace being replaced that this rank left it).
        replacing: the ``store_prefix`` of the arena this one replaces (a resize): a peer that
            closes that arena meanwhile fails this creation at once (peer/replacing.py).

    Attributes: rank, world_size, backend ("cuda" | "host"), device (local device of the views;
    cpu for host), stride (bytes between ranks' regions: nbytes_per_rank rounded up to the CUDA
    recommended allocation granularity, or the page size for host), nbytes_per_rank,
    base_address (address of rank 0's region in this process), native_peer_atomics (cuda: True if
    every rank's GPU has native atomics to every peer GPU, None if unknown; host: True), closed,
    timeout_s.

    View lifetime: docs/DESIGN.md, section "Peer-addressable objects".
    """

    def __init__(self, group: dist.ProcessGroup | None, nbytes_per_rank: int, *,
                 backend: str = "auto", device: torch.device | None = None,
                 allow_shared_device: bool = False, timeout_s: float = 60.0,
                 agree: dict[str, Any] | None = None, watch: Callable[[], None] | None = None,
                 replacing: str | None = None) -> None:
        self._closed = True  # until creation completes; guards __del__ and close()
        self._mapping: _Mapping | None = None
        self._base_u8: torch.Tensor | None = None
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch_sdcp: PeerArena needs an initialised torch.distributed "
                               "process group (call torch.distributed.init_process_group first)")
        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("torch_sdcp: argument 'group': expected a group this process is a "
                             "member of, got one it is not in")
        self._group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.nbytes_per_rank = nbytes_per_rank
        self.backend = ""
        self.device = torch.device("cpu")
        self.stride = 0
        self.base_address = 0
        self.peer_pids: dict[int, int] = {}  # rank -> pid of every other rank, once created
        self.native_peer_atomics: bool | None = None
        try:
            self.timeout_s = float(timeout_s)
        except (TypeError, ValueError):
            self.timeout_s = 60.0
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            self.timeout_s = 60.0  # the bound of the agreement that reports the bad value on every rank
        self._agree = dict(agree or {})
        self._watch, self._replacing = watch, replacing
        self._barriers = 0
        self._agreements: StoreSync | None = None
        check_group(group, "PeerArena creation")
        self._number = next_arena_number(group)  # the same on every rank: creations on a group are collective
        self._agreements = StoreSync(group_store(group), rank, self.world_size, f"sdcp/arena{self._number}")
        self._create(nbytes_per_rank, backend, device, bool(allow_shared_device), timeout_s)

    # ---------------------------------------------------------------------------------------
    # creation: one sequence for every backend, each step followed by an agreement
    # ---------------------------------------------------------------------------------------

    def _step(self, steps: _Agreement, stage: str, action: Callable[[], Any]) -> list:
        """This rank's part of creation step `stage`, then the agreement on it: every rank raises
        the same error if any rank failed. Returns every rank's result of `action`."""
        err = result = None
        try:
            _hook(stage)
            result = action()
        except Exception as e:
            err = e
        except BaseException as e:  # Ctrl-C inside the step: the peers fail at once, the group is refused
            steps.interrupt(stage, e)
            raise
        return steps.agree(stage, err, result)

    def _create(self, nbytes_per_rank, backend, device, allow_shared_device, timeout_s) -> None:
        N, me = self.world_size, self.rank
        assert self._agreements is not None
        steps = _Agreement(self._group, self._agreements, self.timeout_s, self._watch)
        candidates: dict[str, MemoryBackend] = {}
        sock = _ExchangeSocket()
        received: dict[int, int] = {}
        try:
            # 1. validate locally, publish the plan, check it on the gathered plans
            def validate():
                plan = local_plan(me, N, nbytes_per_rank, backend, device, allow_shared_device,
                                  timeout_s, candidates)
                plan["agree"] = self._agree
                if N > 1:
                    plan["socket"] = sock.open()
                return plan

            steps.publish_pid()  # before any wait: a rank killed in 'validate' is found by its exit
            publish_replacing(self._agreements, self._number, self._replacing)
            try:
                plans = self._step(steps, "validate", validate)
            finally:
                steps.unpublish_pid()
                unpublish_replacing(self._agreements, self._number, self._replacing)
            self.peer_pids = steps.peer_pids = {r: p["pid"] for r, p in enumerate(plans) if r != me}
            remember_pids(self._group, self.peer_pids)
            self.backend, self.stride = verdict(plans)
            mem = candidates[self.backend]
            for other in candidates.values():
                if other is not mem:
                    other.release()  # "auto" may have set up others
            infos = [p["backends"][self.backend] for p in plans]
            self.device = mem.device
            m = _Mapping(mem)

            # 2. allocate and export
            def allocate():
                mem.allocate(self.stride)
                mem.export_fd()

            self._step(steps, "allocate", allocate)

            # 3. exchange descriptors; the sockets and their directory go as soon as it is over
            def exchange():
                try:
                    if N > 1:
                        received.update(_exchange_fds(
                            sock.listener, mem.own_fd, me, N, self.stride,
                            [p["pid"] for p in plans], [p["socket"] for p in plans],
                            os.getuid(), self.timeout_s))
                finally:
                    sock.close()

            self._step(steps, "exchange", exchange)

            # 4. map every rank's memory, zero ours, synchronise; the agreement is the barrier
            def map_every_rank():
                try:
                    self.base_address = mem.map_peers({**received, me: mem.own_fd})
                    self._base_u8 = _byte_tensor(self.base_address, N * self.stride,
                                                 self.device, m)
                finally:
                    for f in received.values():
                        os.close(f)
                    received.clear()
                    # host: the mapping keeps the memfd alive; cuda: every peer has imported
                    # the exported fd, and we map our own allocation handle
                    mem.close_own_fd()

            self._step(steps, "map", map_every_rank)

            # 5. capability gate: write-and-verify probe through the mapping
            self.native_peer_atomics = probe_mapping(self, steps, mem, infos)
        except BaseException:
            self._base_u8 = None
            sock.close()
            for f in received.values():
                with contextlib.suppress(OSError):
                    os.close(f)
            for b in candidates.values():
                b.release()
            raise
        m.ref()  # the arena's reference
        self._mapping = m
        self._closed = False

    def _mapped_bytes(self) -> torch.Tensor:
        """Every rank's region as one byte tensor (open arenas only: views check that first)."""
        if self._base_u8 is None:
            raise RuntimeError(f"torch_sdcp: PeerArena rank {self.rank} has no mapping (closed)")
        return self._base_u8

    def _raw_words(self, r: int, offset: int, count: int) -> torch.Tensor:
        start = r * self.stride + offset
        return self._mapped_bytes()[start:start + 8 * count].view(torch.int64)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def store_prefix(self) -> str:
        """Where this arena's agreements live on the group's store (``replacing`` of a resize)."""
        assert self._agreements is not None
        return self._agreements.prefix

    def peers_closing(self) -> list[int]:
        """The peers that came to this arena's close barrier (a resize that failed against them closes too)."""
        return [] if self._agreements is None else ranks_at(self._agreements, "close")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"torch_sdcp: PeerArena.{what}: the arena is closed")

    def _check_rank(self, rank, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"torch_sdcp: argument 'rank' of PeerArena.{what}: expected an int "
                             f"in [0, {self.world_size}), got {rank!r}")
        return rank

    def address(self, rank: int) -> int:
        """Address of rank `rank`'s region in this process: base_address + rank * stride."""
        self._check_open("address")
        return self.base_address + self._check_rank(rank, "address") * self.stride

    def _region_view(self, rank: int, what: str, dtype, shape, offset) -> torch.Tensor:
        dtype, shape, offset = view_geometry(self.nbytes_per_rank, what, dtype, shape, offset)
        itemsize = dtype.itemsize
        full = self._mapped_bytes().view(dtype)
        return full.as_strided(shape, contiguous_strides(shape),
                               (rank * self.stride + offset) // itemsize)

    def local_view(self, dtype: torch.dtype = torch.uint8, shape=None, offset: int = 0) -> torch.Tensor:
        """View of this rank's region: `shape` elements of `dtype` from byte `offset` (shape None:
        the rest of the region, flat). Device: self.device."""
        self._check_open("local_view")
        return self._region_view(self.rank, "local_view", dtype, shape, offset)

    def peer_view(self, rank: int, dtype: torch.dtype = torch.uint8, shape=None,
                  offset: int = 0) -> torch.Tensor:
        """View of rank `rank`'s region through the mapping, on the local device."""
        self._check_open("peer_view")
        return self._region_view(self._check_rank(rank, "peer_view"), "peer_view", dtype, shape,
                                 offset)

    def rank_major_view(self, dtype: torch.dtype = torch.uint8, shape=None,
                        offset: int = 0) -> torch.Tensor:
        """[world_size, *shape] view covering every rank; stride(0) == self.stride // itemsize."""
        self._check_open("rank_major_view")
        dtype, shape, offset = view_geometry(self.nbytes_per_rank, "rank_major_view", dtype, shape, offset)
        itemsize = dtype.itemsize
        full = self._mapped_bytes().view(dtype)
        return full.as_strided((self.world_size,) + shape,
                               (self.stride // itemsize,) + contiguous_strides(shape),
                               offset // itemsize)

    def post_note(self, text: str) -> None:
        """Leave this rank's error message (at most 200 characters) on the group's store, where
        a peer that meets this rank's abort word finds it (one key per aborting rank)."""
        if self._agreements is not None:
            self._agreements.store.set(f"{self._agreements.prefix}/note/{self.rank}", text[:200])

    def peer_note(self, rank: int) -> str | None:
        """The message rank ``rank`` left with :meth:`post_note`, or None; never waits."""
        if self._agreements is None:
            return None
        note = peek(self._agreements.store, f"{self._agreements.prefix}/note/{rank}")
        return None if note is None else note.decode(errors="replace")

    def barrier(self) -> None:
        """Barrier over the group (host-side, on the group's store; bounded by timeout_s). Does not
        synchronise the device. On a timeout the group is refused from then on, on this rank and
        on every rank that comes later (GroupOutOfStepError)."""
        self._check_open("barrier")
        check_group(self._group, "PeerArena.barrier")
        self._barriers += 1
        self._meet(f"barrier{self._barriers}", "barrier")

    def _meet(self, name: str, stage: str, leftovers: list[str] | None = None,
              watch: Callable[[], None] | None = None) -> None:
        assert self._agreements is not None
        exited = peers_exited(self.peer_pids, watch=watch)
        try:
            if leftovers is None:
                self._agreements.meet(name, self.timeout_s, give_up=exited)
            else:  # the closing agreement: what every rank left on the store goes with it
                self._agreements.finish(name, self.timeout_s, True, leftovers, exited)
        except AgreementAbandoned as e:
            err = out_of_step(self._group, stage, e, self.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena {stage} failed: {err}") from None
        except Exception as e:  # the store itself failed
            gave_up = AgreementAbandoned(self.rank, [], 0.0, True, f"the group's store failed: {e}")
            err = out_of_step(self._group, stage, gave_up, self.rank, self.timeout_s)
            raise GroupOutOfStepError(f"torch_sdcp: PeerArena {stage} failed: {err}") from e
        except BaseException as e:  # Ctrl-C: meet() gave it up for the peers; this rank refuses the group too
            refuse_group(self._group, stage, AgreementAbandoned(self.rank, [], 0.0, True,
                                                                f"interrupted on rank {self.rank} ({e!r})"))
            raise

    def agree_call(self, name: str, payload: bytes, timeout_s: float,
                   give_up: Callable[[], str | None] | None = None) -> list[bytes]:
        """Every rank's ``payload`` for ``name`` (unique in this arena, alike on every rank), agreed
        on the group's store within ``timeout_s`` (a workspace's rows-fallback decision), or
        AgreementAbandoned; the group stays usable: nothing collective ran."""
        self._check_open("agree_call")
        check_group(self._group, "the collective path")
        assert self._agreements is not None
        return self._agreements.meet(name, timeout_s, payload, give_up)

    def collective_turn(self, name: str, timeout_s: float,
                        give_up: Callable[[], str | None] | None = None) -> Turn:
        """The turn of the collective-path section whose agreement is ``name`` (the name given to
        agree_call), in the one order of such sections on this arena's group (GroupOrder): held
        by the calling thread from now on, through the agreement and the collectives that follow,
        until ``Turn.release()``. AgreementAbandoned (this rank's, with its reason) when the turn
        does not come within ``timeout_s`` or ``give_up()`` returns a reason; nothing collective
        ran then."""
        self._check_open("collective_turn")
        check_group(self._group, "the collective path")
        assert self._agreements is not None
        return group_order(self._group).enter(f"{self._agreements.prefix}/{name}", timeout_s, give_up)

    def close(self, barrier: bool = True, watch: Callable[[], None] | None = None,
              released: Callable[[], None] | None = None) -> None:
        """Idempotent. Synchronise the device, barrier over the group's store (if `barrier`, the
        process group is still initialised and the interpreter is not exiting; failures are logged;
        a timeout refuses the group), then release locally: the memory is unmapped and freed now
        if no view is alive, else when the last view is released. Without `barrier` this rank is
        counted as come to the close barrier, so that peers closing with it do not wait for it.
        ``watch`` is called while the barrier waits (at most every 20 ms: a closing workspace
        tells a peer that entered a call meanwhile that this rank left it); ``released`` once the
        barrier is over, before the memory is unmapped (a workspace drops its handle there)."""
        if getattr(self, "_closed", True):
            if released is not None:
                released()
            return
        self._closed = True
        try:
            if self._mapping is not None:
                self._mapping.backend.synchronize()
            if not _interpreter_exiting() and dist.is_available() and dist.is_initialized():
                assert self._agreements is not None
                if is_refused(self._group):
                    pass  # nothing to agree on after a timed-out agreement: release locally
                elif barrier:  # a peer resizing this arena meanwhile is told (peer/replacing.py)
                    self._meet("close", "close barrier", self._leftovers(),
                               ReplacingPeers(self._group, self._agreements, self.timeout_s, watch))
                else:  # peers that hold the close barrier complete it instead of waiting out timeout_s
                    gave_up = self._agreements.finish("close", self.timeout_s, False, self._leftovers())
                    if gave_up is not None:  # a peer gave it up before: the group is out of step
                        raise out_of_step(self._group, "close barrier", gave_up, self.rank, self.timeout_s)
        except Exception as e:
            logger.warning("torch_sdcp: PeerArena rank %d: close() could not synchronise with "
                           "the group (%s); releasing locally", self.rank, e)
        finally:
            try:
                if released is not None:
                    released()
            finally:
                if self._agreements is not None:
                    forget_arena(self._group, self._agreements.prefix)
                self._release_local()

    def _leftovers(self) -> list[str]:
        """The keys that may stay under this arena's prefix until every rank closed it: every
        rank's note (post_note)."""
        assert self._agreements is not None
        return [f"{self._agreements.prefix}/note/{r}" for r in range(self.world_size)]

    def _release_local(self) -> None:
        self._base_u8 = None  # drops the storage reference unless views keep it alive
        m, self._mapping = self._mapping, None
        if m is not None:
            m.unref()

    def __del__(self) -> None:
        # Local only: no barrier, nothing collective from a destructor.
        with interrupts_kept():
            if not getattr(self, "_closed", True):
                self._closed = True
                self._release_local()

    def __enter__(self) -> PeerArena:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the peers may never reach a barrier: release locally (safe, the
        # physical memory is reference-counted by every process that maps it).
        self.close(barrier=exc_type is None)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"base=0x{self.base_address:x}"
        return (f"PeerArena(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device}, nbytes_per_rank={self.nbytes_per_rank}, "
                f"stride={self.stride}, {state})")
