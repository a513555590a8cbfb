"""One rank's region as the C++ layout (csrc/sdcp.h) lays it out, with its
values named (``WorkspaceKind`` lives with the family records,
torch_sdcp/families.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from torch_sdcp.families import WorkspaceKind

__all__ = ["WorkspaceKind", "WorkspaceLayout", "workspace_layout"]


class WorkspaceLayout(NamedTuple):
    """One rank's region as the C++ side lays it out (csrc/sdcp.h), identical
    on every rank: control (the data-as-flag call counters and abort word,
    4 KiB) in ``[0, control_bytes)``, then ``slots`` data slots of
    ``slot_bytes`` from ``data_offset`` (a data slot is one buffer of peer
    entries, or the query's view and buffers together; docs/PROTOCOL.md);
    ``region_bytes`` includes the tail pad, before granularity rounding.
    ``part_values`` are the family's values inside one data slot (offsets,
    strides, counts: C++ ``part_values``); each family's record names them
    (``PARTS``)."""

    control_bytes: int
    data_offset: int
    slots: int
    slot_bytes: int
    region_bytes: int
    part_values: tuple[int, ...]


def workspace_layout(kind: WorkspaceKind, params: Sequence[int], world_size: int) -> WorkspaceLayout:
    """``torch.ops.sdcp.workspace_layout``, whose flat list follows the field
    order of ``WorkspaceLayout``, with its values named."""
    values = torch.ops.sdcp.workspace_layout(int(kind), list(params), world_size)
    fixed = len(WorkspaceLayout._fields) - 1
    return WorkspaceLayout._make([*values[:fixed], tuple(values[fixed:])])
