"""N virtual ranks of one workspace in one process on one GPU (the bench's
``--one-gpu N``): every rank's region is its own physical allocation, and
every virtual rank sees all N of them rank-major in a virtual range of its
own, as N processes would through PeerArena.

CUDA VMM lets one physical allocation be mapped at several virtual addresses
of one process, so rank r's range maps allocation p at ``base_r + p *
stride`` for every p: rank r's stores into "peer p" land in the memory that
rank p polls through its own range. Nothing is exported or exchanged (one
process), so no process group is needed for the memory itself.

The regions are initialised as PeerArena and PeerWorkspace initialise them:
each region zeroed whole, the write-and-verify probe (every rank writes a
word into every region through its own range, each owner reads its words
through its range, then they are zeroed again), and the data slots filled
with the sentinel for the families that start sentinel-filled. Each virtual
rank's workspace is then registered with ``torch.ops.sdcp.workspace_register``
under a handle of its own.

``VirtualRegions`` is the memory alone (mapped, zeroed, probed; nothing
registered): the bench's competitors lay their symmetric buffers over it
(bench/one_gpu_competitors.py). ``VirtualRanks`` is VirtualRegions of a
family's region size with a workspace registered per rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from torch_sdcp import _registry
from torch_sdcp.families import FAMILIES, WorkspaceKind
from torch_sdcp.peer.cuda_driver import cu, driver
from torch_sdcp.workspaces import PeerWorkspace, WorkspaceLayout, workspace_layout

__all__ = ["VirtualRanks", "VirtualRegions"]

logger = logging.getLogger("torch_sdcp")

_Regions = TypeVar("_Regions", bound="VirtualRegions")


def _probe_word(src: int, dst: int) -> int:
    """The 32-bit word virtual rank src writes into rank dst's region (distinct per pair, non-zero)."""
    return 0x5D00_0000 | ((src & 0xFF) << 8) | (dst & 0xFF)


