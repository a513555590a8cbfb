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

import functools
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
    "DEFAULT_TIMEOUT_S", "ENV_TIMEOUT_S", "configure", "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce",
    "dcp_a2a_v_up_proj_lse_reduce", "gather_heads",
    "gather_query", "mask_empty_shards", "teardown", "try_prepare_output_lse",
    "try_prepare_query_gather", "try_prepare_topk", "vllm_seam", "workspaces",
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


def vllm_seam(kind: str, caller: str, what: str) -> Seam:
    """A seam of vLLM's: the engine's own function is its fallback."""
    return Seam(kind, caller, _OWN_PATH, missing=f"{what} takes {_OWN_PATH} path")


_SEAMS = {name: vllm_seam("output_lse", name, name) for name in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce")}
_QUERY = vllm_seam("query", "gather_query", "the query gather")
_V_UP = vllm_seam("output_lse", "dcp_a2a_v_up_proj_lse_reduce", "the combine after the V up-projection")


def _combine(fallback_name: str, cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any,
             return_lse: bool, is_lse_base_on_e: bool, seq_lens: Tensor | None,
             query_start_loc: Tensor | None, tag: int | None, out: Tensor | None = None):
    args = (cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    fallback = engine.originals.get(fallback_name)
    if fallback is None:
        fallback = functools.partial(_written_into, _collective_combine)
    extra = {} if out is None else {"out": out}  # vLLM 0.33's functions take no out
    group = face.group(cp_group, "cp_group")
    if group.world == 1:
        return fallback(*args, **extra)
    _check_mask_args(seq_lens, query_start_loc)
    squeezed, lse = _squeeze_inputs(cp_attn_out, cp_attn_lse)
    rows, heads, dim = squeezed.shape

    seam = _SEAMS[fallback_name]
    ws = face.workspace_for(seam, Site(group, {"total_heads": heads, "head_dim": dim, "dtype": squeezed.dtype},
                                       squeezed.device), rows)
    if ws is None:
        return fallback(*args, **extra)
    with face.counted(seam):  # the mask runs inside the combine kernel
        result = ws.combine(squeezed.contiguous(), lse.float().contiguous(), lse_base="e" if is_lse_base_on_e else "2",
                            return_lse=return_lse, seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)
    return _written_into(lambda *_: result, *args, out=out)


def _written_into(fn: Callable, *args: Any, out: Tensor | None = None):
    """``fn(*args)``, its output copied into ``out`` when given (vLLM 0.34's
    ``out=``: the result is ``out``)."""
    result = fn(*args)
    if out is None:
        return result
    combined = result[0] if isinstance(result, tuple) else result
    out.copy_(combined.view(out.shape))
    return (out, result[1]) if isinstance(result, tuple) else out


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
                       query_start_loc: Tensor | None = None, out: Tensor | None = None, *, tag: int | None = None):
    """vLLM's ``dcp_a2a_lse_reduce`` (``--dcp-comm-backend a2a``) on peer
    memory: the same inputs, masking and result as :func:`cp_lse_ag_out_rs`
    (the two backends differ in how vLLM moves data, not in what they
    compute). With ``out`` (vLLM 0.34, ``[B, H/N, D]``) the result is written
    there and ``out`` is returned. Falls back to vLLM's own
    ``dcp_a2a_lse_reduce``. ``tag`` as for :func:`cp_lse_ag_out_rs`."""
    return _combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e,
                    seq_lens, query_start_loc, tag, out)


# vLLM 0.34's _V_UP_PROJ_FIRST_MIN_TOKENS: below it the latent is combined first.
V_UP_PROJ_FIRST_MIN_TOKENS = 8


def dcp_a2a_v_up_proj_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, w_uv: Tensor, out: Tensor, cp_group: Any,
                                 is_lse_base_on_e: bool = True, seq_lens: Tensor | None = None,
                                 query_start_loc: Tensor | None = None, *, tag: int | None = None) -> None:
    """vLLM 0.34's ``dcp_a2a_v_up_proj_lse_reduce`` on peer memory: partial
    latent outputs ``[B, H, L]`` of all heads and every head's up-projection
    ``w_uv [H, L, V]`` -> this rank's heads' combined values, written into
    ``out [B, H/N * V]``. As vLLM does: below 8 rows the latent is combined
    (:func:`dcp_a2a_lse_reduce`) and this rank's heads projected; from 8 rows
    on all heads are projected first and the ``V``-wide values combined (4x
    fewer bytes than the 512-wide latent for V = 128), on an Output/LSE
    workspace of head_dim ``V``. Rows above its bound, or no such workspace,
    run vLLM's own function. ``tag`` as for :func:`cp_lse_ag_out_rs`."""
    rows, heads, _ = cp_attn_out.shape
    v = w_uv.shape[-1]
    group = face.group(cp_group, "cp_group")
    if rows < V_UP_PROJ_FIRST_MIN_TOKENS:
        local = heads // group.world
        latent = dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=is_lse_base_on_e,
                                    seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)
        torch.bmm(latent.transpose(0, 1), w_uv[group.rank * local:(group.rank + 1) * local],
                  out=out.view(rows, local, v).transpose(0, 1))
        return None
    ws = face.workspace_for(_V_UP, Site(group, {"total_heads": heads, "head_dim": v, "dtype": cp_attn_out.dtype},
                                        cp_attn_out.device), rows)
    fallback = engine.originals.get("dcp_a2a_v_up_proj_lse_reduce")
    if ws is None and fallback is not None:
        return fallback(cp_attn_out, cp_attn_lse, w_uv, out, cp_group, is_lse_base_on_e, seq_lens, query_start_loc)
    projected = cp_attn_out.new_empty((rows, heads, v))
    torch.bmm(cp_attn_out.transpose(0, 1), w_uv, out=projected.transpose(0, 1))
    if ws is None:  # without vLLM: the collective path
        out.view(rows, -1, v).copy_(_collective_combine(projected, cp_attn_lse, cp_group, None, False,
                                                        is_lse_base_on_e, seq_lens, query_start_loc))
        return None
    _check_mask_args(seq_lens, query_start_loc)
    with face.counted(_V_UP):
        combined = ws.combine(projected, cp_attn_lse.float().contiguous(), lse_base="e" if is_lse_base_on_e else "2",
                              seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)
    out.view(rows, -1, v).copy_(combined)
    return None


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
