"""Exact references in plain PyTorch.

Everything here runs on any device and is deliberately simple: it is the
specification the kernels are tested against (docs/DESIGN.md section 2). The
collective paths engines run today (the fallback and the benchmark baseline)
are in :mod:`torch_sdcp.collective`.

- Token ownership: ``token_owner``, ``token_local_index``, ``token_global_index``
  (defined in :mod:`torch_sdcp.semantics`, which production code imports).
- Query: ``query_rope_quant_ref`` (bit-identical to ``torch.ops.sdcp.query_rope_quant``),
  ``query_gathered_layout`` and ``query_all_gather_heads_ref``.
- Top-K: ``topk_select_ref`` (bit-identical to ``torch.ops.sdcp.topk_select``, order
  included) and ``topk_merge_ref``.
- Output/LSE: ``lse_combine_ref`` (fp32), ``lse_combine_ref64`` (fp64) and
  ``output_lse_shard``; ``lse_weights`` and ``mask_empty_shards`` (from
  :mod:`torch_sdcp.semantics`).

Inputs are checked with the public helpers of :mod:`torch_sdcp._checks`, as
the ops check theirs: the references keep only what an oracle needs (its
own options, the stacked and per-shard forms the ops never see). Nothing in
production imports this module.

The reference functions must run eagerly: a compiler is free to fuse a product
and a sum into one FMA, which would break the bit-exactness they promise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torch_sdcp._checks import (
    check,
    check_dim,
    check_dtype,
    check_mask_args,
    check_partials,
    check_positive_int,
    check_query_inputs,
    check_size,
    check_topk_inputs,
)
from torch_sdcp.semantics import lse_weights, mask_empty_shards, token_global_index, token_local_index, token_owner

__all__ = [
    "token_owner",
    "token_local_index",
    "token_global_index",
    "query_rope_quant_ref",
    "query_gathered_layout",
    "query_all_gather_heads_ref",
    "topk_select_ref",
    "topk_merge_ref",
    "lse_combine_ref",
    "lse_combine_ref64",
    "output_lse_shard",
    "check_mask_args",
    "mask_empty_shards",
    "lse_weights",
]

# The names the collective paths used before the public helpers existed
# (torch_sdcp._checks, torch_sdcp.semantics); kept for code that still calls them.
_check_query_inputs = check_query_inputs
_check_topk_inputs = check_topk_inputs
_check_partials = check_partials
_lse_weights = lse_weights

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------------------
# Query boundary.
# ---------------------------------------------------------------------------


def query_rope_quant_ref(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                         q_scale: Tensor | None = None, neox: bool = False,
                         out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Reference query producer: RoPE on ``q_pe``, concatenation with ``ql_nope``,
    then bf16 or saturating float8_e4m3fn (``x / q_scale``).

    Returns ``[T, H, Dn + R]`` in ``out_dtype``, bit-identical to
    ``torch.ops.sdcp.query_rope_quant``. ``out_dtype=torch.float32`` (reference
    only) returns the fp32 values before the final rounding.
    """
    check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype, allow_fp32=True)
    rows, rope = q_pe.size(0), q_pe.size(2)
    half = rope // 2
    pos = positions.long()
    if pos.numel() > 0:
        lo, hi = int(pos.min()), int(pos.max())
        check(lo >= 0 and hi < cos_sin_cache.size(0), "positions",
              f"values in [0, {cos_sin_cache.size(0)})", f"values in [{lo}, {hi}]")
    # Row p of the cache is cat(cos[R/2], sin[R/2]) (the vLLM convention);
    # a bf16 cache widens to fp32 exactly. [T, 1, R/2] broadcasts over heads.
    cos = cos_sin_cache[pos, :half].float().reshape(rows, 1, half)
    sin = cos_sin_cache[pos, half:].float().reshape(rows, 1, half)
    x = q_pe.float()
    if neox:  # pair j is (x[j], x[j + R/2])
        x0, x1 = x[..., :half], x[..., half:]
    else:  # interleaved / GPT-J: pair j is (x[2j], x[2j + 1])
        x0, x1 = x[..., 0::2], x[..., 1::2]
    # Every product and every sum is its own fp32 op, each rounded once, as
    # the kernels do (no FMA, no addcmul): this is what makes it bit-exact.
    first = torch.sub(torch.mul(x0, cos), torch.mul(x1, sin))
    second = torch.add(torch.mul(x1, cos), torch.mul(x0, sin))
    roped = torch.cat([first, second], dim=-1) if neox else torch.stack([first, second], dim=-1).flatten(-2)
    out = torch.cat([ql_nope.float(), roped], dim=-1)
    if out_dtype == torch.float32:
        return out
    if out_dtype == torch.bfloat16:
        return out.to(torch.bfloat16)  # round to nearest even
    if q_scale is not None:
        # A 0-d tensor on the output's device: CUDA replaces division by a CPU
        # scalar with multiplication by its reciprocal, which is not x / s.
        scale = q_scale.reshape(()).to(device=out.device, dtype=torch.float32)
        out = torch.div(out, scale)
    # (With no scale the kernels divide by 1.0, which is the identity.)
    # Saturate (torch.clamp keeps NaN); every NaN becomes the positive NaN
    # 0x7F, as the kernels store it (no output word is the sentinel).
    out = torch.clamp(out, -E4M3_MAX, E4M3_MAX)
    out = torch.where(torch.isnan(out), torch.full_like(out, float("nan")).abs(), out)
    return out.to(torch.float8_e4m3fn)


