"""Drop-in adapters for the DCP call sites of serving engines.

Each adapter has the call shape of the collective it replaces and resolves its
workspace from the group and the geometry of its inputs through the process-local
cache of the integration core (:mod:`torch_sdcp.integrations._face`; this
module is its engine-agnostic face):

- ``all_gather(x, group, dim)``: ``dcp_group.all_gather(x, dim)``
  (``ExchangeWorkspace``);
- ``query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, group=...)``:
  RoPE + concat + quantisation of the decode query, then
  ``all_gather(q, dim=1)`` (``QueryWorkspace``);
- ``cp_lse_ag_out_rs(out, lse, group, ctx, return_lse, is_lse_base_on_e)``:
  vLLM's function of that name (``OutputLSEWorkspace``);
- ``topk_merge(scores, ids, group, k)``: an all_gather of the ``(score, id)``
  candidates, then a top-k (``TopKWorkspace``).

Workspace creation is collective (every rank of the group, same order) and must
happen outside CUDA-graph capture and outside ``torch.compile`` tracing. Engines
call the ``prepare_*`` functions at model load; an adapter whose workspace was
not prepared creates it on first use with ``max_rows=DEFAULT_MAX_ROWS``, and
raises ``RuntimeError`` naming the missing ``prepare_*`` call when that first use
is inside capture or tracing. ``teardown()`` closes every cached workspace
(collective, idempotent).

Every adapter takes a keyword-only ``tag``: the call tag of its peer call
(None, or an int in [0, 2**23 - 1), e.g. the layer index; docs/PROTOCOL.md
"Failure behaviour"), checked before any path is taken.

Rows are dimension 0 of every input (decode tokens). A call with more rows than
the workspace's ``max_rows`` runs the collective path of
:mod:`torch_sdcp.collective` and logs it once per workspace and row count
(logger ``torch_sdcp``), the workspaces' own policy (``PeerWorkspace``).

``group`` is a ``torch.distributed`` process group, ``None`` (the default
group), or an object with a ``device_group`` process group attribute (a vLLM
``GroupCoordinator``; its ``device_group`` is used).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import collective, ops
from torch_sdcp._checks import arg_error, call_tag, check_bool, check_dim, check_dtype, check_int, check_tensor
from torch_sdcp.integrations._boundaries import DEFAULT_MAX_ROWS, OUTPUT_DTYPES
from torch_sdcp.integrations._cache import Entry
from torch_sdcp.integrations._face import Face, Seam, Site
from torch_sdcp.integrations._groups import normalise_device

__all__ = [
    "DEFAULT_MAX_ROWS",
    "MLADCPWorkspaces",
    "all_gather",
    "cp_lse_ag_out_rs",
    "prepare_all_gather",
    "prepare_mla_dcp",
    "prepare_output_lse",
    "prepare_query_gather",
    "prepare_topk",
    "query_gather",
    "teardown",
    "topk_merge",
    "workspaces",
]

logger = logging.getLogger("torch_sdcp")

GroupLike = Any  # Optional[dist.ProcessGroup], or an object with a ``device_group`` attribute

_WORKSPACE_OPTIONS = ("timeout_s", "allow_shared_device", "fallback")

# Bootstraps over a coordinator's device_group; a call without a workspace creates it.
_face = Face("dcp", via="device_group", create_missing=True, make_logger=lambda: logger)


def _prepare_call(name: str) -> Callable[[dict], str]:
    """The call that prepares a seam's workspace, named with the geometry (for the error of a call in capture)."""
    return lambda g: f"{name}(group, max_rows=..., " + ", ".join(f"{k}={v!r}" for k, v in g.items()) + ")"


def _rows_over_bound(site: Site, entry: Entry, rows: int) -> None:
    # Collective mode was logged at creation; rows above the bound are logged here, once per workspace and
    # row count.
    if rows not in entry.logged:
        entry.logged.add(rows)
        logger.warning("torch_sdcp all_gather adapter, rank %d: %d rows exceed max_rows=%d; this call takes the "
                       "collective path", site.group.rank, rows, entry.max_rows)


