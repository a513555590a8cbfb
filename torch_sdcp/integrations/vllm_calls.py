"""vLLM's DCP call shapes on peer memory: the vLLM face over the integration
core (:mod:`torch_sdcp.integrations._face`).

Each function has the signature and semantics of the vLLM function it
replaces and falls back to that function (or, without vLLM, to torch_sdcp's
collective path) when its boundary has no workspace or a call has more rows
than the workspace's bound, logged once per reason. The ``try_prepare_*``
functions create the workspaces, one per micro-batch, bootstrapped over a
GroupCoordinator's ``cpu_group``. :mod:`torch_sdcp.integrations.vllm` patches
these into vLLM and re-exports them; this module never imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp._checks import check_mask_args as _check_mask_args
from torch_sdcp.integrations._engine import EngineHooks, engine_logger, query_geometry, workspace_options
from torch_sdcp.integrations._face import Face, Seam, Site
from torch_sdcp.integrations._groups import normalise_device
from torch_sdcp.semantics import mask_empty_shards
from torch_sdcp_settings import VLLM

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_TIMEOUT_S", "configure", "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "gather_heads",
    "gather_query", "mask_empty_shards", "merge_dcp_topk_global", "teardown", "try_prepare_output_lse",
    "try_prepare_query_gather", "try_prepare_topk", "workspaces",
]

ENV_TIMEOUT_S = VLLM.TIMEOUT_S
DEFAULT_TIMEOUT_S = VLLM.default_timeout_s

_OWN_PATH = "vLLM's own"


# Bootstraps over a coordinator's cpu_group (gloo); a call without a workspace takes vLLM's own function.
face = Face("vllm", via="cpu_group", create_missing=False, make_logger=engine_logger("vllm", "vllm.logger"),
            options=workspace_options(VLLM))


#: What the calls read from vLLM (set by install() or configure()).
engine = EngineHooks()


def configure(*, ubatch_id: Callable[[], int] | None = None, dcp_group: Callable[[], Any] | None = None,
              originals: dict[str, Callable] | None = None) -> None:
    """Set, without vLLM, what :func:`install` reads from vLLM: the current
    micro-batch id (``dbo_current_ubatch_id``), the DCP group
    (``get_dcp_group``) and the fallback functions by name
    (``cp_lse_ag_out_rs``, ``dcp_a2a_lse_reduce``, ``_merge_dcp_topk_global``).
    For engines that call the boundary functions themselves."""
    with engine.lock:
        if ubatch_id is not None:
            face.ubatch_id = ubatch_id
        engine.configure(dcp_group, originals)


def workspaces() -> list[Any]:
    """Every workspace this face prepared in this process."""
    return face.workspaces()


def teardown() -> None:
    """Close every prepared workspace (collective: every rank calls it, at
    shutdown, outside capture) and forget them."""
    face.teardown()


# ---------------------------------------------------------------------------
# Preparation
# ---------------------------------------------------------------------------


def try_prepare_output_lse(group: Any, *, max_rows: int, total_heads: int, head_dim: int, dtype: torch.dtype,
                           device: Any, num_ubatches: int = 1) -> bool:
    """Prepare the Output/LSE workspaces (one per micro-batch) for partial
    outputs ``[T <= max_rows, total_heads, head_dim]`` of ``dtype``. False
    when the group cannot use peer memory (then vLLM keeps its own path)."""
    return face.try_prepare("output_lse", face.group(group, "cp_group"),
                             {"total_heads": total_heads, "head_dim": head_dim, "dtype": dtype},
                             normalise_device(device), max_rows, num_ubatches, _OWN_PATH)


def try_prepare_query_gather(group: Any, *, max_rows: int, local_heads: int, width: int, dtype: torch.dtype,
                             device: Any, num_ubatches: int = 1) -> bool:
    """Prepare the query-gather workspaces (one per micro-batch) for queries
    ``[T <= max_rows, local_heads, width]`` of ``dtype``: ``QueryWorkspace``
    (gather-only, no RoPE part), or ``ExchangeWorkspace`` where the dtype or
    width rules it out (see :func:`gather_heads`). False when the group
    cannot use peer memory."""
    return face.try_prepare("query", face.group(group, "cp_group"), query_geometry(local_heads, width, dtype),
                             normalise_device(device), max_rows, num_ubatches, _OWN_PATH)


def try_prepare_topk(group: Any, *, max_rows: int, k: int, candidates_per_rank: int | None = None, device: Any,
                     num_ubatches: int = 1) -> bool:
    """Prepare the top-K workspaces (one per micro-batch) for ``[T <= max_rows,
    candidates_per_rank]`` local candidates (default ``k``) selecting ``k``.
    False when the group cannot use peer memory."""
    c = k if candidates_per_rank is None else candidates_per_rank
    return face.try_prepare("topk", face.group(group, "cp_group"), {"k": k, "candidates_per_rank": c},
                             normalise_device(device), max_rows, num_ubatches, _OWN_PATH)


# ---------------------------------------------------------------------------
# Output/LSE
# ---------------------------------------------------------------------------


def _squeeze_inputs(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    if out.dim() == 4 and out.shape[1] == 1:  # [B, 1, H, D]
        out = out.squeeze(1)
    if lse.dim() == 3 and lse.shape[-1] == 1:  # [B, H, 1]
        lse = lse.squeeze(-1)
    elif lse.dim() == 3 and lse.shape[1] == 1:  # [B, 1, H]
        lse = lse.squeeze(1)
    if out.dim() != 3:
        raise ValueError(f"torch_sdcp: argument 'cp_attn_out': expected [B, H, D] or [B, 1, H, D], got shape "
                         f"{list(out.shape)}")
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"torch_sdcp: argument 'cp_attn_lse': expected shape {list(out.shape[:2])} (or with a "
                         f"1-sized extra dimension), got shape {list(lse.shape)}")
    return out, lse


def _collective_combine(cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e, seq_lens,
                        query_start_loc):
    """The fallback when vLLM's own function is not known (the plugin used
    without vLLM): the same masking, then torch_sdcp's collective path."""
    from torch_sdcp import collective

    out, lse = _squeeze_inputs(cp_attn_out, cp_attn_lse)
    lse = mask_empty_shards(lse.float(), seq_lens, query_start_loc)
    pg = getattr(cp_group, "device_group", cp_group)
    return collective.lse_all_gather_correct_reduce_scatter(out, lse, base2=not is_lse_base_on_e,
                                                            return_lse=return_lse, group=pg)


