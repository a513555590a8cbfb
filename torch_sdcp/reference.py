"""Exact references in plain PyTorch.

Everything here runs on any device and is deliberately simple: it is the
specification the kernels are tested against (docs/DESIGN.md section 2). The
collective paths engines run today (the fallback and the benchmark baseline)
are in :mod:`torch_sdcp.collective`.

- Token ownership: ``token_owner``, ``token_local_index``, ``token_global_index``.
- Query: ``query_rope_quant_ref`` (bit-identical to ``torch.ops.sdcp.query_rope_quant``),
  ``query_gathered_layout`` and ``query_all_gather_heads_ref``.
- Top-K: ``topk_select_ref`` (bit-identical to ``torch.ops.sdcp.topk_select``, order
  included) and ``topk_merge_ref``.
- Output/LSE: ``lse_combine_ref`` (fp32), ``lse_combine_ref64`` (fp64) and
  ``output_lse_shard``.

The reference functions must run eagerly: a compiler is free to fuse a product
and a sum into one FMA, which would break the bit-exactness they promise.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from torch_sdcp._checks import (arg_error, check, check_dim, check_dtype, check_int, check_positive_int,
                                check_same_device, check_size, check_tensor)

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
]

IntOrTensor = Union[int, Tensor]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def _check_index(value: IntOrTensor, arg: str) -> None:
    # Python ints are checked eagerly. Tensors only have their dtype checked:
    # a value check would read device memory (a host sync, and impossible
    # inside CUDA graph capture).
    if isinstance(value, Tensor):
        check(not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool,
              arg, "an integer tensor", f"dtype {value.dtype}")
    else:
        check_int(value, arg, 0, expected="an int or an integer tensor", bound=arg)


# ---------------------------------------------------------------------------
# Token ownership (docs/DESIGN.md section 2): one helper, used everywhere.
# ---------------------------------------------------------------------------


def token_owner(g: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Rank that owns global token ``g``: ``(g // I) % N``."""
    n = check_positive_int(world_size, "world_size", named=True)
    i = check_positive_int(interleave, "interleave", named=True)
    _check_index(g, "g")
    return (g // i) % n


def token_local_index(g: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Index of global token ``g`` in its owner's shard: ``(g // (I*N))*I + g % I``."""
    n = check_positive_int(world_size, "world_size", named=True)
    i = check_positive_int(interleave, "interleave", named=True)
    _check_index(g, "g")
    return (g // (i * n)) * i + g % i


def token_global_index(j: IntOrTensor, rank: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Global token of local index ``j`` on ``rank``: ``(j // I)*N*I + rank*I + j % I``."""
    n = check_positive_int(world_size, "world_size", named=True)
    i = check_positive_int(interleave, "interleave", named=True)
    _check_index(j, "j")
    _check_index(rank, "rank")
    if not isinstance(rank, Tensor):
        check(rank < n, "rank", f"rank < world_size = {n}", rank)
    return (j // i) * n * i + rank * i + j % i


# ---------------------------------------------------------------------------
# Query boundary.
# ---------------------------------------------------------------------------


def _check_query_inputs(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                        q_scale: Optional[Tensor], out_dtype: torch.dtype, allow_fp32: bool) -> None:
    check_dim(ql_nope, "ql_nope", 3)
    check_dim(q_pe, "q_pe", 3)
    check_dtype(ql_nope, "ql_nope", torch.bfloat16)
    check_dtype(q_pe, "q_pe", torch.bfloat16)
    check_size(q_pe, "q_pe", 0, ql_nope.size(0))
    check_size(q_pe, "q_pe", 1, ql_nope.size(1))
    rope = q_pe.size(2)
    check(rope > 0 and rope % 2 == 0, "q_pe", "an even, positive last dimension", rope)
    check_dim(positions, "positions", 1)
    check_size(positions, "positions", 0, ql_nope.size(0))
    check_dtype(positions, "positions", torch.int64, torch.int32)
    check_dim(cos_sin_cache, "cos_sin_cache", 2)
    check_size(cos_sin_cache, "cos_sin_cache", 1, rope)
    check_dtype(cos_sin_cache, "cos_sin_cache", torch.float32, torch.bfloat16)
    check_same_device(q_pe, "q_pe", ql_nope, "ql_nope")
    check_same_device(positions, "positions", ql_nope, "ql_nope")
    check_same_device(cos_sin_cache, "cos_sin_cache", ql_nope, "ql_nope")
    allowed = (torch.bfloat16, torch.float8_e4m3fn) + ((torch.float32,) if allow_fp32 else ())
    check(out_dtype in allowed, "out_dtype", " or ".join(str(d) for d in allowed), out_dtype)
    if q_scale is not None:
        check_tensor(q_scale, "q_scale")
        check(q_scale.numel() == 1, "q_scale", "one element", f"shape {list(q_scale.shape)}")
        check_dtype(q_scale, "q_scale", torch.float32)
        check_same_device(q_scale, "q_scale", ql_nope, "ql_nope")
        check(out_dtype == torch.float8_e4m3fn, "q_scale", "None for a non-fp8 output", "a scale tensor")


def query_rope_quant_ref(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                         q_scale: Optional[Tensor] = None, neox: bool = False,
                         out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Reference query producer: RoPE on ``q_pe``, concatenation with ``ql_nope``,
    then bf16 or saturating float8_e4m3fn (``x / q_scale``).

    Returns ``[T, H, Dn + R]`` in ``out_dtype``, bit-identical to
    ``torch.ops.sdcp.query_rope_quant``. ``out_dtype=torch.float32`` (reference
    only) returns the fp32 values before the final rounding.
    """
    _check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype, allow_fp32=True)
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
    if neox:
        roped = torch.cat([first, second], dim=-1)
    else:
        roped = torch.stack([first, second], dim=-1).flatten(-2)
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


def _check_topk_inputs(scores: Tensor, ids: Tensor, k: int, scores_arg: str = "scores",
                       ids_arg: str = "ids") -> None:
    check_dim(scores, scores_arg, 2)
    check_dim(ids, ids_arg, 2)
    check_dtype(scores, scores_arg, torch.float32)
    check_dtype(ids, ids_arg, torch.int32)
    check_size(ids, ids_arg, 0, scores.size(0))
    check_size(ids, ids_arg, 1, scores.size(1))
    check_same_device(ids, ids_arg, scores, scores_arg)
    check_int(k, "k", 1, bound="k")


def topk_select_ref(scores: Tensor, ids: Tensor, k: int) -> Tensor:
    """Stable top-k over candidate pairs ``(scores [T, M] fp32, ids [T, M] int32)``.

    Order: valid (id >= 0) before invalid; among valid, score descending with
    -0.0 == +0.0 and NaN below -inf (all NaNs equal); ties go to the lower id.
    Returns the first k ids ``[T, k]`` int32 in that order, -1 where fewer than
    k valid candidates exist.
    """
    _check_topk_inputs(scores, ids, k)
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


def topk_merge_ref(shards: Sequence[Tuple[Tensor, Tensor]], k: int) -> Tensor:
    """Top-k over the union of per-rank candidate shards ``[(scores, ids), ...]``:
    ``topk_select_ref`` over their concatenation along dim 1."""
    check(len(shards) >= 1, "shards", "at least one (scores, ids) shard", len(shards))
    for r, shard in enumerate(shards):
        check(isinstance(shard, (tuple, list)) and len(shard) == 2, f"shards[{r}]", "a (scores, ids) pair",
              type(shard).__name__)
        _check_topk_inputs(shard[0], shard[1], k, f"shards[{r}].scores", f"shards[{r}].ids")
        check_size(shard[0], f"shards[{r}].scores", 0, shards[0][0].size(0))
    scores = torch.cat([s for s, _ in shards], dim=1)
    ids = torch.cat([i for _, i in shards], dim=1)
    return topk_select_ref(scores, ids, k)


# ---------------------------------------------------------------------------
# Output/LSE boundary.
# ---------------------------------------------------------------------------


def _lse_weights(lse: Tensor, base2: bool) -> Tuple[Tensor, Tensor]:
    """Combine weights ``w [N, ...]`` and global LSE ``L [...]`` of stacked shard
    LSEs ``lse [N, ...]``, computed in ``lse.dtype`` (docs/DESIGN.md section 2)."""
    exp = torch.exp2 if base2 else torch.exp
    log = torch.log2 if base2 else torch.log
    inf = math.inf
    # NaN and +inf mean "empty shard".
    l = torch.where(torch.isnan(lse) | (lse == inf), -inf, lse)
    m = l.amax(dim=0)
    m = torch.where(m == -inf, 0.0, m)  # every shard empty: keep exp(l - m) at 0, not NaN
    e = exp(l - m)
    s = e[0]
    for i in range(1, e.size(0)):  # in shard order, like the kernels
        s = s + e[i]
    empty = s == 0
    big_l = torch.where(empty, -inf, m + log(s))
    # When every shard is empty, l - L is (-inf) - (-inf) = NaN: the weights are 0.
    w = torch.where(empty, 0.0, exp(l - big_l))
    return w, big_l


def _weighted_sum(partial_out: Tensor, w: Tensor) -> Tensor:
    """sum_n w_n * O_n in ``w.dtype``, shard order; a zero-weight term adds an
    exact 0 even when its payload is NaN, inf or stale."""
    acc = torch.zeros(partial_out.shape[1:], dtype=w.dtype, device=partial_out.device)
    for i in range(partial_out.size(0)):
        wi = w[i].unsqueeze(-1)
        acc = acc + torch.where(wi != 0, wi * partial_out[i].to(w.dtype), 0.0)
    return acc


def _check_partials(partial_out: Tensor, partial_lse: Tensor, lse_dim: int, *lse_dtypes: torch.dtype) -> None:
    """Partial outputs ``[..., T, H, D]`` and their LSEs ``[..., T, H]`` of
    ``lse_dim`` dimensions (``[N, T, H]`` stacked, ``[T, H]`` for one rank)."""
    check_dim(partial_out, "partial_out", lse_dim + 1)
    check_dim(partial_lse, "partial_lse", lse_dim)
    check(partial_out.is_floating_point() and partial_out.element_size() >= 2, "partial_out",
          "a float32, float16 or bfloat16 tensor", f"dtype {partial_out.dtype}")
    check_dtype(partial_lse, "partial_lse", *lse_dtypes)
    for d in range(lse_dim):
        check_size(partial_lse, "partial_lse", d, partial_out.size(d))
    check_same_device(partial_lse, "partial_lse", partial_out, "partial_out")


def _check_lse_stack(partial_out: Tensor, partial_lse: Tensor) -> None:
    _check_partials(partial_out, partial_lse, 3, torch.float32, torch.float64)
    check(partial_out.size(0) >= 1, "partial_out", "at least one shard in dimension 0", partial_out.size(0))


def lse_combine_ref(partial_out: Tensor, partial_lse: Tensor, base2: bool = False) -> Tuple[Tensor, Tensor]:
    """LSE-weighted combine of ``N`` stacked partials ``[N, T, H, D]`` / ``[N, T, H]``.

    Weights and accumulation in fp32, one rounding to ``partial_out.dtype``.
    Returns ``(out [T, H, D], lse [T, H] fp32)``; ``base2`` uses exp2/log2.
    """
    _check_lse_stack(partial_out, partial_lse)
    w, big_l = _lse_weights(partial_lse.float(), base2)
    return _weighted_sum(partial_out, w).to(partial_out.dtype), big_l


def lse_combine_ref64(partial_out: Tensor, partial_lse: Tensor, base2: bool = False) -> Tuple[Tensor, Tensor]:
    """``lse_combine_ref`` in float64 (for tests): returns float64 ``(out, lse)``."""
    _check_lse_stack(partial_out, partial_lse)
    w, big_l = _lse_weights(partial_lse.double(), base2)
    return _weighted_sum(partial_out, w), big_l


def output_lse_shard(out: Tensor, lse: Optional[Tensor], rank: int, world_size: int
                     ) -> Tuple[Tensor, Optional[Tensor]]:
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


def check_mask_args(seq_lens: Optional[Tensor], query_start_loc: Optional[Tensor]) -> bool:
    """True when the empty-shard mask is asked for: ``seq_lens [R]`` and
    ``query_start_loc [R + 1]``, both or neither, 1-D int32 or int64 (the
    checks of csrc/output_lse.cpp, in its order). Shapes only: no device work."""
    if seq_lens is None and query_start_loc is None:
        return False
    if seq_lens is None or query_start_loc is None:
        missing = "seq_lens" if seq_lens is None else "query_start_loc"
        given = "query_start_loc" if seq_lens is None else "seq_lens"
        raise arg_error(missing, "a tensor, as 'seq_lens' and 'query_start_loc' are given both or neither",
                        f"None beside a given '{given}'")
    check_tensor(seq_lens, "seq_lens")
    check_tensor(query_start_loc, "query_start_loc")
    check_dim(seq_lens, "seq_lens", 1)
    check_dim(query_start_loc, "query_start_loc", 1)
    check(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc",
          f"{seq_lens.numel() + 1} entries (len(seq_lens) + 1)", query_start_loc.numel())
    for t, arg in ((seq_lens, "seq_lens"), (query_start_loc, "query_start_loc")):
        check(t.dtype in (torch.int32, torch.int64), arg, "dtype int32 or int64", f"dtype {t.dtype}")
    return True


def mask_empty_shards(lse: Tensor, seq_lens: Optional[Tensor], query_start_loc: Optional[Tensor]) -> Tensor:
    """vLLM's empty-shard mask (``mask_dcp_empty_shards_``), out of place:
    ``lse [T, H]`` with -inf in every row that must get no weight, rows at or
    past ``query_start_loc[-1]`` (CUDA-graph padding) and rows of requests
    whose local ``seq_len`` is 0 (an empty KV shard). The request of row t is
    the number of request ends ``query_start_loc[1:]`` at or before t, clamped
    to the last request; with no request every row is empty. No host
    synchronisation, no data-dependent shape (it can be captured). Without
    ``seq_lens`` / ``query_start_loc`` returns ``lse`` itself."""
    if not check_mask_args(seq_lens, query_start_loc):
        return lse
    assert seq_lens is not None and query_start_loc is not None
    if seq_lens.numel() == 0:  # no local request at all (warm-up): every row is empty
        return torch.full_like(lse, -math.inf)
    qsl = query_start_loc.to(lse.device)
    row = torch.arange(lse.shape[0], device=lse.device, dtype=qsl.dtype)
    request = torch.bucketize(row, qsl[1:], right=True).clamp_max(seq_lens.numel() - 1)
    empty = (row >= qsl[-1]) | (seq_lens.to(lse.device).index_select(0, request) == 0)
    return lse.masked_fill(empty.unsqueeze(-1), -math.inf)