_ALL_GATHER = Seam("all_gather", "all_gather", "the collective", prepare_call=_prepare_call("prepare_all_gather"),
                   over_bound=_rows_over_bound)
_QUERY = Seam("query", "query_gather", prepare_call=_prepare_call("prepare_query_gather"))
_OUTPUT_LSE = Seam("output_lse", "cp_lse_ag_out_rs", prepare_call=_prepare_call("prepare_output_lse"))
_TOPK = Seam("topk", "topk_merge", prepare_call=_prepare_call("prepare_topk"))


def _check_options(options: dict) -> None:
    for name in options:
        if name not in _WORKSPACE_OPTIONS:
            raise TypeError(f"torch_sdcp: unexpected keyword argument '{name}': expected one of "
                            f"{', '.join(_WORKSPACE_OPTIONS)}")


def workspaces() -> list:
    """The workspaces the adapters hold now, in creation order."""
    return _face.workspaces()


def teardown() -> None:
    """Close every cached workspace, in creation order, and empty the cache.

    Collective like ``close()`` (it synchronises and barriers): every rank calls
    it, after the last replay of any CUDA graph that captured an adapter.
    Idempotent. Adapters called afterwards create their workspaces again.
    """
    _face.teardown()


# ---------------------------------------------------------------------------
# all_gather (ExchangeWorkspace)
# ---------------------------------------------------------------------------


def prepare_all_gather(group: GroupLike, *, max_rows: int, row_shape: Sequence[int], dtype: torch.dtype,
                       device: torch.device | str | None = None, **options) -> Any:
    """Create (collectively) the exchange workspace that ``all_gather`` uses for
    inputs ``[T, *row_shape]`` of ``dtype`` with ``T <= max_rows``, or return the
    one already prepared. ``device``: None is the current CUDA device, or cpu
    without CUDA (the host backend). ``options``: ``timeout_s``,
    ``allow_shared_device``, ``fallback`` (see ``PeerWorkspace``)."""
    g = _face.group(group)
    check_int(max_rows, "max_rows", 1)
    if not isinstance(row_shape, (tuple, list, torch.Size)):
        raise arg_error("row_shape", "a sequence of ints", type(row_shape).__name__)
    row_shape = tuple(check_int(s, "row_shape", 1) for s in row_shape)
    check_dtype(dtype, "dtype")
    _check_options(options)
    return _face.prepare("all_gather", g, {"row_shape": row_shape, "dtype": dtype}, normalise_device(device),
                         max_rows, options, "prepare_all_gather")


def all_gather(input_: Tensor, group: GroupLike, dim: int = -1, *, tag: int | None = None) -> Tensor:
    """Every rank's ``input_`` concatenated along ``dim`` (rank-major), the
    result of ``GroupCoordinator.all_gather(input_, dim)`` and of
    ``torch.cat(all_gather list, dim)``; for the query ``[T, H_loc, D]`` with
    ``dim=1``: ``[T, N*H_loc, D]``, head ``src_rank*H_loc + h``.

    Peer path: one ``ExchangeWorkspace.all_gather`` of the contiguous input
    (a non-contiguous input is copied first). Rows ``T = input_.shape[0]``
    above the prepared ``max_rows`` take the collective path (logged).
    """
    x = check_tensor(input_, "input_")
    call_tag(tag)
    if x.dim() == 0:
        raise arg_error("input_", "a tensor with at least one dimension", "a 0-D tensor")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise arg_error("dim", f"an int in [{-x.dim()}, {x.dim()})", repr(dim))
    g = _face.group(group)
    d = dim % x.dim()
    row_shape = tuple(x.shape[1:])
    if math.prod(row_shape) == 0:
        raise arg_error("input_", "non-empty rows", f"shape {list(x.shape)}")
    x = x.contiguous()

    def collective_path():
        # Raw bytes: gloo has no float8 (and not every build has bf16).
        return collective.all_gather_stack(x.view(torch.uint8), g.pg).view(x.dtype)

    ws = _face.workspace_for(_ALL_GATHER, Site(g, {"row_shape": row_shape, "dtype": x.dtype}, x.device), x.shape[0])
    if ws is None:
        stacked = collective_path()  # [N, *x.shape]
    else:
        with _face.counted(_ALL_GATHER):
            stacked = ws.all_gather(x, tag=tag)
    n = stacked.shape[0]
    shape = list(x.shape)
    shape[d] *= n
    return stacked.movedim(0, d).reshape(shape)


