"""The geometry of a PeerArena's views: checked dtype, shape and byte offset in a region."""

from __future__ import annotations

import math
from typing import Any

import torch


def view_geometry(nbytes_per_rank: int, what: str, dtype: Any, shape: Any,
                  offset: Any) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, offset) of a view of ``shape`` elements of ``dtype`` from byte ``offset``
    of a region of ``nbytes_per_rank`` bytes, checked (shape None: the rest of the region)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch_sdcp: argument 'dtype' of PeerArena.{what}: expected a "
                         f"torch.dtype, got {dtype!r}")
    itemsize = dtype.itemsize
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected an "
                         f"int number of bytes, got {offset!r}")
    if not 0 <= offset <= nbytes_per_rank:
        raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected a byte "
                         f"offset in [0, {nbytes_per_rank}] (nbytes_per_rank), got {offset}")
    if offset % itemsize:
        raise ValueError(f"torch_sdcp: argument 'offset' of PeerArena.{what}: expected a "
                         f"multiple of {itemsize} (the itemsize of {dtype}), got {offset}")
    if shape is None:
        shape = ((nbytes_per_rank - offset) // itemsize,)
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
        if offset + need > nbytes_per_rank:
            raise ValueError(
                f"torch_sdcp: argument 'shape' of PeerArena.{what}: expected at most "
                f"{nbytes_per_rank - offset} bytes (nbytes_per_rank {nbytes_per_rank} "
                f"minus offset {offset}), got shape {list(shape)} of {dtype} = {need} bytes")
    return dtype, shape, offset

def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
