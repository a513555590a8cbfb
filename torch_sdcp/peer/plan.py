"""The creation plan of a PeerArena: argument checks, what each rank publishes, and the choice of
the backend and stride, made on the gathered plans (identical on every rank, so is the choice)."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from typing import Any

import torch

from .backend import MemoryBackend
from .cuda_vmm import CudaVmmBackend
from .host_shm import HostShmBackend

logger = logging.getLogger("torch_sdcp")

# Every backend, in the order backend "auto" tries them; the last one is the fallback.
BACKENDS: tuple[type[MemoryBackend], ...] = (CudaVmmBackend, HostShmBackend)
_BY_NAME = {b.name: b for b in BACKENDS}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_id(kind: str) -> int | None:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return None


def _check_arguments(nbytes_per_rank, backend, device, timeout_s) -> torch.device | None:
    if isinstance(nbytes_per_rank, bool) or not isinstance(nbytes_per_rank, int):
        raise TypeError("torch_sdcp: argument 'nbytes_per_rank': expected an int, got "
                        f"{type(nbytes_per_rank).__name__}")
    if nbytes_per_rank <= 0:
        raise ValueError("torch_sdcp: argument 'nbytes_per_rank': expected a positive "
                         f"number of bytes, got {nbytes_per_rank}")
    if backend != "auto" and backend not in tuple(_BY_NAME):
        names = ["auto"] + list(_BY_NAME)
        expected = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
        raise ValueError(f"torch_sdcp: argument 'backend': expected {expected}, "
                         f"got {backend!r}")
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError("torch_sdcp: argument 'timeout_s': expected a positive finite "
                         f"number of seconds, got {timeout_s!r}")
    if device is None:
        return None
    device = torch.device(device)
    if backend != "auto":
        _BY_NAME[backend].check_device(device)
    elif device.type not in {b.device_type for b in BACKENDS}:
        # "auto" prefers the first backend: ask for its device
        raise ValueError(f"torch_sdcp: argument 'device': expected a {BACKENDS[0].device_type} "
                         f"device, got {device}")
    return device


def local_plan(rank: int, world_size: int, nbytes_per_rank, backend, device,
               allow_shared_device: bool, timeout_s,
               candidates: dict[str, MemoryBackend]) -> dict[str, Any]:
    """Check the arguments and plan every backend this rank could use; the backend objects
    are put in `candidates` (the caller releases them)."""
    device = _check_arguments(nbytes_per_rank, backend, device, timeout_s)
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"torch_sdcp: PeerArena needs Linux, this is {sys.platform}")
    plan: dict[str, Any] = {
        "nbytes_per_rank": nbytes_per_rank, "backend": backend,
        "allow_shared_device": allow_shared_device,
        "host": (socket.gethostname(), _boot_id()), "uid": os.getuid(), "pid": os.getpid(),
        "ns": (_ns_id("pid"), _ns_id("mnt")), "backends": {}, "socket": None,
    }
    for cls in (BACKENDS if backend == "auto" else (_BY_NAME[backend],)):
        if backend == "auto" and not cls.wanted_for_auto(device):
            continue
        candidates[cls.name] = b = cls(rank, world_size)
        try:
            plan["backends"][cls.name] = b.local_plan(nbytes_per_rank, device)
        except Exception as e:
            if backend != "auto":
                raise
            logger.info("torch_sdcp: PeerArena rank %d: %s unusable for backend 'auto' (%s); "
                        "the %s backend is used if any rank cannot use %s",
                        rank, cls.label, e, BACKENDS[-1].name, cls.label)
    return plan


class RankMismatchError(ValueError):
    """A value that must be equal on every rank differs (raised on every rank alike)."""


def verdict(plans: list[dict[str, Any]]) -> tuple[str, int]:
    """(backend, stride) from the gathered plans, or the error every rank raises."""

    agreed = [p.get("agree") or {} for p in plans]
    names = list(agreed[0]) + [k for a in agreed[1:] for k in a if k not in agreed[0]]
    differ = []
    for name in names:
        vals = [a.get(name) for a in agreed]
        if any(v != vals[0] for v in vals):
            differ.append(f"argument '{name}' (" + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals)) + ")")
    if differ:
        raise RankMismatchError("torch_sdcp: workspace creation: expected the same value on every rank, got "
                                "different values of " + "; ".join(differ))

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
    # An explicit backend was planned on every rank (local_plan raised otherwise); "auto" takes
    # the first one planned on every rank whose gathered plans it accepts.
    for cls in (BACKENDS if requested == "auto" else (_BY_NAME[requested],)):
        infos = [p["backends"].get(cls.name) for p in plans]
        if any(i is None for i in infos):
            continue
        error = cls.plans_error(infos, allow_shared)
        if error is None:
            break
        if requested != "auto":
            raise error
    else:
        raise RuntimeError("torch_sdcp: PeerArena: no backend is usable on every rank")
    strides = [i["stride"] for i in infos]
    if any(s != strides[0] for s in strides):
        got = ", ".join(f"rank {r}: {s}" for r, s in enumerate(strides))
        raise RuntimeError("torch_sdcp: PeerArena: the stride (nbytes_per_rank rounded up to "
                           f"the allocation granularity) differs between ranks: got {got}")
    return cls.name, strides[0]