def _seam(kind: str, caller: str, what: str) -> Seam:
    return Seam(kind, caller, _OWN_PATH, missing=f"{what} takes {_OWN_PATH} path")


_SEAMS = {name: _seam("output_lse", name, name) for name in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce")}
_QUERY = _seam("query", "gather_query", "the query gather")
_TOPK = _seam("topk", "merge_dcp_topk_global", "the top-K merge")


def _combine(fallback_name: str, cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any,
             return_lse: bool, is_lse_base_on_e: bool, seq_lens: Tensor | None,
             query_start_loc: Tensor | None, tag: int | None):
    args = (cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    fallback = engine.originals.get(fallback_name, _collective_combine)
    group = face.group(cp_group, "cp_group")
    if group.world == 1:
        return fallback(*args)
    _check_mask_args(seq_lens, query_start_loc)
    out, lse = _squeeze_inputs(cp_attn_out, cp_attn_lse)
    rows, heads, dim = out.shape

    seam = _SEAMS[fallback_name]
    ws = face.workspace_for(seam, Site(group, {"total_heads": heads, "head_dim": dim, "dtype": out.dtype}, out.device),
                            rows)
    if ws is None:
        return fallback(*args)
    with face.counted(seam):  # the mask runs inside the combine kernel
        return ws.combine(out.contiguous(), lse.float().contiguous(), lse_base="e" if is_lse_base_on_e else "2",
                          return_lse=return_lse, seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)


def cp_lse_ag_out_rs(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                     return_lse: bool = False, is_lse_base_on_e: bool = True, seq_lens: Tensor | None = None,
                     query_start_loc: Tensor | None = None, *, tag: int | None = None):
    """vLLM's ``cp_lse_ag_out_rs`` (``--dcp-comm-backend ag_rs``) on peer
    memory. ``cp_attn_out [B, H, D]`` (or ``[B, 1, H, D]``) and
    ``cp_attn_lse [B, H]`` of this rank's KV shard -> this rank's heads
    ``[B, H/N, D]`` (and their global LSE ``[B, H/N]`` fp32 with
    ``return_lse``). With ``seq_lens``/``query_start_loc``, rows of empty
    shards and padding rows get LSE -inf first (no weight). ``ctx`` (vLLM's
    Triton kernel cache) is accepted and ignored. Rows above the prepared
    bound, or no prepared workspace, run vLLM's own function. ``tag`` (not
    vLLM's: the manager's partial binds it to its layer's index) is the call
    tag of the peer call."""
    return _combine("cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e,
                    seq_lens, query_start_loc, tag)


def dcp_a2a_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                       return_lse: bool = False, is_lse_base_on_e: bool = True, seq_lens: Tensor | None = None,
                       query_start_loc: Tensor | None = None, *, tag: int | None = None):
    """vLLM's ``dcp_a2a_lse_reduce`` (``--dcp-comm-backend a2a``) on peer
    memory: the same inputs, masking and result as :func:`cp_lse_ag_out_rs`
    (the two backends differ in how vLLM moves data, not in what they
    compute). Falls back to vLLM's own ``dcp_a2a_lse_reduce``. ``tag`` as
    for :func:`cp_lse_ag_out_rs`."""
    return _combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e,
                    seq_lens, query_start_loc, tag)


