"""The table of boundaries the engine faces build (:data:`BOUNDARIES`, one row
per family record with an ``integration``, torch_sdcp/families.py): the
geometry that keys each workspace, how to build that workspace, how a log
names it; and the builders themselves."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torch_sdcp.families import FAMILIES

__all__ = ["BOUNDARIES", "DEFAULT_MAX_ROWS", "OUTPUT_DTYPES", "Boundary", "geometry_key", "query_direct"]

#: Rows bound of a workspace a face creates on first use (the reference decode bound).
DEFAULT_MAX_ROWS = 128

#: Dtypes of the partial outputs the Output/LSE boundary combines.
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def query_direct(width: int, dtype: torch.dtype) -> bool:
    """Whether a gather-only query (``rope_dim=0``) runs on a QueryWorkspace
    (data-as-flag, final layout, 1x bytes): a dtype whose all-ones element is
    NaN and heads of whole 16-byte vectors. Anything else (float8_e4m3fnuz,
    raw bytes, odd widths) takes a tagged ExchangeWorkspace, which moves any
    bytes."""
    from torch_sdcp import ops

    return dtype in ops.QUERY_GATHER_DTYPES and width * _element_size(dtype) % 16 == 0


def _exchange(pg, max_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.ExchangeWorkspace(pg, max_rows * math.prod(row_shape) * _element_size(dtype), **options)


def _build_all_gather(pg, max_rows: int, g: dict, **options) -> Any:
    return _exchange(pg, max_rows, g["row_shape"], g["dtype"], **options)


def _build_query(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    if g["rope_dim"] == 0 and not query_direct(g["nope_dim"], g["out_dtype"]):
        return _exchange(pg, max_rows, (g["local_heads"], g["nope_dim"]), g["out_dtype"], **options)
    return torch_sdcp.QueryWorkspace(pg, max_rows, g["local_heads"], nope_dim=g["nope_dim"], rope_dim=g["rope_dim"],
                                     dtype=g["out_dtype"], rope_style=g["rope_style"], **options)


def _build_output_lse(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.OutputLSEWorkspace(pg, max_rows, g["total_heads"], g["head_dim"], dtype=g["dtype"], **options)


def _build_topk(pg, max_rows: int, g: dict, **options) -> Any:
    import torch_sdcp

    return torch_sdcp.TopKWorkspace(pg, max_rows, g["k"], candidates_per_rank=g["candidates_per_rank"], **options)


class Boundary(NamedTuple):
    """One row of :data:`BOUNDARIES`."""

    label: str  # how logs name it
    geometry: tuple[str, ...]  # the fields that key its workspace, in key order
    build: Callable[..., Any]  # (bootstrap group, max_rows, geometry dict, **workspace options) -> workspace
    summary: Callable[[dict], str]  # the geometry in a log line


# The faces' part of each family's boundary, keyed by the family record's ``integration``.
_FACE_ROWS: dict[str, Boundary] = {
    "all_gather": Boundary("exchange", ("row_shape", "dtype"), _build_all_gather,
                           lambda g: f"rows {list(g['row_shape'])} of {g['dtype']}"),
    # rope_dim=0: a gather-only query (a query produced by the engine).
    "query": Boundary("query", ("local_heads", "nope_dim", "rope_dim", "out_dtype", "rope_style"), _build_query,
                      lambda g: f"{g['local_heads']} heads x {g['nope_dim'] + g['rope_dim']} of {g['out_dtype']}"),
    "output_lse": Boundary("Output/LSE", ("total_heads", "head_dim", "dtype"), _build_output_lse,
                           lambda g: f"{g['total_heads']} heads x {g['head_dim']} of {g['dtype']}"),
    "topk": Boundary("top-K", ("k", "candidates_per_rank"), _build_topk,
                     lambda g: f"k={g['k']} over {g['candidates_per_rank']} local candidates"),
}

#: The boundaries the faces build, one per family record with an ``integration`` (torch_sdcp.families),
#: in family order: a family is a record plus its files, and its row here.
BOUNDARIES: dict[str, Boundary] = {f.integration: _FACE_ROWS[f.integration] for f in FAMILIES if f.integration}
if set(_FACE_ROWS) != set(BOUNDARIES):  # a row that no family names
    raise ImportError(f"torch_sdcp.integrations: boundary rows {sorted(set(_FACE_ROWS) - set(BOUNDARIES))} have "
                      "no family record (torch_sdcp.families)")



def geometry_key(kind: str, geometry: dict) -> tuple:
    """``geometry`` as a cache key: its items, in the order of its row's fields (checked)."""
    fields = BOUNDARIES[kind].geometry
    if tuple(geometry) != fields:
        raise AssertionError(f"torch_sdcp: the {kind} geometry is {fields}, got {tuple(geometry)}")
    return tuple(geometry.items())