# ---------------------------------------------------------------------------
# Query boundary (QueryWorkspace)
# ---------------------------------------------------------------------------


def prepare_query_gather(group: GroupLike, *, max_rows: int, local_heads: int, nope_dim: int = 512,
                         rope_dim: int = 64, out_dtype: torch.dtype = torch.bfloat16,
                         rope_style: str = "interleaved", device: torch.device | str | None = None,
                         **options) -> Any:
    """Create (collectively) the query workspace that ``query_gather`` uses for
    ``ql_nope [T, local_heads, nope_dim]``, ``q_pe [T, local_heads, rope_dim]``
    with ``T <= max_rows``, producing ``out_dtype`` with ``rope_style``; or
    return the one already prepared. ``device`` and ``options`` as in
    ``prepare_all_gather``."""
    g = _face.group(group)
    check_int(max_rows, "max_rows", 1)
    check_int(local_heads, "local_heads", 1)
    check_int(nope_dim, "nope_dim", 1)
    check_int(rope_dim, "rope_dim", 1)
    check_dtype(out_dtype, "out_dtype", *ops.QUERY_DTYPES)
    ops.rope_is_neox(rope_style)
    _check_options(options)
    geometry = {"local_heads": local_heads, "nope_dim": nope_dim, "rope_dim": rope_dim, "out_dtype": out_dtype,
                    "rope_style": rope_style}
    return _face.prepare("query", g, geometry, normalise_device(device), max_rows, options, "prepare_query_gather")


def query_gather(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                 q_scale: Tensor | None = None, *, group: GroupLike,
                 out_dtype: torch.dtype = torch.bfloat16, rope_style: str = "interleaved",
                 tag: int | None = None) -> Tensor:
    """The fused query producer and gather: RoPE (``rope_style``) on
    ``q_pe [T, H_loc, R]``, concatenation after ``ql_nope [T, H_loc, Dn]``,
    bf16 or float8_e4m3fn (``saturate(x / q_scale)``), gathered on heads:
    ``[T, N*H_loc, Dn + R]``, head ``src_rank*H_loc + h``. Bit-identical to
    producing locally and then ``all_gather(q, group, dim=1)``.

    Replaces, at the MLA DCP call site, the RoPE/concat/quantisation of the
    decode query and ``q = dcp_group.all_gather(q, dim=1)``. Workspace:
    ``QueryWorkspace.gather``; rows above the prepared ``max_rows`` take the
    collective path (logged).
    """
    check_dim(ql_nope, "ql_nope", 3)
    check_dim(q_pe, "q_pe", 3)
    check_dtype(out_dtype, "out_dtype", *ops.QUERY_DTYPES)
    ops.rope_is_neox(rope_style)
    call_tag(tag)
    g = _face.group(group)
    local_heads, nope_dim, rope_dim = ql_nope.shape[1], ql_nope.shape[2], q_pe.shape[2]
    geometry = {"local_heads": local_heads, "nope_dim": nope_dim, "rope_dim": rope_dim, "out_dtype": out_dtype,
                    "rope_style": rope_style}
    ws, on_peer = _face.workspace_of(_QUERY, Site(g, geometry, ql_nope.device), ql_nope.shape[0])
    with _face.counted(_QUERY, on_peer):
        return ws.gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, tag=tag)


# ---------------------------------------------------------------------------
# Output/LSE boundary (OutputLSEWorkspace)
# ---------------------------------------------------------------------------