# ---------------------------------------------------------------------------
# Query
# ---------------------------------------------------------------------------


def _storage(rows: int, heads: int, width: int, padded_num_heads: int | None, like: Tensor) -> Tensor:
    """A packed ``[rows, heads, width]`` tensor whose storage holds
    ``padded_num_heads`` heads per row (vLLM's reserve_query_head_storage:
    fixed-head kernels may read past the gathered heads)."""
    if padded_num_heads is None:
        return like.new_empty((rows, heads, width))
    if padded_num_heads < heads:
        raise ValueError(f"torch_sdcp: argument 'padded_num_heads': expected at least the {heads} gathered heads, "
                         f"got {padded_num_heads}")
    flat = like.new_empty((rows * padded_num_heads * width,))
    return flat[: rows * heads * width].view(rows, heads, width)


def gather_heads(workspace: Any, query: Tensor, padded_num_heads: int | None = None, *,
                 tag: int | None = None) -> Tensor:
    """``[T, H_loc, W]`` on every rank -> ``[T, N*H_loc, W]``, head
    ``src*H_loc + h``: ``all_gather(query, dim=1)``, with ``padded_num_heads``
    heads of storage per row when asked.

    On a ``QueryWorkspace`` (the dtypes whose all-ones element is NaN): one
    data-as-flag kernel stores each rank's heads straight into every peer's
    buffer and its own heads into the result; every non-NaN value is
    bit-exact, and an aligned 4-byte word of all-ones bytes (a NaN) arrives as
    the canonical NaN word. On an ``ExchangeWorkspace`` (any other dtype): a
    tagged peer all-gather of the raw bytes (``[N, T, H_loc, W]``) and one
    layout copy, bit-exact for every byte. ``tag``: the call tag."""
    import torch_sdcp

    rows, local_heads, width = query.shape
    out = _storage(rows, workspace.world_size * local_heads, width, padded_num_heads, query)
    if isinstance(workspace, torch_sdcp.QueryWorkspace):
        return workspace.all_gather_heads(query.contiguous(), out=out, tag=tag)
    raw = query.contiguous().view(torch.uint8)  # bytes: float8 and bf16 alike
    stacked = workspace.all_gather(raw, tag=tag)  # [N, T, H_loc, W * element size]
    out.view(torch.uint8).view(rows, stacked.shape[0], local_heads, -1).copy_(stacked.permute(1, 0, 2, 3))
    return out


def _collective_gather_query(query: Tensor, cp_group: Any, padded_num_heads: int | None) -> Tensor:
    pg = getattr(cp_group, "device_group", cp_group)
    n = dist.get_world_size(pg)
    raw = query.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(parts, raw, group=pg)
    rows, local_heads, width = query.shape
    out = _storage(rows, n * local_heads, width, padded_num_heads, query)
    out.view(torch.uint8).view(rows, n, local_heads, -1).copy_(torch.stack(parts, dim=1))
    return out


def gather_query(query: Tensor, cp_group: Any, padded_num_heads: int | None = None,
                 fallback: Callable[[Tensor], Tensor] | None = None, *, tag: int | None = None) -> Tensor:
    """The MLA DCP query gather on heads: an already-roped (and possibly
    FP8-quantised) ``query [T, H_loc, W]`` -> ``[T, N*H_loc, W]``, equal to
    ``cp_group.all_gather(query, dim=1)`` with every non-NaN value bit-exact
    (see :func:`gather_heads`); with
    ``padded_num_heads`` the result's storage has that many heads per row.
    Rows above the prepared bound, or no prepared workspace, call
    ``fallback(query)`` (the manager's own ``_gather_query`` when patched
    into vLLM) or torch.distributed's all_gather. ``tag``: the call tag (the
    manager's partial binds its layer's index)."""
    if query.dim() != 3:
        raise ValueError(f"torch_sdcp: argument 'query': expected [T, H_loc, W], got shape {list(query.shape)}")
    group = face.group(cp_group, "cp_group")
    rows, local_heads, width = query.shape
    ws = face.workspace_for(_QUERY, Site(group, query_geometry(local_heads, width, query.dtype), query.device), rows)
    if ws is None:
        if fallback is not None:
            return fallback(query)
        return _collective_gather_query(query, cp_group, padded_num_heads)
    with face.counted(_QUERY):
        if rows == 0:
            return _storage(0, group.world * local_heads, width, padded_num_heads, query)
        return gather_heads(ws, query, padded_num_heads, tag=tag)


