"""The sparse attention indexer's top-K merge on peer memory: vLLM's
``_merge_dcp_topk_global`` (0.33's seven parameters and 0.34's three more,
with 0.34's selection key) and the getter of vLLM 0.34's direct top-K
workspace, which the plugin answers for while its own top-K runs. Part of
the vLLM face (:mod:`torch_sdcp.integrations.vllm_calls`); never imports
vLLM."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torch_sdcp.integrations._face import Site
from torch_sdcp.integrations.vllm_calls import engine, face, try_prepare_topk, vllm_seam

__all__ = ["INDEXER_LAYER", "direct_topk_workspace", "layer_name_patches", "merge_dcp_topk_global", "note_layer_name",
           "selection_scores"]

_TOPK = vllm_seam("topk", "merge_dcp_topk_global", "the top-K merge")
# vLLM 0.34's switch of its direct paths; the direct top-K follows it (sparse_attn_indexer.py).
_ENV_DIRECT_A2A = "VLLM_USE_DIRECT_DCP_A2A"


class _IndexerLayer:
    """The layer of the indexer op this process runs now: the call tag of the
    top-K merges it makes. A plain object (the op runs eagerly, outside
    torch.compile's graphs)."""

    tag: int | None = None


#: The layer of the running indexer op (set by :func:`layer_name_patches`' readers).
INDEXER_LAYER = _IndexerLayer()


def note_layer_name(name: str, tag: int | None) -> None:
    """The start-up line of a layer name with several integer parts (once per process)."""
    face.log_once("info" if tag is not None else "warning", ("layer-name",), "torch_sdcp: vLLM's layer names have "
                  "several integer parts (%r): each layer's calls are tagged with them in base 1000 (%s)", name,
                  tag if tag is not None else "untagged: a part of 1000 or more")


def _reading_layer(resolve: Callable) -> Callable:
    """vLLM's ``_resolve_layer_name`` as an indexer op calls it at its start
    (with its own ``k_cache_prefix``; a tail cache's name is the same
    layer's): the layer's call tag kept for the merges the op makes."""
    from torch_sdcp.integrations.vllm_config import layer_tag

    @functools.wraps(resolve)
    def read(layer_name: Any) -> Any:
        name = resolve(layer_name)
        tag = layer_tag(name, note_layer_name)
        if tag is not None:
            INDEXER_LAYER.tag = tag
        return name
    return read


def layer_name_patches(patches: list[tuple[Any, str, Any, Any]]) -> list[tuple[Any, str, Any, Any]]:
    """(module, "_resolve_layer_name", vLLM's, the reader) for every module
    in ``patches`` whose ``_merge_dcp_topk_global`` is replaced and that holds
    ``_resolve_layer_name`` by name (the sparse indexer ops: the op resolves
    its layer's name first, so its merges carry the layer as their call tag;
    vLLM passes the merge no layer)."""
    out = []
    for owner, name, _, _ in patches:
        resolve = getattr(owner, "_resolve_layer_name", None)
        if name == "_merge_dcp_topk_global" and callable(resolve):
            out.append((owner, "_resolve_layer_name", resolve, _reading_layer(resolve)))
    return out


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


def selection_scores(scores: Tensor, logits_dtype: torch.dtype) -> Tensor:
    """The scores the merge selects by, so that its order is vLLM 0.34's key.

    vLLM 0.34 ranks only the top ``score_bits`` of the fp32 score made
    monotonic (``dcp_topk_score_bits``: 16 for bf16 logits, 32 otherwise),
    then the lower id. With 16, the 16-bit key itself (an integer, exact in
    fp32) is the score: two scores equal in their top 16 bits tie (lower id
    first), -0.0 ranks below +0.0 and NaNs by their bits, as in vLLM. With 32
    the scores are used as they are (the cases where a full fp32 key and
    torch_sdcp's comparison differ are listed in docs/VLLM.md)."""
    if logits_dtype != torch.bfloat16:
        return scores
    bits = scores.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    monotonic = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return (monotonic >> 16).float()


def _collective_merge(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
                      row_starts=None, logits_dtype=torch.float32) -> None:
    from torch_sdcp import collective

    if engine.dcp_group is None:
        raise RuntimeError("torch_sdcp: merge_dcp_topk_global has no DCP group: install() the plugin in vLLM, or "
                           "configure(dcp_group=...) first")
    group = engine.dcp_group()
    scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    pg = getattr(group, "device_group", group)
    topk_indices.copy_(collective.topk_all_gather_merge(selection_scores(scores, logits_dtype), ids, topk_tokens,
                                                        group=pg))


def merge_dcp_topk_global(logits: Tensor, topk_indices: Tensor, topk_tokens: int, dcp_rank: int,
                          dcp_world_size: int, cp_interleave: int, row_starts: Tensor | None = None,
                          logits_dtype: torch.dtype = torch.float32, num_positions: int | None = None,
                          direct_max_rows: int = 0) -> None:
    """vLLM's ``_merge_dcp_topk_global`` on peer memory: ``logits`` fp32 rows
    (``row_starts`` offsets, optional), ``topk_indices [T, C]`` int32 LOCAL
    positions in this rank's KV shard (-1 = none) -> overwritten IN PLACE with
    the global top-``topk_tokens`` token ids of the DCP group (-1 padded),
    the same set and order on every rank.

    vLLM 0.34's parameters: ``logits_dtype`` (bf16: the selection keys the
    top 16 bits of each score, :func:`selection_scores`), ``num_positions``
    (vLLM keys the low ``bit_length(num_positions - 1)`` bits of the ids; the
    ids of positions below it are exact in them, so it changes nothing here),
    ``direct_max_rows`` (rows up to it run on vLLM's direct top-K workspace:
    it exists only where the plugin left it to vLLM, :func:`direct_topk_workspace`,
    so those rows take vLLM's own function). vLLM 0.33 passes none of them.

    Selection: the same set as vLLM's merge wherever both define it (see
    docs/VLLM.md for the cases that differ); order: score descending, lower
    global id first on ties (vLLM's selector leaves the order unspecified)."""
    if dcp_world_size <= 1:
        return
    fallback = engine.originals.get("_merge_dcp_topk_global", _collective_merge)
    args = (logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    # Only what the caller set: vLLM 0.33's merge takes none of these.
    extra: dict[str, Any] = {k: v for k, v in (("logits_dtype", logits_dtype), ("num_positions", num_positions),
                                               ("direct_max_rows", direct_max_rows))
                             if v != {"logits_dtype": torch.float32, "num_positions": None, "direct_max_rows": 0}[k]}
    if engine.dcp_group is None or 0 < topk_indices.shape[0] <= direct_max_rows:
        return fallback(*args, **extra)
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
        return fallback(*args, **extra)
    with face.counted(_TOPK):
        if rows == 0:
            return None
        scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
        topk_indices.copy_(ws.merge(selection_scores(scores, logits_dtype), ids, tag=INDEXER_LAYER.tag))
    return None


def direct_topk_workspace(device: Any, max_rows: int, topk_tokens: int, *, off: str | None = None) -> Any:
    """Replaces vLLM 0.34's ``_get_direct_dcp_topk_workspace`` (called by
    ``SparseAttnIndexer.__init__`` at model construction, collectively): the
    plugin's top-K takes the direct top-K's rows over, so vLLM's
    symmetric-memory workspace is not created (None: vLLM's merge then gets
    ``direct_max_rows`` 0 and every row comes to the plugin). It stays vLLM's
    (its own getter runs) when ``VLLM_USE_DIRECT_DCP_A2A`` is set by the user,
    when ``off`` says why (the step's health check could not be installed),
    or when the group has no peer memory; one line says which."""
    from torch_sdcp.integrations.vllm_config import row_bound

    original = engine.originals["_get_direct_dcp_topk_workspace"]
    why = off
    if why is None and os.environ.get(_ENV_DIRECT_A2A, "").strip():
        why = f"{_ENV_DIRECT_A2A}={os.environ[_ENV_DIRECT_A2A]} set by the user"
    bound = row_bound(max_rows)
    if why is None and engine.dcp_group is not None and not try_prepare_topk(
            engine.dcp_group(), max_rows=bound, k=topk_tokens, device=device, num_ubatches=1):
        why = "peer memory unavailable"
    if why is not None:
        face.log_once("warning", ("direct-topk", why), "torch_sdcp: vLLM's direct top-K (DirectDCPTopKWorkspace) "
                      "stays vLLM's: %s", why)
        return original(device, max_rows, topk_tokens)
    face.log_once("info", ("direct-topk", "taken"), "torch_sdcp: vLLM's direct top-K (DirectDCPTopKWorkspace) is "
                  "not created: the top-K merge runs on torch_sdcp's TopKWorkspace (k=%d, %d rows)", topk_tokens,
                  bound)
    return None