def prepare_output_lse(group: GroupLike, *, max_rows: int, total_heads: int, head_dim: int,
                       dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                       **options) -> Any:
    """Create (collectively) the Output/LSE workspace that ``cp_lse_ag_out_rs``
    uses for partial outputs ``[T, total_heads, head_dim]`` of ``dtype`` with
    ``T <= max_rows``, or return the one already prepared. ``device`` and
    ``options`` as in ``prepare_all_gather``."""
    g = _face.group(group)
    check_int(max_rows, "max_rows", 1)
    check_int(total_heads, "total_heads", 1)
    check_int(head_dim, "head_dim", 1)
    check_dtype(dtype, "dtype", *OUTPUT_DTYPES)
    if total_heads % g.world:
        raise arg_error("total_heads", f"a multiple of the world size {g.world}", total_heads)
    _check_options(options)
    return _face.prepare("output_lse", g, {"total_heads": total_heads, "head_dim": head_dim, "dtype": dtype},
                         normalise_device(device), max_rows, options, "prepare_output_lse")


def cp_lse_ag_out_rs(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: GroupLike, ctx: Any = None,
                     return_lse: bool = False, is_lse_base_on_e: bool = True, *, tag: int | None = None
                     ) -> Tensor | tuple[Tensor, Tensor]:
    """vLLM's ``cp_lse_ag_out_rs`` call shape: ``cp_attn_out [T, H, D]`` and
    ``cp_attn_lse [T, H]`` (fp32) of this rank's KV shard for all ``H`` heads ->
    this rank's heads ``[T, H/N, D]`` of the LSE-corrected sum over the group,
    and with ``return_lse`` their global LSE ``[T, H/N]`` fp32.
    ``is_lse_base_on_e=False`` reads the LSEs as base 2. ``ctx`` (a Triton
    kernel cache in vLLM) is accepted and ignored.

    Workspace: ``OutputLSEWorkspace.combine``: fp32 accumulation, one rounding;
    NaN/+inf LSEs are empty shards; an all-empty row gives 0 and LSE -inf.
    Non-contiguous inputs are copied first. Rows above the prepared
    ``max_rows`` take the collective path (logged).
    """
    check_dim(cp_attn_out, "cp_attn_out", 3)
    check_dim(cp_attn_lse, "cp_attn_lse", 2)
    if tuple(cp_attn_lse.shape) != tuple(cp_attn_out.shape[:2]):
        raise arg_error("cp_attn_lse", f"shape {list(cp_attn_out.shape[:2])} (the first two dimensions of "
                        "'cp_attn_out')", f"shape {list(cp_attn_lse.shape)}")
    check_dtype(cp_attn_out.dtype, "cp_attn_out", *OUTPUT_DTYPES)
    check_bool(return_lse, "return_lse")
    check_bool(is_lse_base_on_e, "is_lse_base_on_e")
    call_tag(tag)
    g = _face.group(cp_group, "cp_group")
    rows, total_heads, head_dim = cp_attn_out.shape
    if total_heads % g.world:
        raise arg_error("cp_attn_out", f"heads (dimension 1) divisible by the world size {g.world}",
                        f"shape {list(cp_attn_out.shape)}")
    dtype = cp_attn_out.dtype
    site = Site(g, {"total_heads": total_heads, "head_dim": head_dim, "dtype": dtype}, cp_attn_out.device)
    ws, on_peer = _face.workspace_of(_OUTPUT_LSE, site, rows)
    with _face.counted(_OUTPUT_LSE, on_peer):
        return ws.combine(cp_attn_out.contiguous(), cp_attn_lse.contiguous(), lse_base="e" if is_lse_base_on_e else "2",
                          return_lse=return_lse, tag=tag)


# ---------------------------------------------------------------------------
# Top-K boundary (TopKWorkspace)
# ---------------------------------------------------------------------------


def prepare_topk(group: GroupLike, *, max_rows: int, k: int, candidates_per_rank: int | None = None,
                 device: torch.device | str | None = None, **options) -> Any:
    """Create (collectively) the top-K workspace that ``topk_merge`` uses for
    candidate shards ``[T, candidates_per_rank]`` (default ``k``) with
    ``T <= max_rows``, selecting ``k``; or return the one already prepared.
    ``device`` and ``options`` as in ``prepare_all_gather``."""
    g = _face.group(group)
    check_int(max_rows, "max_rows", 1)
    check_int(k, "k", 1)
    candidates = k if candidates_per_rank is None else check_int(candidates_per_rank, "candidates_per_rank", 1)
    _check_options(options)
    return _face.prepare("topk", g, {"k": k, "candidates_per_rank": candidates}, normalise_device(device), max_rows,
                         options, "prepare_topk")


