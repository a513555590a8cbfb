"""What every competitor shares: torch's symmetric memory with NVLink
multicast off, the default group, and the element offsets of peer buffers."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _symmetric_memory():
    """torch's symmetric memory with NVLink multicast off (set before the first
    rendezvous of the process)."""
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("torch_sdcp competitors: initialise torch.distributed first")
    return group


def _enable_for_group(symm_mem, group) -> None:
    # Older torch needs this call; the torch this project builds against
    # (2.11 on) deprecates it as no longer needed, with a FutureWarning that
    # every benchmark run would print.
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def element_offsets(peers, local: Tensor, device) -> Tensor:
    """int64 [N] element offsets of every rank's buffer from ``local``'s, each a
    multiple of 16 bytes (the kernels move 16-byte vectors)."""
    es = local.element_size()
    offs = []
    for p in peers:
        delta = p.data_ptr() - local.data_ptr()
        if delta % 16:
            raise RuntimeError(f"symmetric buffers are not 16-byte aligned to each other (offset {delta} bytes)")
        offs.append(delta // es)
    return torch.tensor(offs, dtype=torch.int64, device=device)


def check_partials(who: str, partial_out: Tensor, total_heads: int, head_dim: int, dtype: torch.dtype,
                   max_rows: int) -> None:
    """An Output/LSE competitor's ``partial_out``: [T, total_heads, head_dim] of ``dtype``, T <= max_rows."""
    if partial_out.shape[1:] != (total_heads, head_dim) or partial_out.dtype != dtype:
        raise ValueError(f"{who}: argument 'partial_out': expected [T, {total_heads}, {head_dim}] {dtype}, got "
                         f"{list(partial_out.shape)} {partial_out.dtype}")
    if partial_out.size(0) > max_rows:
        raise ValueError(f"{who}: argument 'partial_out': expected at most {max_rows} rows, got "
                         f"{partial_out.size(0)}")