def query_gathered_layout(per_rank_outputs: Sequence[Tensor]) -> Tensor:
    """The gathered query: per-rank ``[T, H_loc, W]`` outputs concatenated on heads
    (head index ``src_rank * H_loc + h``), exactly ``all_gather`` on dim 1."""
    check(len(per_rank_outputs) >= 1, "per_rank_outputs", "at least one tensor", len(per_rank_outputs))
    first = per_rank_outputs[0]
    for r, t in enumerate(per_rank_outputs):
        check_dim(t, f"per_rank_outputs[{r}]", 3)
        check(t.shape == first.shape, f"per_rank_outputs[{r}]", f"shape {list(first.shape)}",
              f"shape {list(t.shape)}")
        check_dtype(t, f"per_rank_outputs[{r}]", first.dtype)
    return torch.cat(list(per_rank_outputs), dim=1)


#: The data-as-flag sentinel word and its rewrites (csrc/dataflag.h): an aligned
#: 32-bit word of all-ones bytes (a NaN in every dtype the query buffers move)
#: arrives as four float8 0x7F NaNs or as two bf16/fp16 (one fp32) quiet NaNs.
SENTINEL_WORD = 0xFFFFFFFF
CANONICAL_FP8_WORD = 0x7F7F7F7F
CANONICAL_NAN_PAIR_WORD = 0x7FC07FC0


def query_all_gather_heads_ref(per_rank_queries: Sequence[Tensor]) -> Tensor:
    """What ``torch.ops.sdcp.query_all_gather_heads`` returns on every rank:
    ``query_gathered_layout`` of the per-rank ``[T, H_loc, W]`` queries, with
    every aligned 32-bit word equal to the sentinel (all-ones bytes, a NaN)
    replaced by the canonical NaN word of the element size. Every non-NaN
    value is bit-exact."""
    gathered = query_gathered_layout(per_rank_queries)
    check(gathered.numel() * gathered.element_size() % 4 == 0, "per_rank_queries", "whole 32-bit words",
          f"{gathered.numel() * gathered.element_size()} bytes")
    words = gathered.contiguous().view(torch.uint8).view(torch.int32)
    canonical = CANONICAL_FP8_WORD if gathered.element_size() == 1 else CANONICAL_NAN_PAIR_WORD
    words = torch.where(words == SENTINEL_WORD - 2**32, torch.tensor(canonical, dtype=torch.int32), words)
    return words.view(torch.uint8).view(gathered.dtype).view(gathered.shape)


# ---------------------------------------------------------------------------
# Top-K boundary.
# ---------------------------------------------------------------------------


def topk_select_ref(scores: Tensor, ids: Tensor, k: int) -> Tensor:
    """Stable top-k over candidate pairs ``(scores [T, M] fp32, ids [T, M] int32)``.

    Order: valid (id >= 0) before invalid; among valid, score descending with
    -0.0 == +0.0 and NaN below -inf (all NaNs equal); ties go to the lower id.
    Returns the first k ids ``[T, k]`` int32 in that order, -1 where fewer than
    k valid candidates exist.
    """
    check_topk_inputs(scores, ids, k)
    rows, m = scores.shape
    valid = ids >= 0
    is_nan = torch.isnan(scores)
    # Rank class, most significant key: 2 = valid number, 1 = valid NaN
    # (below -inf, still above invalid), 0 = invalid (score ignored).
    cls = torch.where(valid, torch.where(is_nan, 1, 2), 0).to(torch.int8)
    # Canonical score: NaN and invalid scores no longer matter (the class
    # decides), -0.0 folds onto +0.0.
    canon = torch.where(is_nan | ~valid, 0.0, scores)
    canon = torch.where(canon == 0.0, 0.0, canon)
    # Lexicographic order by stable sorts, least significant key first:
    # id ascending, then canonical score descending, then class descending.
    order = torch.sort(ids, dim=1, stable=True).indices
    by_score = torch.sort(canon.gather(1, order), dim=1, descending=True, stable=True).indices
    order = order.gather(1, by_score)
    by_cls = torch.sort(cls.gather(1, order), dim=1, descending=True, stable=True).indices
    order = order.gather(1, by_cls)
    take = min(k, m)
    order = order[:, :take]
    chosen = torch.where(cls.gather(1, order) > 0, ids.gather(1, order), -1).to(torch.int32)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=ids.device)
    out[:, :take] = chosen
    return out