def topk_merge(scores: Tensor, ids: Tensor, group: GroupLike, k: int, *, tag: int | None = None) -> Tensor:
    """The global top-``k`` over every rank's candidate shard (``scores [T, C]``
    fp32, global token ``ids [T, C]`` int32, -1 = none): ids ``[T, k]`` int32 in
    selection order (score descending, lower id on ties, NaN below -inf),
    -1 padded, identical on every rank. Replaces an all_gather of the
    candidate pairs followed by a top-k. Workspace: ``TopKWorkspace.merge``;
    rows above the prepared ``max_rows`` take the collective path (logged).
    """
    check_dim(scores, "scores", 2)
    check_dim(ids, "ids", 2)
    check_int(k, "k", 1)
    call_tag(tag)
    g = _face.group(group)
    candidates = scores.shape[1]
    if candidates < 1:
        raise arg_error("scores", "at least one candidate per row", f"shape {list(scores.shape)}")
    ws, on_peer = _face.workspace_of(_TOPK, Site(g, {"k": k, "candidates_per_rank": candidates}, scores.device),
                                     scores.shape[0])
    with _face.counted(_TOPK, on_peer):
        return ws.merge(scores, ids, tag=tag)


# ---------------------------------------------------------------------------
# Everything an MLA DCP model needs, in one call.
# ---------------------------------------------------------------------------


class MLADCPWorkspaces(NamedTuple):
    """The workspaces ``prepare_mla_dcp`` prepared (``topk`` is None without
    ``index_topk``)."""

    query: Any
    output_lse: Any
    topk: Any | None


def prepare_mla_dcp(group: GroupLike, *, max_rows: int, num_heads: int, kv_lora_rank: int = 512,
                    qk_rope_head_dim: int = 64, query_dtype: torch.dtype = torch.bfloat16,
                    output_dtype: torch.dtype = torch.bfloat16, rope_style: str = "interleaved",
                    index_topk: int | None = None, topk_max_rows: int | None = None,
                    device: torch.device | str | None = None, **options) -> MLADCPWorkspaces:
    """Prepare, at model load, every workspace an MLA DCP decode step uses:
    the query boundary (``num_heads / N`` local heads of ``kv_lora_rank +
    qk_rope_head_dim``, produced as ``query_dtype``), the Output/LSE boundary
    (``num_heads`` heads of ``kv_lora_rank``, ``output_dtype``) and, with
    ``index_topk``, the top-K boundary (``topk_max_rows`` rows, default
    ``max_rows``). ``num_heads`` is the total over the group (the TP heads the
    group covers). Read the geometry from the model config."""
    pg = _face.group(group).pg
    check_int(max_rows, "max_rows", 1)
    check_int(num_heads, "num_heads", 1)
    if index_topk is not None:
        check_int(index_topk, "index_topk", 1)
    if topk_max_rows is not None:
        check_int(topk_max_rows, "topk_max_rows", 1)
    world = dist.get_world_size(pg)
    if num_heads % world:
        raise arg_error("num_heads", f"a multiple of the world size {world}", num_heads)
    query = prepare_query_gather(pg, max_rows=max_rows, local_heads=num_heads // world, nope_dim=kv_lora_rank,
                                 rope_dim=qk_rope_head_dim, out_dtype=query_dtype, rope_style=rope_style,
                                 device=device, **options)
    output_lse = prepare_output_lse(pg, max_rows=max_rows, total_heads=num_heads, head_dim=kv_lora_rank,
                                    dtype=output_dtype, device=device, **options)
    topk = None
    if index_topk is not None:
        topk = prepare_topk(pg, max_rows=max_rows if topk_max_rows is None else topk_max_rows, k=index_topk,
                            device=device, **options)
    return MLADCPWorkspaces(query, output_lse, topk)
