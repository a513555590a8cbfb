"""Peer-addressable memory: :class:`PeerArena` (DESIGN.md sections 3, 4 and 7).

A ``PeerArena`` gives every rank of a process group ``nbytes_per_rank`` bytes of memory that it
owns, and maps the memory of *every* rank into every process at ``base + r * stride``: one
contiguous virtual range, rank-major. Kernels take one pointer and one stride; one strided
``[N, ...]`` tensor covers every rank.

Two backends share one interface and one creation protocol:

``"cuda"``
    ``cuMemCreate`` (pinned, device location, POSIX file-descriptor handle type), exported as a
    file descriptor, imported by the peers, mapped with ``cuMemMap`` into one ``cuMemAddressReserve``
    range, one ``cuMemSetAccess`` for the local device. Gated by a write-and-verify probe through
    the mapping (plus ``cuDeviceCanAccessPeer``); native peer atomics are recorded in
    :attr:`PeerArena.native_peer_atomics`.
``"host"``
    Shared memory from ``memfd_create``, mapped with ``mmap(MAP_SHARED | MAP_FIXED)`` into one
    reserved ``PROT_NONE`` range, exchanged the same way, probed the same way. It lets every
    protocol run, and be tested, on machines without a GPU.

Creation is collective and every failure is collective: the ranks exchange a plan, validate it on
identical gathered data, and after each local step (allocation, descriptor exchange, mapping,
probe) gather a status, so all ranks raise the same error and none hangs. Every blocking wait
(collectives, socket operations) is bounded by ``timeout_s``.

File descriptors travel over AF_UNIX sockets with SCM_RIGHTS. Each rank listens in a private
``mkdtemp`` directory (mode 0700) on an unguessable name; a connection is served only after its
``SO_PEERCRED`` credentials match our uid and the pid that the plan gives for the rank the peer
claims to be (the connecting side checks the listener's credentials the same way). Anything else
is refused, closed and logged on the ``torch_sdcp`` logger. Sockets and directories are removed as
soon as the exchange is over, on success and on failure; every received descriptor is closed after
import.

View lifetime policy
--------------------
Views (``local_view``, ``peer_view``, ``rank_major_view`` and anything derived from them) are
tensors over the mapping with an explicit local device (``cuda:<local index>`` or ``cpu``): they
are made through DLPack with the device stated, so nothing infers the device from the pointer
(peer memory physically lives on another GPU). Every view holds a reference on the mapping.

* ``close()`` synchronises the local device, runs a barrier over the group (unless
  ``barrier=False``, the interpreter is exiting or the process group is gone; a failing or
  timed-out barrier, e.g. when a peer died, is logged and the local release still happens),
  marks the arena closed and drops the arena's own reference.
* The memory is unmapped and freed when the last reference goes: at ``close()`` if no view is
  alive, otherwise when the last view is released. Views that outlive ``close()`` therefore keep
  pointing at valid, mapped memory (never a use-after-free), but the arena makes no promise about
  peers any more: they may have closed and moved on. New views, ``address()`` and ``barrier()``
  raise ``RuntimeError`` once closed.
* Releasing the memory synchronises the device first (cuda), so a kernel still in flight on the
  views never faults.
* ``__del__`` and interpreter exit release locally only: nothing collective runs from a destructor
  or at exit (an ``atexit`` handler sets a module flag that ``close()`` respects).
* Peers' memory stays alive as long as this process maps it (the imported CUDA allocation, like
  the memfd, is reference-counted by the mappings), so a peer that closes or dies never
  invalidates our mappings.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import math
import mmap
import os
import socket
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import _EXC_TYPES, _all_gather_obj, _describe, _group_barrier
from .dlpack import _byte_tensor
from .fd_exchange import _exchange_fds, _make_socket_dir, _remove_socket_dir

__all__ = ["PeerArena"]

logger = logging.getLogger("torch_sdcp")

# --------------------------------------------------------------------------------------------
# Interpreter exit: nothing collective runs once this is set.
# --------------------------------------------------------------------------------------------

_AT_EXIT = False


def _mark_exit() -> None:
    global _AT_EXIT
    _AT_EXIT = True


atexit.register(_mark_exit)


def _interpreter_exiting() -> bool:
    return _AT_EXIT or sys.is_finalizing()


def _hook(stage: str) -> None:
    # Fault injection for the tests: torch_sdcp.peer._TEST_HOOK, set on the package.
    hook = getattr(sys.modules[__package__], "_TEST_HOOK", None)
    if hook is not None:
        hook(stage)


# --------------------------------------------------------------------------------------------
# libc (host backend)
# --------------------------------------------------------------------------------------------

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


def _libc_mmap(addr: Optional[int], length: int, prot: int, flags: int, fd: int) -> int:
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


# --------------------------------------------------------------------------------------------
# CUDA driver (cuda-python), imported lazily
# --------------------------------------------------------------------------------------------


def _driver():
    try:
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "torch_sdcp: the 'cuda' backend of PeerArena needs cuda-python "
            f"(`from cuda.bindings import driver` failed: {e})") from e
    return driver


def _cu_error_string(err) -> str:
    name = getattr(err, "name", str(err))
    try:
        e2, desc = _driver().cuGetErrorString(err)
        text = desc.decode() if isinstance(desc, (bytes, bytearray)) and int(e2) == 0 else "?"
    except Exception:  # noqa: BLE001
        text = "?"
    return f"{name} ({int(err)}): {text}"


def _cu(name: str, *args):
    """Call driver.<name>(*args), raise RuntimeError naming the call on any error, return the
    outputs (None, one value, or a tuple)."""
    drv = _driver()
    out = getattr(drv, name)(*args)
    if not isinstance(out, tuple):
        out = (out,)
    err = out[0]
    if int(err) != int(drv.CUresult.CUDA_SUCCESS):
        raise RuntimeError(f"torch_sdcp: {name} failed: {_cu_error_string(err)}")
    if len(out) == 1:
        return None
    if len(out) == 2:
        return out[1]
    return out[1:]


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


# --------------------------------------------------------------------------------------------
# The mapping: every local resource of one arena, released exactly once
# --------------------------------------------------------------------------------------------


class _Mapping:
    """Local resources of one arena. Reference counted: the arena holds one reference, the
    storage of its views holds one; the last unref() releases. release() is idempotent and also
    used directly on creation failures."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stride = 0
        self.size = 0
        # host
        self.host_base = 0
        self.own_fd = -1
        # cuda
        self.device_index = -1
        self.cu_dev = None
        self.cu_ctx = None
        self.ctx_retained = False
        self.own_handle = None
        self.cu_base = 0
        self.reserved = False
        self.mapped: List[int] = []
        self._refs = 0
        self._lock = threading.Lock()
        self.released = False

    # refcount
    def ref(self) -> None:
        with self._lock:
            self._refs += 1

    def unref(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs <= 0
        if last:
            self.release()

    # cuda context scope
    def push_ctx(self) -> bool:
        if self.cu_ctx is None:
            return False
        _cu("cuCtxPushCurrent", self.cu_ctx)
        return True

    def pop_ctx(self) -> None:
        _cu("cuCtxPopCurrent")

    def cuda_synchronize(self) -> None:
        pushed = self.push_ctx()
        try:
            _cu("cuCtxSynchronize")
        finally:
            if pushed:
                self.pop_ctx()

    def close_own_fd(self) -> None:
        if self.own_fd >= 0:
            fd, self.own_fd = self.own_fd, -1
            os.close(fd)

    def release_cuda_context(self) -> None:
        if self.ctx_retained:
            self.ctx_retained = False
            self.cu_ctx = None
            _cu("cuDevicePrimaryCtxRelease", self.cu_dev)

    def release(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = True
        quiet = _interpreter_exiting()

        def attempt(what, fn, *args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001
                try:
                    (logger.debug if quiet else logger.warning)(
                        "torch_sdcp: PeerArena rank %d: %s failed during release: %s",
                        self.rank, what, e)
                except BaseException:  # noqa: BLE001
                    pass

        # host
        if self.host_base:
            base, self.host_base = self.host_base, 0
            attempt("munmap", _libc_munmap, base, self.size)
        # cuda
        if self.cu_ctx is not None or self.own_handle is not None or self.reserved:
            pushed = False
            try:
                pushed = self.push_ctx()
            except BaseException as e:  # noqa: BLE001
                try:
                    (logger.debug if quiet else logger.warning)(
                        "torch_sdcp: PeerArena rank %d: cuCtxPushCurrent failed during release: "
                        "%s", self.rank, e)
                except BaseException:  # noqa: BLE001
                    pass
            try:
                attempt("cuCtxSynchronize", _cu, "cuCtxSynchronize")
                for r in self.mapped:
                    attempt(f"cuMemUnmap(rank {r})", _cu, "cuMemUnmap",
                            self.cu_base + r * self.stride, self.stride)
                self.mapped = []
                if self.reserved:
                    self.reserved = False
                    attempt("cuMemAddressFree", _cu, "cuMemAddressFree", self.cu_base, self.size)
                if self.own_handle is not None:
                    h, self.own_handle = self.own_handle, None
                    attempt("cuMemRelease", _cu, "cuMemRelease", h)
            finally:
                if pushed:
                    attempt("cuCtxPopCurrent", self.pop_ctx)
                attempt("cuDevicePrimaryCtxRelease", self.release_cuda_context)
        attempt("close", self.close_own_fd)

    def __del__(self) -> None:  # backstop; normally released through unref()
        try:
            self.release()
        except BaseException:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_id(kind: str) -> Optional[int]:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return None


def _word(src: int, dst: int) -> int:
    """Probe word that rank src writes into rank dst's region (distinct per pair, non-zero)."""
    return 0x5344_4350_0000_0000 | ((src & 0xFFFF) << 16) | (dst & 0xFFFF)


# --------------------------------------------------------------------------------------------
# PeerArena
# --------------------------------------------------------------------------------------------


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
            DESIGN.md section 6).
        timeout_s: bound on every blocking step of creation, barrier() and close().

    Attributes: rank, world_size, backend ("cuda" | "host"), device (local device of the views;
    cpu for host), stride (bytes between ranks' regions: nbytes_per_rank rounded up to the CUDA
    recommended allocation granularity, or the page size for host), nbytes_per_rank,
    base_address (address of rank 0's region in this process), native_peer_atomics (cuda: True if
    every rank's GPU has native atomics to every peer GPU, None if unknown; host: True), closed,
    timeout_s.

    See the module docstring for the view lifetime policy.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], nbytes_per_rank: int, *,
                 backend: str = "auto", device: Optional[torch.device] = None,
                 allow_shared_device: bool = False, timeout_s: float = 60.0) -> None:
        self._closed = True  # until creation completes; guards __del__ and close()
        self._mapping: Optional[_Mapping] = None
        self._base_u8: Optional[torch.Tensor] = None
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
        self.native_peer_atomics: Optional[bool] = None
        try:
            self.timeout_s = float(timeout_s)
        except (TypeError, ValueError):
            self.timeout_s = 60.0
        self._create(nbytes_per_rank, backend, device, bool(allow_shared_device), timeout_s)

    # ---------------------------------------------------------------------------------------
    # creation
    # ---------------------------------------------------------------------------------------

    def _gather(self, stage: str, obj, local_error=None) -> list:
        try:
            gathered = _all_gather_obj(self._group, (stage, obj), self.timeout_s)
        except Exception as e:  # noqa: BLE001
            extra = f"; this rank's own status: {local_error[1]}" if local_error else ""
            raise RuntimeError(
                f"torch_sdcp: PeerArena creation failed at step '{stage}': the collective over "
                f"the group failed on rank {self.rank} (a rank may have died, hung for more than "
                f"timeout_s={self.timeout_s} s, or not called PeerArena): {e}{extra}") from e
        stages = [g[0] if isinstance(g, tuple) and len(g) == 2 else None for g in gathered]
        if any(st != stage for st in stages):
            got = ", ".join(f"rank {r}: {st!r}" for r, st in enumerate(stages))
            raise RuntimeError(
                f"torch_sdcp: PeerArena creation failed at step '{stage}': the ranks are out of "
                f"step (each rank's step: {got}); a rank called collectives on the group between "
                "its PeerArena steps, or an earlier creation failed on some ranks only")
        return [g[1] for g in gathered]

    @staticmethod
    def _collective_error(stage: str, failures: Dict[int, Tuple[str, str]]) -> Exception:
        first = min(failures)
        cls = _EXC_TYPES.get(failures[first][0], RuntimeError)
        detail = "; ".join(f"rank {r}: {failures[r][1]}" for r in sorted(failures))
        return cls(f"torch_sdcp: PeerArena creation failed at step '{stage}': {detail}")

    def _agree(self, stage: str, local_error: Optional[BaseException], extra=None) -> list:
        """Gather (status, extra) from every rank; raise the same error everywhere if any rank
        failed; return the extras."""
        status = None if local_error is None else _describe(local_error)
        gathered = self._gather(stage, (status, extra), status)
        failures = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
        if failures:
            raise self._collective_error(stage, failures)
        return [x for _, x in gathered]

    def _local_plan(self, nbytes_per_rank, backend, device, allow_shared_device, timeout_s,
                    m: _Mapping) -> Dict[str, Any]:
        plan: Dict[str, Any] = {
            "error": None, "nbytes_per_rank": None, "backend": backend,
            "allow_shared_device": allow_shared_device,
            "host": (socket.gethostname(), _boot_id()), "uid": os.getuid(), "pid": os.getpid(),
            "ns": (_ns_id("pid"), _ns_id("mnt")), "host_stride": None, "cuda": None,
            "cuda_error": None, "socket": None,
        }
        # argument checks (errors are reported collectively)
        if isinstance(nbytes_per_rank, bool) or not isinstance(nbytes_per_rank, int):
            raise TypeError("torch_sdcp: argument 'nbytes_per_rank': expected an int, got "
                            f"{type(nbytes_per_rank).__name__}")
        if nbytes_per_rank <= 0:
            raise ValueError("torch_sdcp: argument 'nbytes_per_rank': expected a positive "
                             f"number of bytes, got {nbytes_per_rank}")
        plan["nbytes_per_rank"] = nbytes_per_rank
        if backend not in ("auto", "cuda", "host"):
            raise ValueError("torch_sdcp: argument 'backend': expected 'auto', 'cuda' or 'host', "
                             f"got {backend!r}")
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError("torch_sdcp: argument 'timeout_s': expected a positive finite "
                             f"number of seconds, got {timeout_s!r}")
        if device is not None:
            device = torch.device(device)
        if backend == "host" and device is not None and device.type != "cpu":
            raise ValueError("torch_sdcp: argument 'device': expected None or cpu for "
                             f"backend 'host', got {device}")
        if backend in ("cuda", "auto") and device is not None and device.type not in ("cuda", "cpu"):
            raise ValueError("torch_sdcp: argument 'device': expected a cuda device, got "
                             f"{device}")
        if backend == "cuda" and device is not None and device.type != "cuda":
            raise ValueError("torch_sdcp: argument 'device': expected a cuda device for "
                             f"backend 'cuda', got {device}")
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"torch_sdcp: PeerArena needs Linux, this is {sys.platform}")
        plan["host_stride"] = _round_up(nbytes_per_rank, mmap.PAGESIZE)
        want_cuda = backend == "cuda" or (
            backend == "auto" and (device is None or device.type == "cuda")
            and torch.cuda.is_available())
        if want_cuda:
            try:
                plan["cuda"] = self._cuda_local_info(nbytes_per_rank, device, m)
            except Exception as e:  # noqa: BLE001
                if backend == "cuda":
                    raise
                plan["cuda_error"] = str(e)
                logger.info("torch_sdcp: PeerArena rank %d: CUDA unusable for backend 'auto' "
                            "(%s); the host backend is used if any rank cannot use CUDA",
                            self.rank, e)
        return plan

    def _cuda_local_info(self, nbytes: int, device: Optional[torch.device], m: _Mapping):
        if not torch.cuda.is_available():
            raise RuntimeError("torch_sdcp: backend 'cuda' requested but torch.cuda.is_available() "
                               "is False")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index is None:
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
        m.cu_dev = cudev
        m.cu_ctx = _cu("cuDevicePrimaryCtxRetain", cudev)
        m.ctx_retained = True
        m.device_index = device.index
        attr = drv.CUdevice_attribute
        if not _cu("cuDeviceGetAttribute",
                   attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cudev):
            raise RuntimeError(f"torch_sdcp: {device} does not support CUDA virtual memory "
                               "management (cuMemCreate/cuMemMap)")
        if not _cu("cuDeviceGetAttribute",
                   attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cudev):
            raise RuntimeError(f"torch_sdcp: {device} cannot export allocations as POSIX file "
                               "descriptors")
        gran = int(_cu("cuMemGetAllocationGranularity", _cuda_alloc_prop(device.index),
                       drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        uuid = bytes(_cu("cuDeviceGetUuid", cudev).bytes).hex()
        # UUID -> local ordinal of every GPU visible here (for the peer capability checks).
        visible = {}
        for i in range(int(_cu("cuDeviceGetCount"))):
            visible[bytes(_cu("cuDeviceGetUuid", _cu("cuDeviceGet", i)).bytes).hex()] = i
        return {"index": device.index, "uuid": uuid, "granularity": gran,
                "stride": _round_up(nbytes, gran), "visible": visible}

    @staticmethod
    def _verdict(plans: List[Dict[str, Any]]) -> Tuple[str, int]:
        """Checks on the gathered plans (identical on every rank, so is the verdict)."""

        def same(key, what, cls, hint=""):
            vals = [p[key] for p in plans]
            if any(v != vals[0] for v in vals):
                got = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals))
                raise cls(f"torch_sdcp: PeerArena: {what} differs between ranks: expected the "
                          f"same value on every rank{hint}, got {got}")

        same("nbytes_per_rank", "argument 'nbytes_per_rank'", ValueError)
        same("backend", "argument 'backend'", ValueError)
        same("allow_shared_device", "argument 'allow_shared_device'", ValueError)
        same("host", "the host (hostname, boot id)", RuntimeError,
             " (all ranks of a PeerArena must run on one host)")
        same("uid", "the user id", RuntimeError, " (the descriptor exchange requires one uid)")
        same("ns", "the (pid, mount) namespace", RuntimeError,
             " (the descriptor exchange requires one pid and mount namespace)")
        requested = plans[0]["backend"]
        allow_shared = plans[0]["allow_shared_device"]
        cuda = [p["cuda"] for p in plans]
        if requested == "host":
            backend = "host"
        elif requested == "cuda":
            backend = "cuda"
        else:
            distinct = all(c is not None for c in cuda) and len({c["uuid"] for c in cuda}) == len(cuda)
            backend = "cuda" if all(c is not None for c in cuda) and (distinct or allow_shared) else "host"
        if backend == "cuda":
            by_uuid: Dict[str, List[int]] = {}
            for r, c in enumerate(cuda):
                by_uuid.setdefault(c["uuid"], []).append(r)
            shared = {u: rs for u, rs in by_uuid.items() if len(rs) > 1}
            if shared and not allow_shared:
                desc = "; ".join(f"ranks {rs} on GPU {u}" for u, rs in shared.items())
                raise RuntimeError(
                    f"torch_sdcp: PeerArena: several ranks share one GPU ({desc}): expected one "
                    "GPU per rank; pass allow_shared_device=True to opt in (correct but slow)")
            strides = [c["stride"] for c in cuda]
        else:
            strides = [p["host_stride"] for p in plans]
        if any(s != strides[0] for s in strides):
            got = ", ".join(f"rank {r}: {s}" for r, s in enumerate(strides))
            raise RuntimeError("torch_sdcp: PeerArena: the stride (nbytes_per_rank rounded up to "
                               f"the allocation granularity) differs between ranks: got {got}")
        return backend, strides[0]

    def _create(self, nbytes_per_rank, backend, device, allow_shared_device, timeout_s) -> None:
        N, me = self.world_size, self.rank
        m = _Mapping(me, N)
        sock_dir = sock_path = None
        listener: Optional[socket.socket] = None
        received: Dict[int, int] = {}
        try:
            # 1. validate locally, publish the plan, check it on the gathered plans
            try:
                _hook("validate")
                plan = self._local_plan(nbytes_per_rank, backend, device, allow_shared_device,
                                        timeout_s, m)
                if N > 1:
                    sock_dir, sock_path, listener = _make_socket_dir()
                    plan["socket"] = sock_path
            except Exception as e:  # noqa: BLE001
                plan = {"error": _describe(e)}
            plans = self._gather("validate", plan, plan.get("error"))
            failures = {r: p["error"] for r, p in enumerate(plans) if p.get("error")}
            if failures:
                raise self._collective_error("validate", failures)
            backend, stride = self._verdict(plans)
            self.backend, self.stride = backend, stride
            m.stride, m.size = stride, N * stride
            cuda_info = plans[me]["cuda"]
            if backend == "cuda":
                self.device = torch.device("cuda", cuda_info["index"])
            else:
                self.device = torch.device("cpu")
                m.release_cuda_context()  # "auto" may have retained it

            # 2. allocate and export
            err = None
            try:
                _hook("allocate")
                if backend == "host":
                    flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
                    m.own_fd = os.memfd_create("sdcp-arena", flags)
                    os.ftruncate(m.own_fd, stride)
                    if hasattr(fcntl, "F_ADD_SEALS"):  # peers can neither shrink nor grow it
                        fcntl.fcntl(m.own_fd, fcntl.F_ADD_SEALS,
                                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                else:
                    pushed = m.push_ctx()
                    try:
                        m.own_handle = _cu("cuMemCreate", stride,
                                           _cuda_alloc_prop(cuda_info["index"]), 0)
                        m.own_fd = int(_cu("cuMemExportToShareableHandle", m.own_handle,
                                           _fd_handle_type(), 0))
                    finally:
                        if pushed:
                            m.pop_ctx()
            except Exception as e:  # noqa: BLE001
                err = e
            self._agree("allocate", err)

            # 3. exchange descriptors; the sockets and their directory go as soon as it is over
            err = None
            try:
                _hook("exchange")
                if N > 1:
                    received = _exchange_fds(listener, m.own_fd, me, N, stride,
                                             [p["pid"] for p in plans],
                                             [p["socket"] for p in plans], os.getuid(),
                                             self.timeout_s)
            except Exception as e:  # noqa: BLE001
                err = e
            finally:
                if listener is not None:
                    listener.close()
                    listener = None
                _remove_socket_dir(sock_dir, sock_path)
                sock_dir = sock_path = None
            self._agree("exchange", err)

            # 4. map every rank's memory, zero ours, synchronise; the gather is the barrier
            err = None
            try:
                _hook("map")
                fds = dict(received)
                fds[me] = m.own_fd
                if backend == "host":
                    self._map_host(m, fds)
                else:
                    self._map_cuda(m, fds, cuda_info)
                self.base_address = m.host_base or m.cu_base
                self._base_u8 = _byte_tensor(self.base_address, N * stride, self.device, m)
            except Exception as e:  # noqa: BLE001
                err = e
            finally:
                for f in received.values():
                    os.close(f)
                received = {}
                # host: the mapping keeps the memfd alive; cuda: every peer has imported the
                # exported fd, and we map our own allocation handle
                m.close_own_fd()
            self._agree("map", err)

            # 5. capability gate: write-and-verify probe through the mapping
            self._probe(plans, m)
        except BaseException:
            self._base_u8 = None
            if listener is not None:
                listener.close()
            _remove_socket_dir(sock_dir, sock_path)
            for f in received.values():
                try:
                    os.close(f)
                except OSError:
                    pass
            m.release()
            raise
        m.ref()  # the arena's reference
        self._mapping = m
        self._closed = False

    def _map_host(self, m: _Mapping, fds: Dict[int, int]) -> None:
        N, stride = self.world_size, self.stride
        m.host_base = _libc_mmap(None, N * stride, _PROT_NONE,
                                 _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        for r in range(N):
            size = os.fstat(fds[r]).st_size
            if size < stride:
                raise RuntimeError(f"the shared memory of rank {r} has {size} bytes, expected "
                                   f"at least {stride}")
            addr = m.host_base + r * stride
            got = _libc_mmap(addr, stride, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED,
                             fds[r])
            if got != addr:
                raise RuntimeError(f"mmap(MAP_FIXED) placed rank {r} at 0x{got:x}, expected "
                                   f"0x{addr:x}")
        ctypes.memset(m.host_base + self.rank * stride, 0, stride)

    def _map_cuda(self, m: _Mapping, fds: Dict[int, int], cuda_info) -> None:
        drv = _driver()
        N, stride, me = self.world_size, self.stride, self.rank
        pushed = m.push_ctx()
        try:
            m.cu_base = int(_cu("cuMemAddressReserve", N * stride, cuda_info["granularity"], 0, 0))
            m.reserved = True
            for r in range(N):
                if r == me:
                    _cu("cuMemMap", m.cu_base + r * stride, stride, 0, m.own_handle, 0)
                    m.mapped.append(r)
                    continue
                h = _cu("cuMemImportFromShareableHandle", fds[r], _fd_handle_type())
                try:
                    _cu("cuMemMap", m.cu_base + r * stride, stride, 0, h, 0)
                    m.mapped.append(r)
                finally:
                    try:
                        _cu("cuMemRelease", h)  # the mapping keeps the imported allocation alive
                    except Exception as e:  # noqa: BLE001
                        logger.warning("torch_sdcp: PeerArena rank %d: cuMemRelease of the "
                                       "handle imported from rank %d failed: %s", me, r, e)
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = cuda_info["index"]
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _cu("cuMemSetAccess", m.cu_base, N * stride, [desc], 1)
            _cu("cuMemsetD8", m.cu_base + me * stride, 0, stride)
            _cu("cuCtxSynchronize")
        finally:
            if pushed:
                m.pop_ctx()

    def _raw_words(self, r: int, offset: int, count: int) -> torch.Tensor:
        start = r * self.stride + offset
        return self._base_u8[start:start + 8 * count].view(torch.int64)

    def _sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.device)

    def _probe(self, plans, m: _Mapping) -> None:
        N, me, stride = self.world_size, self.rank, self.stride
        tail = stride - 8 * N if stride >= 16 * N else None
        # write: word(me, dst) at 8*me of the head and of the tail of every region
        err = None
        try:
            _hook("probe")
            for dst in range(N):
                for off in (0, tail):
                    if off is not None:
                        self._raw_words(dst, off, N)[me:me + 1].fill_(_word(me, dst))
            self._sync()
        except Exception as e:  # noqa: BLE001
            err = RuntimeError(f"probe write through the mapping failed: {e}")
        self._agree("probe write", err)
        # verify our region, re-zero the probe words, check peer capabilities
        err = None
        atomics: Optional[bool] = True
        try:
            bad = []
            for off in (0, tail):
                if off is None:
                    continue
                words = self._raw_words(me, off, N)
                got = words.cpu().tolist()
                for src in range(N):
                    want = _word(src, me)
                    if got[src] != want:
                        bad.append(f"word of rank {src} at offset {off + 8 * src}: got "
                                   f"0x{got[src] & (2**64 - 1):016x}, expected 0x{want:016x}")
                words.zero_()
            self._sync()
            if bad:
                raise RuntimeError("write-and-verify probe: stores through the peer mapping did "
                                   "not arrive (" + "; ".join(bad) + ")")
            if self.backend == "cuda":
                atomics = self._cuda_peer_checks(plans, m)
        except Exception as e:  # noqa: BLE001
            err = e
        extras = self._agree("probe verify", err, atomics)
        if self.backend == "cuda":
            self.native_peer_atomics = (None if any(a is None for a in extras)
                                        else all(extras))
        else:
            self.native_peer_atomics = True

    def _cuda_peer_checks(self, plans, m: _Mapping) -> Optional[bool]:
        """cuDeviceCanAccessPeer (required) and native atomics (recorded) towards every peer GPU
        visible in this process. Returns True/False for atomics, None if some peer GPU is not
        visible here (then only the probe vouches for the path)."""
        drv = _driver()
        mine = plans[self.rank]["cuda"]
        atomics: Optional[bool] = True
        for r, p in enumerate(plans):
            c = p["cuda"]
            if r == self.rank or c["uuid"] == mine["uuid"]:
                continue
            ordinal = mine["visible"].get(c["uuid"])
            if ordinal is None:
                atomics = None
                continue
            peer_dev = _cu("cuDeviceGet", ordinal)
            if not _cu("cuDeviceCanAccessPeer", m.cu_dev, peer_dev):
                raise RuntimeError(f"cuDeviceCanAccessPeer: GPU {mine['uuid']} cannot access the "
                                   f"GPU of rank {r} ({c['uuid']})")
            native = _cu("cuDeviceGetP2PAttribute",
                         drv.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                         m.cu_dev, peer_dev)
            if not native and atomics is not None:
                atomics = False
        return atomics

    # ---------------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

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

    def _view_geometry(self, what: str, dtype, shape, offset) -> Tuple[torch.dtype, Tuple[int, ...], int]:
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"torch_sdcp: argument 'dtype' of PeerArena.{what}: expected a "
                             f"torch.dtype, got {dtype!r}")
        itemsize = dtype.itemsize
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected an "
                             f"int number of bytes, got {offset!r}")
        if not 0 <= offset <= self.nbytes_per_rank:
            raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected a byte "
                             f"offset in [0, {self.nbytes_per_rank}] (nbytes_per_rank), got {offset}")
        if offset % itemsize:
            raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected a "
                             f"multiple of {itemsize} (the itemsize of {dtype}), got {offset}")
        if shape is None:
            shape = ((self.nbytes_per_rank - offset) // itemsize,)
        else:
            if isinstance(shape, int) and not isinstance(shape, bool):
                shape = (shape,)
            try:
                shape = tuple(shape)
                ok = all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"torch_sdcp: argument 'shape' of PeerArena.{what}: expected a "
                                 f"sequence of non-negative ints, got {shape!r}")
            need = math.prod(shape) * itemsize
            if offset + need > self.nbytes_per_rank:
                raise ValueError(
                    f"torch_sdcp: argument 'shape' of PeerArena.{what}: expected at most "
                    f"{self.nbytes_per_rank - offset} bytes (nbytes_per_rank {self.nbytes_per_rank} "
                    f"minus offset {offset}), got shape {list(shape)} of {dtype} = {need} bytes")
        return dtype, shape, offset

    @staticmethod
    def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(strides))

    def _region_view(self, rank: int, what: str, dtype, shape, offset) -> torch.Tensor:
        dtype, shape, offset = self._view_geometry(what, dtype, shape, offset)
        itemsize = dtype.itemsize
        full = self._base_u8.view(dtype)
        return full.as_strided(shape, self._contiguous_strides(shape),
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
        dtype, shape, offset = self._view_geometry("rank_major_view", dtype, shape, offset)
        itemsize = dtype.itemsize
        full = self._base_u8.view(dtype)
        return full.as_strided((self.world_size,) + shape,
                               (self.stride // itemsize,) + self._contiguous_strides(shape),
                               offset // itemsize)

    def barrier(self) -> None:
        """Barrier over the group (host-side; bounded by timeout_s). Does not synchronise the
        device."""
        self._check_open("barrier")
        _group_barrier(self._group, self.timeout_s)

    def close(self, barrier: bool = True) -> None:
        """Idempotent. Synchronise the device, barrier over the group (if `barrier`, the process
        group is still initialised and the interpreter is not exiting; failures are logged), then
        release locally: the memory is unmapped and freed now if no view is alive, else when the
        last view is released."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self.backend == "cuda" and self._mapping is not None:
                self._mapping.cuda_synchronize()
            if barrier and not _interpreter_exiting() and dist.is_available() and dist.is_initialized():
                _group_barrier(self._group, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.warning("torch_sdcp: PeerArena rank %d: close() could not synchronise with "
                           "the group (%s); releasing locally", self.rank, e)
        finally:
            self._release_local()

    def _release_local(self) -> None:
        self._base_u8 = None  # drops the storage reference unless views keep it alive
        m, self._mapping = self._mapping, None
        if m is not None:
            m.unref()

    def __del__(self) -> None:
        # Local only: no barrier, nothing collective from a destructor.
        try:
            if not getattr(self, "_closed", True):
                self._closed = True
                self._release_local()
        except BaseException:  # noqa: BLE001
            pass

    def __enter__(self) -> "PeerArena":
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