class VirtualRegions:
    """``world_size`` physical allocations of ``region_bytes`` (rounded up to
    the granularity) on ``device``, each mapped into each of ``world_size``
    virtual ranges rank-major, zeroed and probed (write-and-verify): the
    memory of N virtual ranks, with nothing registered. VirtualRanks adds a
    torch_sdcp workspace per rank; the bench's competitors
    (bench/one_gpu_competitors.py) lay their symmetric buffers over it.

    Attributes: ``bases[r]`` (the start of rank r's range), ``stride`` (the
    distance between two regions in a range), ``closed``. ``region(viewer,
    owner)``: the address of rank owner's region in rank viewer's range.

    ``close()`` (also ``with``, and on a failed creation) synchronises the
    device, unmaps every mapping, frees every range and every allocation; it
    is idempotent, and a step that fails does not stop the next ones (the
    first failure is raised at the end).
    """

    def __init__(self, region_bytes: int, world_size: int, device: torch.device) -> None:
        self.region_bytes, self.world_size = int(region_bytes), int(world_size)
        self.device = torch.device(device)
        self.bases: list[int] = []
        self.stride = 0
        self.closed = False
        # What creation set up so far, in the order close() undoes it.
        self._cu_device = None
        self._context_handle = None
        self._context_retained = False
        self._allocations: list = []  # physical allocation handles, by rank
        self._mappings: list[tuple[int, int]] = []  # (address, bytes)
        self._ranges: list[tuple[int, int]] = []  # (address, bytes)
        try:
            self._create()
        except BaseException:
            with contextlib.suppress(Exception):  # the creation's own error is the one to see
                self.close()
            raise

    # -- creation -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """The device's primary context (the one torch's runtime uses) is current inside."""
        cu("cuCtxPushCurrent", self._context_handle)
        try:
            yield
        finally:
            cu("cuCtxPopCurrent")

    def _allocation_prop(self):
        drv = driver()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(self.device.index)
        return prop  # no shareable handle type: nothing leaves this process

    def _create(self) -> None:
        drv = driver()
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"torch_sdcp: argument 'device': expected a cuda device with an index, got {self.device}")
        cu("cuInit", 0)
        self._cu_device = cu("cuDeviceGet", self.device.index)
        self._context_handle = cu("cuDevicePrimaryCtxRetain", self._cu_device)
        self._context_retained = True
        if not cu("cuDeviceGetAttribute",
                   drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._cu_device):
            raise RuntimeError(f"torch_sdcp: {self.device} does not support CUDA virtual memory management")
        prop = self._allocation_prop()
        n = self.world_size
        with self._context():
            granularity = int(cu("cuMemGetAllocationGranularity", prop,
                                  drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
            self.stride = stride = -(-self.region_bytes // granularity) * granularity  # rounded up
            for _ in range(n):
                self._allocations.append(cu("cuMemCreate", stride, prop, 0))
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = int(self.device.index)
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            for _ in range(n):  # rank r's range: every allocation, rank-major
                base = int(cu("cuMemAddressReserve", n * stride, granularity, 0, 0))
                self._ranges.append((base, n * stride))
                self.bases.append(base)
                for p, allocation in enumerate(self._allocations):
                    cu("cuMemMap", base + p * stride, stride, 0, allocation, 0)
                    self._mappings.append((base + p * stride, stride))
                cu("cuMemSetAccess", base, n * stride, [access], 1)
            for r in range(n):  # PeerArena: each rank zeroes its own region
                cu("cuMemsetD8", self.region(r, r), 0, stride)
            cu("cuCtxSynchronize")
            self._probe()
            self._initialise()
            cu("cuCtxSynchronize")

    def _initialise(self) -> None:
        """What a subclass stores into the zeroed, probed regions (the context current)."""

    def region(self, viewer: int, owner: int) -> int:
        """The address of rank ``owner``'s region in rank ``viewer``'s range."""
        return self.bases[viewer] + owner * self.stride

    def _probe(self) -> None:
        """PeerArena's write-and-verify probe: a store through one virtual
        rank's range must be what the owner reads through its own (the
        mappings alias one allocation, not copies); the words are zeroed
        again after."""
        n = self.world_size
        for src in range(n):
            for dst in range(n):
                cu("cuMemsetD32", self.region(src, dst) + 4 * src, _probe_word(src, dst), 1)
        cu("cuCtxSynchronize")
        bad = []
        for dst in range(n):
            words = (ctypes.c_uint32 * n)()
            cu("cuMemcpyDtoH", ctypes.addressof(words), self.region(dst, dst), 4 * n)
            bad += [f"rank {src}'s word in rank {dst}'s region: got 0x{words[src]:08x}, expected "
                    f"0x{_probe_word(src, dst):08x}" for src in range(n) if words[src] != _probe_word(src, dst)]
            cu("cuMemsetD8", self.region(dst, dst), 0, 4 * n)
        if bad:
            raise RuntimeError("torch_sdcp: virtual ranks: write-and-verify probe: stores through one rank's "
                               "mapping did not reach the owner's (" + "; ".join(bad) + ")")

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Synchronise, unmap, free (idempotent; every step is tried)."""
        if self.closed:
            return
        self.closed = True
        failures: list[str] = []

        def attempt(what: str, step: Callable[..., object], *args: object) -> bool:
            try:
                step(*args)
                return True
            except Exception as e:
                failures.append(f"{what}: {e}")
                return False

        pushed = False
        if self._context_retained:
            pushed = attempt("cuCtxPushCurrent", cu, "cuCtxPushCurrent", self._context_handle)
            # A kernel still in flight must not fault on memory about to go.
            attempt("cuCtxSynchronize", cu, "cuCtxSynchronize")
        self._release_users(attempt)
        for address, size in self._mappings:
            attempt(f"cuMemUnmap(0x{address:x})", cu, "cuMemUnmap", address, size)
        self._mappings = []
        for address, size in self._ranges:
            attempt(f"cuMemAddressFree(0x{address:x})", cu, "cuMemAddressFree", address, size)
        self._ranges, self.bases = [], []
        for allocation in self._allocations:
            attempt("cuMemRelease", cu, "cuMemRelease", allocation)
        self._allocations = []
        if pushed:
            attempt("cuCtxPopCurrent", cu, "cuCtxPopCurrent")
        if self._context_retained:
            self._context_retained = False
            attempt("cuDevicePrimaryCtxRelease", cu, "cuDevicePrimaryCtxRelease", self._cu_device)
        if failures:
            raise RuntimeError(f"torch_sdcp: virtual ranks of {self._what()}: teardown: " + "; ".join(failures))

    def _release_users(self, attempt: Callable[..., bool]) -> None:
        """What a subclass releases once the device is idle, before the memory goes."""

    def _what(self) -> str:
        return f"{self.region_bytes} bytes"

    def __enter__(self: _Regions) -> _Regions:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the error in flight is the one to see; a teardown failure is logged beside it
            self.close()
        except Exception as e:
            logger.warning("%s", e)

    def __repr__(self) -> str:
        return (f"VirtualRegions({self.region_bytes} bytes, world_size={self.world_size}, device={self.device}, "
                f"stride={self.stride}{', closed' if self.closed else ''})")


class VirtualRanks(VirtualRegions):
    """``world_size`` registered workspaces of family ``kind`` with ``params``
    on ``device``, one per virtual rank, over VirtualRegions of the family's
    region size.

    Attributes (beside VirtualRegions'): ``handles[r]`` (rank r's workspace
    handle, for the peer ops; registered with base ``bases[r]``), ``layout``.
    ``close()`` unregisters every handle before the memory goes.
    """

    def __init__(self, kind: WorkspaceKind, params: Sequence[int], world_size: int, device: torch.device,
                 timeout_s: float) -> None:
        self.kind, self.params = kind, [int(p) for p in params]
        self.timeout_s = float(timeout_s)
        self.handles: list[int] = []
        self.layout: WorkspaceLayout = workspace_layout(kind, self.params, int(world_size))
        super().__init__(self.layout.region_bytes, world_size, device)

    def _create(self) -> None:
        super()._create()
        n = self.world_size
        for r in range(n):
            handle = _registry.new_handle()
            torch.ops.sdcp.workspace_register(handle, int(self.kind), self.params, self.bases[r], self.stride, r, n,
                                              self.device, int(self.timeout_s * 1e9))
            self.handles.append(handle)

    def _initialise(self) -> None:
        if self._sentinel_filled():
            for r in range(self.world_size):
                cu("cuMemsetD8", self.region(r, r) + self.layout.data_offset, 0xFF,
                    self.layout.slots * self.layout.slot_bytes)

    def _sentinel_filled(self) -> bool:
        """Whether the family's buffers start as the sentinel (its workspace
        class says; PeerWorkspace._fill_sentinel fills them)."""
        cls: type[PeerWorkspace] = FAMILIES[int(self.kind)].load()
        return cls.SENTINEL_FILLED

    def _release_users(self, attempt: Callable[..., bool]) -> None:
        for handle in self.handles:
            attempt(f"workspace_unregister({handle})", torch.ops.sdcp.workspace_unregister, handle)
        self.handles = []

    def _what(self) -> str:
        return FAMILIES[int(self.kind)].name

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"handles={self.handles}"
        return (f"VirtualRanks({FAMILIES[int(self.kind)].name}, world_size={self.world_size}, params={self.params}, "
                f"device={self.device}, stride={self.stride}, {state})")