# ---------------------------------------------------------------------------
# Top-K (sparse attention indexer)
# ---------------------------------------------------------------------------


def _local_candidates(logits: Tensor, topk_indices: Tensor, dcp_rank: int, dcp_world_size: int,
                      cp_interleave: int, row_starts: Tensor | None) -> tuple[Tensor, Tensor]:
    """(scores fp32 [T, C], global ids int32 [T, C], -1 = none) of this rank's
    local top-K positions: the score at ``row_start + position`` (column
    clamped to the row as vLLM does), the global token through the KV
    interleave (``torch_sdcp.semantics.token_global_index``)."""
    from torch_sdcp import semantics

    rows = topk_indices.shape[0]
    local = topk_indices.long()
    valid = local >= 0
    pos = local.clamp_min(0)
    if logits.shape[1] == 0:
        scores = torch.full(local.shape, -math.inf, dtype=torch.float32, device=local.device)
    else:
        col = pos if row_starts is None else pos + row_starts[:rows].to(local.device).long().unsqueeze(1)
        col = col.clamp(0, logits.shape[1] - 1)
        scores = logits[:rows].gather(1, col).float().masked_fill(~valid, -math.inf)
    ids = semantics.token_global_index(pos, dcp_rank, dcp_world_size, cp_interleave)
    ids = torch.where(valid, ids, -1).to(torch.int32)
    return scores.contiguous(), ids.contiguous()


def _collective_merge(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
                      row_starts=None) -> None:
    from torch_sdcp import collective

    if engine.dcp_group is None:
        raise RuntimeError("torch_sdcp: merge_dcp_topk_global has no DCP group: install() the plugin in vLLM, or "
                           "configure(dcp_group=...) first")
    group = engine.dcp_group()
    scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    pg = getattr(group, "device_group", group)
    topk_indices.copy_(collective.topk_all_gather_merge(scores, ids, topk_tokens, group=pg))


def merge_dcp_topk_global(logits: Tensor, topk_indices: Tensor, topk_tokens: int, dcp_rank: int,
                          dcp_world_size: int, cp_interleave: int, row_starts: Tensor | None = None) -> None:
    """vLLM's ``_merge_dcp_topk_global`` on peer memory: ``logits`` fp32 rows
    (``row_starts`` offsets, optional), ``topk_indices [T, C]`` int32 LOCAL
    positions in this rank's KV shard (-1 = none) -> overwritten IN PLACE with
    the global top-``topk_tokens`` token ids of the DCP group (-1 padded),
    the same set and order on every rank.

    Selection: the same set as vLLM's merge wherever both define it (see
    docs/VLLM.md for the cases that differ: -0.0 vs +0.0, NaN scores, ids at
    or above 2^24); order: score descending, lower global id first on ties
    (vLLM's selector leaves the order within the set unspecified)."""
    if dcp_world_size <= 1:
        return
    fallback = engine.originals.get("_merge_dcp_topk_global", _collective_merge)
    args = (logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    if engine.dcp_group is None:
        return fallback(*args)
    group = face.group(engine.dcp_group(), "cp_group")
    if (group.world, group.rank) != (dcp_world_size, dcp_rank):
        raise ValueError(f"torch_sdcp: arguments 'dcp_rank'/'dcp_world_size': expected the DCP group's "
                         f"{group.rank}/{group.world}, got {dcp_rank}/{dcp_world_size}")
    if topk_indices.dim() != 2 or topk_indices.dtype != torch.int32:
        raise ValueError(f"torch_sdcp: argument 'topk_indices': expected a 2-D int32 tensor, got shape "
                         f"{list(topk_indices.shape)} of {topk_indices.dtype}")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"torch_sdcp: argument 'logits': expected a 2-D float32 tensor, got shape "
                         f"{list(logits.shape)} of {logits.dtype}")
    rows, c = topk_indices.shape
    ws = face.workspace_for(_TOPK, Site(group, {"k": topk_tokens, "candidates_per_rank": c}, topk_indices.device), rows)
    if ws is None:
        return fallback(*args)
    with face.counted(_TOPK):
        if rows == 0:
            return None
        scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
        topk_indices.copy_(ws.merge(scores, ids))
    return None
