"""CUDA backend: CUDA virtual memory management.

``cuMemCreate`` (pinned, device location, POSIX file-descriptor handle type), exported as a file
descriptor, imported by the peers, mapped with ``cuMemMap`` into one ``cuMemAddressReserve`` range,
one ``cuMemSetAccess`` for the local device. Besides the arena's write-and-verify probe,
``cuDeviceCanAccessPeer`` is required and native peer atomics are recorded.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from .backend import MemoryBackend, _round_up
from .cuda_driver import cu as _cu
from .cuda_driver import driver as _driver

logger = logging.getLogger("torch_sdcp")


def _cuda_alloc_prop(device_index: int):
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device_index)
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _fd_handle_type():
    return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaVmmBackend(MemoryBackend):
    name = "cuda"
    label = "CUDA"
    device_type = "cuda"

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.device_index = -1
        self.cu_dev = None
        self.cu_ctx = None
        self.ctx_retained = False
        self.granularity = 0
        self.own_handle = None
        self.reserved = False
        self.mapped: list[int] = []

    # -- choice of the backend ------------------------------------------------------------------

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type not in ("cuda", "cpu"):
            raise ValueError("torch_sdcp: argument 'device': expected a cuda device, got "
                             f"{device}")
        if device.type != "cuda":
            raise ValueError("torch_sdcp: argument 'device': expected a cuda device for "
                             f"backend 'cuda', got {device}")

    @classmethod
    def wanted_for_auto(cls, device: torch.device | None) -> bool:
        return (device is None or device.type == "cuda") and torch.cuda.is_available()

    @classmethod
    def plans_error(cls, infos: list[dict[str, Any]],
                    allow_shared_device: bool) -> Exception | None:
        by_uuid: dict[str, list[int]] = {}
        for r, c in enumerate(infos):
            by_uuid.setdefault(c["uuid"], []).append(r)
        shared = {u: rs for u, rs in by_uuid.items() if len(rs) > 1}
        if shared and not allow_shared_device:
            desc = "; ".join(f"ranks {rs} on GPU {u}" for u, rs in shared.items())
            return RuntimeError(
                f"torch_sdcp: PeerArena: several ranks share one GPU ({desc}): expected one "
                "GPU per rank; pass allow_shared_device=True to opt in (correct but slow)")
        return None

    def local_plan(self, nbytes_per_rank: int, device: torch.device | None) -> dict[str, Any]:
        if not torch.cuda.is_available():
            raise RuntimeError("torch_sdcp: backend 'cuda' requested but torch.cuda.is_available() "
                               "is False")
        if device is None or device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not 0 <= device.index < torch.cuda.device_count():
            raise ValueError(f"torch_sdcp: argument 'device': expected one of the "
                             f"{torch.cuda.device_count()} visible GPUs, got {device}")
        # Make sure the runtime's primary context exists and is current, then use it.
        torch.cuda.set_device(device)
        torch.cuda.init()
        torch.empty(1, device=device)
        drv = _driver()
        _cu("cuInit", 0)
        cudev = _cu("cuDeviceGet", device.index)
        self.cu_dev = cudev
        self.cu_ctx = _cu("cuDevicePrimaryCtxRetain", cudev)
        self.ctx_retained = True
        self.device_index = device.index
        attr = drv.CUdevice_attribute
        if not _cu("cuDeviceGetAttribute",
                   attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cudev):
            raise RuntimeError(f"torch_sdcp: {device} does not support CUDA virtual memory "
                               "management (cuMemCreate/cuMemMap)")
        if not _cu("cuDeviceGetAttribute",
                   attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cudev):
            raise RuntimeError(f"torch_sdcp: {device} cannot export allocations as POSIX file "
                               "descriptors")
        self.granularity = int(_cu(
            "cuMemGetAllocationGranularity", _cuda_alloc_prop(device.index),
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        uuid = bytes(_cu("cuDeviceGetUuid", cudev).bytes).hex()
        # UUID -> local ordinal of every GPU visible here (for the peer capability checks).
        visible = {}
        for i in range(int(_cu("cuDeviceGetCount"))):
            visible[bytes(_cu("cuDeviceGetUuid", _cu("cuDeviceGet", i)).bytes).hex()] = i
        return {"index": device.index, "uuid": uuid, "granularity": self.granularity,
                "stride": _round_up(nbytes_per_rank, self.granularity), "visible": visible}

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    # -- creation steps -------------------------------------------------------------------------

    def _push_ctx(self) -> bool:
        if self.cu_ctx is None:
            return False
        _cu("cuCtxPushCurrent", self.cu_ctx)
        return True

    @contextlib.contextmanager
    def _current_ctx(self):
        pushed = self._push_ctx()
        try:
            yield
        finally:
            if pushed:
                _cu("cuCtxPopCurrent")

    def allocate(self, stride: int) -> None:
        self.stride = stride
        with self._current_ctx():
            self.own_handle = _cu("cuMemCreate", stride, _cuda_alloc_prop(self.device_index), 0)

    def export_fd(self) -> int:
        with self._current_ctx():
            self.own_fd = int(_cu("cuMemExportToShareableHandle", self.own_handle,
                                  _fd_handle_type(), 0))
        return self.own_fd

    def map_peers(self, fds: dict[int, int]) -> int:
        drv = _driver()
        N, stride, me = self.world_size, self.stride, self.rank
        with self._current_ctx():
            self.base = int(_cu("cuMemAddressReserve", N * stride, self.granularity, 0, 0))
            self.reserved = True
            for r in range(N):
                if r == me:
                    _cu("cuMemMap", self.base + r * stride, stride, 0, self.own_handle, 0)
                    self.mapped.append(r)
                    continue
                h = _cu("cuMemImportFromShareableHandle", fds[r], _fd_handle_type())
                try:
                    _cu("cuMemMap", self.base + r * stride, stride, 0, h, 0)
                    self.mapped.append(r)
                finally:
                    try:
                        _cu("cuMemRelease", h)  # the mapping keeps the imported allocation alive
                    except Exception as e:
                        logger.warning("torch_sdcp: PeerArena rank %d: cuMemRelease of the "
                                       "handle imported from rank %d failed: %s", me, r, e)
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.device_index
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _cu("cuMemSetAccess", self.base, N * stride, [desc], 1)
            _cu("cuMemsetD8", self.base + me * stride, 0, stride)
            _cu("cuCtxSynchronize")
        return self.base

    def check_peer_access(self, infos: list[dict[str, Any]]) -> bool | None:
        """cuDeviceCanAccessPeer (required) and native atomics (recorded) towards every peer GPU
        visible in this process. Returns True/False for atomics, None if some peer GPU is not
        visible here (then only the probe vouches for the path)."""
        drv = _driver()
        mine = infos[self.rank]
        atomics: bool | None = True
        for r, c in enumerate(infos):
            if r == self.rank or c["uuid"] == mine["uuid"]:
                continue
            ordinal = mine["visible"].get(c["uuid"])
            if ordinal is None:
                atomics = None
                continue
            peer_dev = _cu("cuDeviceGet", ordinal)
            if not _cu("cuDeviceCanAccessPeer", self.cu_dev, peer_dev):
                raise RuntimeError(f"cuDeviceCanAccessPeer: GPU {mine['uuid']} cannot access the "
                                   f"GPU of rank {r} ({c['uuid']})")
            native = _cu("cuDeviceGetP2PAttribute",
                         drv.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                         self.cu_dev, peer_dev)
            if not native and atomics is not None:
                atomics = False
        return atomics

    def synchronize(self) -> None:
        with self._current_ctx():
            _cu("cuCtxSynchronize")

    # -- release --------------------------------------------------------------------------------

    def _release_context(self) -> None:
        if self.ctx_retained:
            self.ctx_retained = False
            self.cu_ctx = None
            _cu("cuDevicePrimaryCtxRelease", self.cu_dev)

    def _release_memory(self, attempt) -> None:
        if self.own_handle is None and not self.reserved:
            # Nothing allocated (failed or unchosen plan): only the retained context.
            attempt("cuDevicePrimaryCtxRelease", self._release_context)
            return
        pushed = bool(attempt("cuCtxPushCurrent", self._push_ctx))
        try:
            # first: a kernel still in flight on the views must not fault
            attempt("cuCtxSynchronize", _cu, "cuCtxSynchronize")
            for r in self.mapped:
                attempt(f"cuMemUnmap(rank {r})", _cu, "cuMemUnmap",
                        self.base + r * self.stride, self.stride)
            self.mapped = []
            if self.reserved:
                self.reserved = False
                attempt("cuMemAddressFree", _cu, "cuMemAddressFree", self.base,
                        self.world_size * self.stride)
            if self.own_handle is not None:
                h, self.own_handle = self.own_handle, None
                attempt("cuMemRelease", _cu, "cuMemRelease", h)
        finally:
            if pushed:
                attempt("cuCtxPopCurrent", _cu, "cuCtxPopCurrent")
            attempt("cuDevicePrimaryCtxRelease", self._release_context)
