"""A face's group, resolved (:func:`engine_group`: its cache key, the process
group its workspaces bootstrap over, its world and this rank), and the
device a call names (:func:`normalise_device`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torch_sdcp._checks import arg_error

__all__ = ["Group", "engine_group", "normalise_device"]


class Group(NamedTuple):
    """A face's group, resolved: the cache key, the process group workspaces
    bootstrap over, the world size and (a callable for) this rank."""

    key: Any
    pg: Any
    world: int
    rank_of: Callable[[], int]

    @property
    def rank(self) -> int:
        return self.rank_of()


def engine_group(group: Any, via: str, arg: str) -> Group:
    """``group`` as a face bootstraps over it (its cache key, bootstrap
    process group, world and rank). ``via="device_group"``: a
    ProcessGroup, None (the default group) or an object with a
    ``device_group`` ProcessGroup; keyed by ``group_name``, which torch.compile
    traces (``id(group)`` it does not). ``via="cpu_group"``: a ProcessGroup
    (or None), or a vLLM-style GroupCoordinator bootstrapped over its
    ``cpu_group`` (gloo) and keyed by its ``unique_name``."""
    if via == "device_group":
        if not dist.is_initialized():
            raise RuntimeError("torch_sdcp: the integrations need an initialised torch.distributed "
                               "(call torch.distributed.init_process_group first)")
        if group is None:
            if dist.group.WORLD is None:
                raise RuntimeError("torch_sdcp: the integrations need an initialised default process group")
            pg = dist.group.WORLD
        elif isinstance(group, dist.ProcessGroup):
            pg = group
        elif isinstance(getattr(group, "device_group", None), dist.ProcessGroup):
            pg = group.device_group
        else:
            raise arg_error(arg, "a torch.distributed ProcessGroup, None, or an object with a 'device_group' "
                            "ProcessGroup (a vLLM GroupCoordinator)", type(group).__name__)
        return Group(pg.group_name, pg, dist.get_world_size(pg), lambda: dist.get_rank(pg))
    if isinstance(group, dist.ProcessGroup) or group is None:
        return Group(("pg", id(group)), group, dist.get_world_size(group), lambda: dist.get_rank(group))
    cpu = getattr(group, "cpu_group", None)
    if cpu is None:
        raise TypeError(f"torch_sdcp: argument '{arg}': expected a vLLM GroupCoordinator (with a cpu_group) "
                        f"or a ProcessGroup, got {type(group).__name__}")
    name = getattr(group, "unique_name", None)
    rank = int(group.rank_in_group)
    return Group(("coordinator", name if name is not None else id(group)), cpu, int(group.world_size), lambda: rank)


def normalise_device(device: torch.device | str | None) -> torch.device:
    """None: the current CUDA device, or cpu without CUDA; a cuda device
    without index: the current one."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise arg_error("device", "a torch.device, a device string or None", repr(device)) from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise arg_error("device", "a cpu or cuda device", device)
    return device