def topk_merge_ref(shards: Sequence[tuple[Tensor, Tensor]], k: int) -> Tensor:
    """Top-k over the union of per-rank candidate shards ``[(scores, ids), ...]``:
    ``topk_select_ref`` over their concatenation along dim 1."""
    check(len(shards) >= 1, "shards", "at least one (scores, ids) shard", len(shards))
    for r, shard in enumerate(shards):
        check(isinstance(shard, (tuple, list)) and len(shard) == 2, f"shards[{r}]", "a (scores, ids) pair",
              type(shard).__name__)
        check_topk_inputs(shard[0], shard[1], k, f"shards[{r}].scores", f"shards[{r}].ids")
        check_size(shard[0], f"shards[{r}].scores", 0, shards[0][0].size(0))
    scores = torch.cat([s for s, _ in shards], dim=1)
    ids = torch.cat([i for _, i in shards], dim=1)
    return topk_select_ref(scores, ids, k)


# ---------------------------------------------------------------------------
# Output/LSE boundary.
# ---------------------------------------------------------------------------


def _weighted_sum(partial_out: Tensor, w: Tensor) -> Tensor:
    """sum_n w_n * O_n in ``w.dtype``, shard order; a zero-weight term adds an
    exact 0 even when its payload is NaN, inf or stale."""
    acc = torch.zeros(partial_out.shape[1:], dtype=w.dtype, device=partial_out.device)
    for i in range(partial_out.size(0)):
        wi = w[i].unsqueeze(-1)
        acc = acc + torch.where(wi != 0, wi * partial_out[i].to(w.dtype), 0.0)
    return acc


def _check_lse_stack(partial_out: Tensor, partial_lse: Tensor) -> None:
    check_partials(partial_out, partial_lse, 3, torch.float32, torch.float64)
    check(partial_out.size(0) >= 1, "partial_out", "at least one shard at dim 0", partial_out.size(0))


def lse_combine_ref(partial_out: Tensor, partial_lse: Tensor, base2: bool = False) -> tuple[Tensor, Tensor]:
    """LSE-weighted combine of ``N`` stacked partials ``[N, T, H, D]`` / ``[N, T, H]``.

    Weights and accumulation in fp32, one rounding to ``partial_out.dtype``.
    Returns ``(out [T, H, D], lse [T, H] fp32)``; ``base2`` uses exp2/log2.
    """
    _check_lse_stack(partial_out, partial_lse)
    w, big_l = lse_weights(partial_lse.float(), base2)
    return _weighted_sum(partial_out, w).to(partial_out.dtype), big_l


def lse_combine_ref64(partial_out: Tensor, partial_lse: Tensor, base2: bool = False) -> tuple[Tensor, Tensor]:
    """``lse_combine_ref`` in float64 (for tests): returns float64 ``(out, lse)``."""
    _check_lse_stack(partial_out, partial_lse)
    w, big_l = lse_weights(partial_lse.double(), base2)
    return _weighted_sum(partial_out, w), big_l


def output_lse_shard(out: Tensor, lse: Tensor | None, rank: int, world_size: int
                     ) -> tuple[Tensor, Tensor | None]:
    """Rank ``rank``'s heads ``[rank*H/N, (rank+1)*H/N)`` of a combined
    ``out [T, H, D]`` and ``lse [T, H]`` (``lse`` may be None)."""
    n = check_positive_int(world_size, "world_size", named=True)
    check(isinstance(rank, int) and 0 <= rank < n, "rank", f"an int in [0, {n})", rank)
    check_dim(out, "out", 3)
    heads = out.size(1)
    check(heads % n == 0, "out", f"heads divisible by the world size {n}", heads)
    hl = heads // n
    sl = slice(rank * hl, (rank + 1) * hl)
    if lse is not None:
        check_dim(lse, "lse", 2)
        check(lse.shape == out.shape[:2], "lse", f"shape {list(out.shape[:2])}", f"shape {list(lse.shape)}")
        return out[:, sl], lse[:, sl]
    return out[:, sl], None


