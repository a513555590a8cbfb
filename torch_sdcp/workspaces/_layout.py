"""The workspace families and one rank's region as the C++ layout
(csrc/sdcp.h) lays it out, with its values named."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch


class WorkspaceKind(enum.IntEnum):
    """The workspace families; the values are those of the C++ side
    (``WorkspaceKind`` in csrc/sdcp.h)."""

    EXCHANGE = 0
    OUTPUT_LSE = 1
    TOPK = 2
    QUERY = 3


class WorkspaceLayout(NamedTuple):
    """One rank's region as the C++ side lays it out (csrc/sdcp.h), identical
    on every rank: control (the data-as-flag call counters and abort word,
    4 KiB) in ``[0, control_bytes)``, then ``slots`` data slots of
    ``slot_bytes`` from ``data_offset``; ``region_bytes`` includes the tail pad,
    before granularity rounding. ``part_offsets`` are the family's values inside
    one slot; each workspace class names them in ``PARTS``."""

    control_bytes: int
    data_offset: int
    slots: int
    slot_bytes: int
    region_bytes: int
    part_offsets: tuple[int, ...]


def workspace_layout(kind: WorkspaceKind, params: Sequence[int], world_size: int) -> WorkspaceLayout:
    """``torch.ops.sdcp.workspace_layout``, whose flat list follows the field
    order of ``WorkspaceLayout``, with its values named."""
    values = torch.ops.sdcp.workspace_layout(int(kind), list(params), world_size)
    fixed = len(WorkspaceLayout._fields) - 1
    return WorkspaceLayout._make([*values[:fixed], tuple(values[fixed:])])
