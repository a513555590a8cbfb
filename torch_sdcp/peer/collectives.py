"""Collectives over the arena's process group, every wait bounded by a timeout, and the
agreement that makes every failure of a creation step collective."""

from __future__ import annotations

import datetime
import pickle
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


def _collective_device(group) -> torch.device:
    try:
        backend = str(dist.get_backend(group))
    except Exception:
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


def _collective_error(stage: str, failures: Dict[int, Tuple[str, str]]) -> Exception:
    """The error every rank raises when `failures` ({rank: (class name, message)}) failed
    `stage`: the class of the lowest failing rank, the messages of all of them."""
    first = min(failures)
    cls = _EXC_TYPES.get(failures[first][0], RuntimeError)
    detail = "; ".join(f"rank {r}: {failures[r][1]}" for r in sorted(failures))
    return cls(f"torch_sdcp: PeerArena creation failed at step '{stage}': {detail}")


class _Agreement:
    """After each creation step every rank gathers every rank's status, so that all ranks raise
    the same error and none hangs; a gather that fails or times out is an error too."""

    def __init__(self, group, rank: int, timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.timeout_s = timeout_s

    def _gather(self, stage: str, obj, own_status: Optional[Tuple[str, str]]) -> list:
        try:
            gathered = _all_gather_obj(self.group, (stage, obj), self.timeout_s)
        except Exception as e:
            extra = f"; this rank's own status: {own_status[1]}" if own_status else ""
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

    def agree(self, stage: str, local_error: Optional[BaseException], extra=None) -> list:
        """Gather (status, extra) from every rank; raise the same error everywhere if any rank
        failed; return the extras."""
        status = None if local_error is None else _describe(local_error)
        gathered = self._gather(stage, (status, extra), status)
        failures = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
        if failures:
            raise _collective_error(stage, failures)
        return [x for _, x in gathered]
