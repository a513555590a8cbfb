"""Collectives over the arena's process group, every wait bounded by a timeout."""

from __future__ import annotations

import datetime
import pickle
from typing import Tuple

import torch
import torch.distributed as dist


def _collective_device(group) -> torch.device:
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001
        backend = "gloo"
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work, timeout_s: float) -> None:
    ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    if ok is False:
        raise TimeoutError(f"collective did not complete within {timeout_s} s")


def _all_gather_obj(group, obj, timeout_s: float) -> list:
    """all_gather_object with a bounded wait (all_gather_object has no timeout). The bound holds
    for groups whose collectives run on gloo (CPU tensors); on an NCCL-only group the tensors are
    on the current CUDA device and a dead peer is caught by NCCL's own timeout/watchdog."""
    world_size = dist.get_world_size(group)
    dev = _collective_device(group)
    data = pickle.dumps(obj)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    _wait(dist.all_gather(sizes, n, group=group, async_op=True), timeout_s)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    outs = [torch.empty(max(lengths), dtype=torch.uint8, device=dev) for _ in range(world_size)]
    _wait(dist.all_gather(outs, buf, group=group, async_op=True), timeout_s)
    return [pickle.loads(bytes(o[:k].cpu().tolist())) for o, k in zip(outs, lengths)]


def _group_barrier(group, timeout_s: float) -> None:
    t = torch.zeros(1, dtype=torch.int32, device=_collective_device(group))
    _wait(dist.all_reduce(t, group=group, async_op=True), timeout_s)
    t.item()  # NCCL's wait() only orders the current stream: block the host too

_EXC_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError,
              "PermissionError": PermissionError, "RuntimeError": RuntimeError}


def _describe(e: BaseException) -> Tuple[str, str]:
    """(exception class name, message) of a local failure, as gathered from every rank."""
    name = type(e).__name__
    if name in _EXC_TYPES:
        return name, str(e) or repr(e)
    return "RuntimeError", f"{name}: {e}"

