"""Drop-in adapters for the DCP call sites of serving engines.

Each adapter has the call shape of the collective it replaces and resolves its
workspace from the group and the geometry of its inputs through a small
process-local cache:

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

Rows are dimension 0 of every input (decode tokens). A call with more rows than
the workspace's ``max_rows`` runs the collective path of
:mod:`torch_sdcp.collective` and logs it once per workspace and row count
(logger ``torch_sdcp``), the policy of :mod:`torch_sdcp.workspaces`.

``group`` is a ``torch.distributed`` process group, ``None`` (the default
group), or an object with a ``device_group`` process group attribute (a vLLM
``GroupCoordinator``; its ``device_group`` is used).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import collective, ops
from torch_sdcp._checks import arg_error, check_bool, check_dim, check_dtype, check_int, check_tensor

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

#: Rows bound of a workspace created on first use (the reference decode bound).
DEFAULT_MAX_ROWS = 128

GroupLike = Any  # Optional[dist.ProcessGroup], or an object with a ``device_group`` attribute

_WORKSPACE_OPTIONS = ("timeout_s", "allow_shared_device", "fallback")


@dataclass
class _Entry:
    workspace: Any
    group: dist.ProcessGroup
    max_rows: int  # the rows bound it was made for (the workspace's own bound where it has one)
    was_peer: bool
    logged: set = field(default_factory=set)

    @property
    def bound(self) -> int:
        return getattr(self.workspace, "max_rows", self.max_rows)


_cache: dict = {}
_lock = threading.Lock()


# ---------------------------------------------------------------------------
# Arguments.
# ---------------------------------------------------------------------------


def _process_group(group: GroupLike, arg: str) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("torch_sdcp: the integrations need an initialised torch.distributed "
                           "(call torch.distributed.init_process_group first)")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    device_group = getattr(group, "device_group", None)
    if isinstance(device_group, dist.ProcessGroup):
        return device_group
    raise arg_error(arg, "a torch.distributed ProcessGroup, None, or an object with a 'device_group' "
                    "ProcessGroup (a vLLM GroupCoordinator)", type(group).__name__)


def _normalise_device(device: Union[torch.device, str, None]) -> torch.device:
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


def _check_options(options: dict) -> None:
    for name in options:
        if name not in _WORKSPACE_OPTIONS:
            raise TypeError(f"torch_sdcp: unexpected keyword argument '{name}': expected one of "
                            f"{', '.join(_WORKSPACE_OPTIONS)}")


# ---------------------------------------------------------------------------
# The cache.
# ---------------------------------------------------------------------------


def _in_capture_or_tracing() -> Optional[str]:
    """What forbids a collective workspace creation right now, or None."""
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"
    return None


def _describe(key: tuple, world_size: int) -> str:
    geometry = ", ".join(f"{name}={value}" for name, value in key[2:])
    return f"{key[1]} workspace for a group of world size {world_size} ({geometry})"


def _lookup(key: tuple) -> Optional[_Entry]:
    entry = _cache.get(key)
    if entry is not None and entry.was_peer and not entry.workspace.peer:
        # Closed directly (not through teardown): treat it as never prepared.
        with _lock:
            if _cache.get(key) is entry:
                del _cache[key]
        return None
    return entry


def _create(key: tuple, group: dist.ProcessGroup, max_rows: int, factory, caller: str) -> _Entry:
    why = _in_capture_or_tracing()
    if why is not None:
        raise RuntimeError(f"torch_sdcp: {caller}: cannot create the {_describe(key, dist.get_world_size(group))} "
                           f"during {why} (creation is collective): prepare it at model load, before capture "
                           "and compilation")
    workspace = factory()
    entry = _Entry(workspace, group, max_rows, workspace.peer)
    with _lock:
        _cache[key] = entry
    return entry


def _prepare(key: tuple, group: dist.ProcessGroup, max_rows: int, factory, caller: str) -> Any:
    entry = _lookup(key)
    if entry is not None:
        if entry.bound != max_rows:
            raise arg_error("max_rows", f"{entry.bound} (the bound of the prepared "
                            f"{_describe(key, dist.get_world_size(group))})", max_rows)
        return entry.workspace
    return _create(key, group, max_rows, factory, caller).workspace


def _resolve(key: tuple, group: dist.ProcessGroup, adapter: str, prepare_call: str, factory) -> _Entry:
    entry = _lookup(key)
    if entry is not None:
        return entry
    why = _in_capture_or_tracing()
    if why is not None:
        raise RuntimeError(
            f"torch_sdcp: {adapter}: no {_describe(key, dist.get_world_size(group))} was prepared, and "
            f"workspaces cannot be created during {why} (creation is collective): call "
            f"torch_sdcp.integrations.{prepare_call} on every rank at model load, before capture and "
            "compilation")
    return _create(key, group, DEFAULT_MAX_ROWS, factory, adapter)


def _key(kind: str, group: dist.ProcessGroup, **geometry) -> tuple:
    # group_name: unique per group, and a constant that torch.compile (2.11
    # and later) traces, where id(group) is not traceable.
    return (group.group_name, kind) + tuple(geometry.items())


def _backend(device: torch.device) -> str:
    return "host" if device.type == "cpu" else "cuda"


def workspaces() -> list:
    """The workspaces the adapters hold now, in creation order."""
    return [entry.workspace for entry in list(_cache.values())]


def teardown() -> None:
    """Close every cached workspace, in creation order, and empty the cache.

    Collective like ``close()`` (it synchronises and barriers): every rank calls
    it, after the last replay of any CUDA graph that captured an adapter.
    Idempotent. Adapters called afterwards create their workspaces again.
    """
    with _lock:
        entries = list(_cache.values())
        _cache.clear()
    errors = []
    for entry in entries:
        try:
            entry.workspace.close()
        except Exception as e:  # noqa: BLE001  (close the rest, then report)
            errors.append(e)
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------
# all_gather (ExchangeWorkspace)
# ---------------------------------------------------------------------------


def _all_gather_key(group: dist.ProcessGroup, row_shape: Tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> tuple:
    return _key("all_gather", group, row_shape=tuple(row_shape), dtype=dtype, device=device)


def _all_gather_factory(group, max_rows, row_shape, dtype, device, options):
    def make():
        from torch_sdcp.workspaces import ExchangeWorkspace

        elem = torch.empty((), dtype=dtype).element_size()
        max_bytes = max_rows * math.prod(row_shape) * elem
        return ExchangeWorkspace(group, max_bytes, backend=_backend(device), device=device, **options)

    return make


def prepare_all_gather(group: GroupLike, *, max_rows: int, row_shape: Sequence[int], dtype: torch.dtype,
                       device: Union[torch.device, str, None] = None, **options) -> Any:
    """Create (collectively) the exchange workspace that ``all_gather`` uses for
    inputs ``[T, *row_shape]`` of ``dtype`` with ``T <= max_rows``, or return the
    one already prepared. ``device``: None is the current CUDA device, or cpu
    without CUDA (the host backend). ``options``: ``timeout_s``,
    ``allow_shared_device``, ``fallback`` (see ``PeerWorkspace``)."""
    pg = _process_group(group, "group")
    check_int(max_rows, "max_rows", 1)
    if not isinstance(row_shape, (tuple, list, torch.Size)):
        raise arg_error("row_shape", "a sequence of ints", type(row_shape).__name__)
    row_shape = tuple(check_int(s, "row_shape", 1) for s in row_shape)
    check_dtype(dtype, "dtype")
    _check_options(options)
    device = _normalise_device(device)
    key = _all_gather_key(pg, row_shape, dtype, device)
    return _prepare(key, pg, max_rows, _all_gather_factory(pg, max_rows, row_shape, dtype, device, options),
                    "prepare_all_gather")


def all_gather(input_: Tensor, group: GroupLike, dim: int = -1) -> Tensor:
    """Every rank's ``input_`` concatenated along ``dim`` (rank-major), the
    result of ``GroupCoordinator.all_gather(input_, dim)`` and of
    ``torch.cat(all_gather list, dim)``; for the query ``[T, H_loc, D]`` with
    ``dim=1``: ``[T, N*H_loc, D]``, head ``src_rank*H_loc + h``.

    Peer path: one ``ExchangeWorkspace.all_gather`` of the contiguous input
    (a non-contiguous input is copied first). Rows ``T = input_.shape[0]``
    above the prepared ``max_rows`` take the collective path (logged).
    """
    x = check_tensor(input_, "input_")
    if x.dim() == 0:
        raise arg_error("input_", "a tensor with at least one dimension", "a 0-D tensor")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise arg_error("dim", f"an int in [{-x.dim()}, {x.dim()})", repr(dim))
    pg = _process_group(group, "group")
    d = dim % x.dim()
    row_shape = tuple(x.shape[1:])
    if math.prod(row_shape) == 0:
        raise arg_error("input_", "non-empty rows", f"shape {list(x.shape)}")
    device = x.device
    key = _all_gather_key(pg, row_shape, x.dtype, device)
    entry = _resolve(key, pg, "all_gather",
                     f"prepare_all_gather(group, max_rows=..., row_shape={row_shape}, dtype={x.dtype})",
                     _all_gather_factory(pg, DEFAULT_MAX_ROWS, row_shape, x.dtype, device, {}))
    x = x.contiguous()
    ws = entry.workspace
    rows = x.shape[0]
    if ws.peer and rows <= entry.max_rows:
        stacked = ws.all_gather(x)  # [N, *x.shape]
    else:
        # Collective mode was logged at creation; rows above the bound are
        # logged here, once per workspace and row count.
        if ws.peer and rows not in entry.logged:
            entry.logged.add(rows)
            logger.warning("torch_sdcp all_gather adapter, rank %d: %d rows exceed max_rows=%d; this call takes "
                           "the collective path", dist.get_rank(pg), rows, entry.max_rows)
        # Raw bytes: gloo has no float8 (and not every build has bf16).
        stacked = collective._all_gather_stack(x.view(torch.uint8), pg).view(x.dtype)
    n = stacked.shape[0]
    shape = list(x.shape)
    shape[d] *= n
    return stacked.movedim(0, d).reshape(shape)


# ---------------------------------------------------------------------------
# Query boundary (QueryWorkspace)
# ---------------------------------------------------------------------------


def _query_key(group, local_heads, nope_dim, rope_dim, out_dtype, rope_style, device) -> tuple:
    return _key("query", group, local_heads=local_heads, nope_dim=nope_dim, rope_dim=rope_dim,
                out_dtype=out_dtype, rope_style=rope_style, device=device)


def _query_factory(group, max_rows, local_heads, nope_dim, rope_dim, out_dtype, rope_style, device, options):
    def make():
        from torch_sdcp.workspaces import QueryWorkspace

        return QueryWorkspace(group, max_rows, local_heads, nope_dim=nope_dim, rope_dim=rope_dim, dtype=out_dtype,
                              rope_style=rope_style, backend=_backend(device), device=device, **options)

    return make


def prepare_query_gather(group: GroupLike, *, max_rows: int, local_heads: int, nope_dim: int = 512,
                         rope_dim: int = 64, out_dtype: torch.dtype = torch.bfloat16,
                         rope_style: str = "interleaved", device: Union[torch.device, str, None] = None,
                         **options) -> Any:
    """Create (collectively) the query workspace that ``query_gather`` uses for
    ``ql_nope [T, local_heads, nope_dim]``, ``q_pe [T, local_heads, rope_dim]``
    with ``T <= max_rows``, producing ``out_dtype`` with ``rope_style``; or
    return the one already prepared. ``device`` and ``options`` as in
    ``prepare_all_gather``."""
    pg = _process_group(group, "group")
    check_int(max_rows, "max_rows", 1)
    check_int(local_heads, "local_heads", 1)
    check_int(nope_dim, "nope_dim", 1)
    check_int(rope_dim, "rope_dim", 1)
    check_dtype(out_dtype, "out_dtype", *ops.QUERY_DTYPES)
    ops.rope_is_neox(rope_style)
    _check_options(options)
    device = _normalise_device(device)
    key = _query_key(pg, local_heads, nope_dim, rope_dim, out_dtype, rope_style, device)
    return _prepare(key, pg, max_rows, _query_factory(pg, max_rows, local_heads, nope_dim, rope_dim, out_dtype,
                                                      rope_style, device, options), "prepare_query_gather")


def query_gather(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                 q_scale: Optional[Tensor] = None, *, group: GroupLike,
                 out_dtype: torch.dtype = torch.bfloat16, rope_style: str = "interleaved") -> Tensor:
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
    pg = _process_group(group, "group")
    local_heads, nope_dim, rope_dim = ql_nope.shape[1], ql_nope.shape[2], q_pe.shape[2]
    device = ql_nope.device
    key = _query_key(pg, local_heads, nope_dim, rope_dim, out_dtype, rope_style, device)
    entry = _resolve(key, pg, "query_gather",
                     f"prepare_query_gather(group, max_rows=..., local_heads={local_heads}, nope_dim={nope_dim}, "
                     f"rope_dim={rope_dim}, out_dtype={out_dtype}, rope_style={rope_style!r})",
                     _query_factory(pg, DEFAULT_MAX_ROWS, local_heads, nope_dim, rope_dim, out_dtype, rope_style,
                                    device, {}))
    return entry.workspace.gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)


# ---------------------------------------------------------------------------
# Output/LSE boundary (OutputLSEWorkspace)
# ---------------------------------------------------------------------------

_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _output_lse_key(group, total_heads, head_dim, dtype, device) -> tuple:
    return _key("output_lse", group, total_heads=total_heads, head_dim=head_dim, dtype=dtype, device=device)


def _output_lse_factory(group, max_rows, total_heads, head_dim, dtype, device, options):
    def make():
        from torch_sdcp.workspaces import OutputLSEWorkspace

        return OutputLSEWorkspace(group, max_rows, total_heads, head_dim, dtype=dtype, backend=_backend(device),
                                  device=device, **options)

    return make


def prepare_output_lse(group: GroupLike, *, max_rows: int, total_heads: int, head_dim: int,
                       dtype: torch.dtype = torch.bfloat16, device: Union[torch.device, str, None] = None,
                       **options) -> Any:
    """Create (collectively) the Output/LSE workspace that ``cp_lse_ag_out_rs``
    uses for partial outputs ``[T, total_heads, head_dim]`` of ``dtype`` with
    ``T <= max_rows``, or return the one already prepared. ``device`` and
    ``options`` as in ``prepare_all_gather``."""
    pg = _process_group(group, "group")
    check_int(max_rows, "max_rows", 1)
    check_int(total_heads, "total_heads", 1)
    check_int(head_dim, "head_dim", 1)
    check_dtype(dtype, "dtype", *_OUTPUT_DTYPES)
    world = dist.get_world_size(pg)
    if total_heads % world:
        raise arg_error("total_heads", f"a multiple of the world size {world}", total_heads)
    _check_options(options)
    device = _normalise_device(device)
    key = _output_lse_key(pg, total_heads, head_dim, dtype, device)
    return _prepare(key, pg, max_rows, _output_lse_factory(pg, max_rows, total_heads, head_dim, dtype, device,
                                                           options), "prepare_output_lse")


def cp_lse_ag_out_rs(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: GroupLike, ctx: Any = None,
                     return_lse: bool = False, is_lse_base_on_e: bool = True
                     ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
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
    check_dtype(cp_attn_out.dtype, "cp_attn_out", *_OUTPUT_DTYPES)
    check_bool(return_lse, "return_lse")
    check_bool(is_lse_base_on_e, "is_lse_base_on_e")
    pg = _process_group(cp_group, "cp_group")
    _, total_heads, head_dim = cp_attn_out.shape
    world = dist.get_world_size(pg)
    if total_heads % world:
        raise arg_error("cp_attn_out", f"heads (dimension 1) divisible by the world size {world}",
                        f"shape {list(cp_attn_out.shape)}")
    dtype, device = cp_attn_out.dtype, cp_attn_out.device
    key = _output_lse_key(pg, total_heads, head_dim, dtype, device)
    entry = _resolve(key, pg, "cp_lse_ag_out_rs",
                     f"prepare_output_lse(group, max_rows=..., total_heads={total_heads}, head_dim={head_dim}, "
                     f"dtype={dtype})",
                     _output_lse_factory(pg, DEFAULT_MAX_ROWS, total_heads, head_dim, dtype, device, {}))
    return entry.workspace.combine(cp_attn_out.contiguous(), cp_attn_lse.contiguous(),
                                   lse_base="e" if is_lse_base_on_e else "2", return_lse=return_lse)


# ---------------------------------------------------------------------------
# Top-K boundary (TopKWorkspace)
# ---------------------------------------------------------------------------


def _topk_key(group, k, candidates_per_rank, device) -> tuple:
    return _key("topk", group, k=k, candidates_per_rank=candidates_per_rank, device=device)


def _topk_factory(group, max_rows, k, candidates_per_rank, device, options):
    def make():
        from torch_sdcp.workspaces import TopKWorkspace

        return TopKWorkspace(group, max_rows, k, candidates_per_rank=candidates_per_rank, backend=_backend(device),
                             device=device, **options)

    return make


def prepare_topk(group: GroupLike, *, max_rows: int, k: int, candidates_per_rank: Optional[int] = None,
                 device: Union[torch.device, str, None] = None, **options) -> Any:
    """Create (collectively) the top-K workspace that ``topk_merge`` uses for
    candidate shards ``[T, candidates_per_rank]`` (default ``k``) with
    ``T <= max_rows``, selecting ``k``; or return the one already prepared.
    ``device`` and ``options`` as in ``prepare_all_gather``."""
    pg = _process_group(group, "group")
    check_int(max_rows, "max_rows", 1)
    check_int(k, "k", 1)
    candidates = k if candidates_per_rank is None else check_int(candidates_per_rank, "candidates_per_rank", 1)
    _check_options(options)
    device = _normalise_device(device)
    key = _topk_key(pg, k, candidates, device)
    return _prepare(key, pg, max_rows, _topk_factory(pg, max_rows, k, candidates, device, options), "prepare_topk")


def topk_merge(scores: Tensor, ids: Tensor, group: GroupLike, k: int) -> Tensor:
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
    pg = _process_group(group, "group")
    candidates = scores.shape[1]
    if candidates < 1:
        raise arg_error("scores", "at least one candidate per row", f"shape {list(scores.shape)}")
    device = scores.device
    key = _topk_key(pg, k, candidates, device)
    entry = _resolve(key, pg, "topk_merge",
                     f"prepare_topk(group, max_rows=..., k={k}, candidates_per_rank={candidates})",
                     _topk_factory(pg, DEFAULT_MAX_ROWS, k, candidates, device, {}))
    return entry.workspace.merge(scores, ids)


# ---------------------------------------------------------------------------
# Everything an MLA DCP model needs, in one call.
# ---------------------------------------------------------------------------


class MLADCPWorkspaces(NamedTuple):
    """The workspaces ``prepare_mla_dcp`` prepared (``topk`` is None without
    ``index_topk``)."""

    query: Any
    output_lse: Any
    topk: Optional[Any]


def prepare_mla_dcp(group: GroupLike, *, max_rows: int, num_heads: int, kv_lora_rank: int = 512,
                    qk_rope_head_dim: int = 64, query_dtype: torch.dtype = torch.bfloat16,
                    output_dtype: torch.dtype = torch.bfloat16, rope_style: str = "interleaved",
                    index_topk: Optional[int] = None, topk_max_rows: Optional[int] = None,
                    device: Union[torch.device, str, None] = None, **options) -> MLADCPWorkspaces:
    """Prepare, at model load, every workspace an MLA DCP decode step uses:
    the query boundary (``num_heads / N`` local heads of ``kv_lora_rank +
    qk_rope_head_dim``, produced as ``query_dtype``), the Output/LSE boundary
    (``num_heads`` heads of ``kv_lora_rank``, ``output_dtype``) and, with
    ``index_topk``, the top-K boundary (``topk_max_rows`` rows, default
    ``max_rows``). ``num_heads`` is the total over the group (the TP heads the
    group covers). Read the geometry from the model config."""
    pg = _process_group(group, "group")
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
