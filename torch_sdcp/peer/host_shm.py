"""Host backend: shared memory from ``memfd_create``, mapped with ``mmap(MAP_SHARED | MAP_FIXED)``
into one reserved ``PROT_NONE`` range. It lets every protocol run, and be tested, without a GPU."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Any

import torch

from .backend import MemoryBackend, _round_up

_PROT_NONE = 0
_PROT_READ = mmap.PROT_READ
_PROT_WRITE = mmap.PROT_WRITE
_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
# Not exported by the mmap module; these are the Linux values on x86-64, arm64 and riscv64.
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def _libc_mmap(addr: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    libc = _get_libc()
    res = libc.mmap(addr, length, prot, flags, fd, 0)
    if res is None or res == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(length={length}, fd={fd}) failed: {os.strerror(err)}")
    return int(res)


def _libc_munmap(addr: int, length: int) -> None:
    if _get_libc().munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap(0x{addr:x}, {length}) failed: {os.strerror(err)}")


class HostShmBackend(MemoryBackend):
    name = "host"
    label = "host shared memory"
    device_type = "cpu"

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError("torch_sdcp: argument 'device': expected None or cpu for "
                             f"backend 'host', got {device}")

    def local_plan(self, nbytes_per_rank: int, device: torch.device | None) -> dict[str, Any]:
        return {"stride": _round_up(nbytes_per_rank, mmap.PAGESIZE)}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def allocate(self, stride: int) -> None:
        self.stride = stride
        flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
        self.own_fd = os.memfd_create("sdcp-arena", flags)
        os.ftruncate(self.own_fd, stride)
        if hasattr(fcntl, "F_ADD_SEALS"):  # peers can neither shrink nor grow it
            fcntl.fcntl(self.own_fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)

    def export_fd(self) -> int:
        return self.own_fd

    def map_peers(self, fds: dict[int, int]) -> int:
        N, stride = self.world_size, self.stride
        self.base = _libc_mmap(None, N * stride, _PROT_NONE,
                               _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        for r in range(N):
            size = os.fstat(fds[r]).st_size
            if size < stride:
                raise RuntimeError(f"the shared memory of rank {r} has {size} bytes, expected "
                                   f"at least {stride}")
            addr = self.base + r * stride
            got = _libc_mmap(addr, stride, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED,
                             fds[r])
            if got != addr:
                raise RuntimeError(f"mmap(MAP_FIXED) placed rank {r} at 0x{got:x}, expected "
                                   f"0x{addr:x}")
        ctypes.memset(self.base + self.rank * stride, 0, stride)
        return self.base

    def _release_memory(self, attempt) -> None:
        if self.base:
            base, self.base = self.base, 0
            attempt("munmap", _libc_munmap, base, self.world_size * self.stride)
