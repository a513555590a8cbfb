"""Exact references in plain PyTorch, and the collective paths engines run today.

Everything here runs on any device and is deliberately simple: it is the
specification the kernels are tested against (DESIGN.md section 2), and the
collective functions are both the fallback and the benchmark baseline.

- Token ownership: ``token_owner``, ``token_local_index``, ``token_global_index``.
- Query: ``query_rope_quant_ref`` (bit-identical to ``torch.ops.sdcp.query_rope_quant``)
  and ``query_gathered_layout``.
- Top-K: ``topk_select_ref`` (bit-identical to ``torch.ops.sdcp.topk_select``, order
  included) and ``topk_merge_ref``.
- Output/LSE: ``lse_combine_ref`` (fp32), ``lse_combine_ref64`` (fp64) and
  ``output_lse_shard``.
- Collectives through torch.distributed: ``query_all_gather``,
  ``topk_all_gather_merge``, ``lse_all_gather_reduce_scatter`` (the exact
  reference in eager ops) and ``lse_all_gather_correct_reduce_scatter`` (the
  fused path engines run: the fallback and the baseline).

The reference functions must run eagerly: a compiler is free to fuse a product
and a sum into one FMA, which would break the bit-exactness they promise.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "token_owner",
    "token_local_index",
    "token_global_index",
    "query_rope_quant_ref",
    "query_gathered_layout",
    "topk_select_ref",
    "topk_merge_ref",
    "lse_combine_ref",
    "lse_combine_ref64",
    "output_lse_shard",
    "query_all_gather",
    "topk_all_gather_merge",
    "lse_all_gather_reduce_scatter",
    "lse_all_gather_correct_reduce_scatter",
]

IntOrTensor = Union[int, Tensor]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------------------
# Argument checks (project style: name the argument, the expected and the
# actual value).
# ---------------------------------------------------------------------------


def _arg_error(arg: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"torch_sdcp: argument '{arg}': expected {expected}, got {actual}")


def _check(cond: bool, arg: str, expected: str, actual: object) -> None:
    if not cond:
        raise _arg_error(arg, expected, actual)


def _check_tensor(t: object, arg: str) -> None:
    _check(isinstance(t, Tensor), arg, "a Tensor", type(t).__name__)


def _check_dim(t: Tensor, arg: str, dim: int) -> None:
    _check_tensor(t, arg)
    _check(t.dim() == dim, arg, f"a {dim}-D tensor", f"shape {list(t.shape)}")


def _check_dtype(t: Tensor, arg: str, *dtypes: torch.dtype) -> None:
    want = " or ".join(str(d) for d in dtypes)
    _check(t.dtype in dtypes, arg, f"dtype {want}", f"dtype {t.dtype}")


def _check_size(t: Tensor, arg: str, d: int, want: int) -> None:
    _check(t.size(d) == want, arg, f"size {want} in dimension {d}", f"shape {list(t.shape)}")


def _check_same_device(t: Tensor, arg: str, ref: Tensor, ref_arg: str) -> None:
    _check(t.device == ref.device, arg, f"the device of '{ref_arg}' ({ref.device})", f"device {t.device}")


def _check_positive_int(value: object, arg: str) -> int:
    # bool is an int in Python, but never a meaningful size.
    _check(isinstance(value, int) and not isinstance(value, bool), arg, f"{arg} to be an int",
           type(value).__name__)
    _check(value >= 1, arg, f"{arg} >= 1", value)
    return value


def _check_index(value: IntOrTensor, arg: str) -> None:
    # Python ints are checked eagerly. Tensors only have their dtype checked:
    # a value check would read device memory (a host sync, and impossible
    # inside CUDA graph capture).
    if isinstance(value, Tensor):
        _check(not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool,
               arg, "an integer tensor", f"dtype {value.dtype}")
    else:
        _check(isinstance(value, int) and not isinstance(value, bool), arg, "an int or an integer tensor",
               type(value).__name__)
        _check(value >= 0, arg, f"{arg} >= 0", value)


# ---------------------------------------------------------------------------
# Token ownership (DESIGN.md section 2): one helper, used everywhere.
# ---------------------------------------------------------------------------


def token_owner(g: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Rank that owns global token ``g``: ``(g // I) % N``."""
    n = _check_positive_int(world_size, "world_size")
    i = _check_positive_int(interleave, "interleave")
    _check_index(g, "g")
    return (g // i) % n


def token_local_index(g: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Index of global token ``g`` in its owner's shard: ``(g // (I*N))*I + g % I``."""
    n = _check_positive_int(world_size, "world_size")
    i = _check_positive_int(interleave, "interleave")
    _check_index(g, "g")
    return (g // (i * n)) * i + g % i


def token_global_index(j: IntOrTensor, rank: IntOrTensor, world_size: int, interleave: int = 1) -> IntOrTensor:
    """Global token of local index ``j`` on ``rank``: ``(j // I)*N*I + rank*I + j % I``."""
    n = _check_positive_int(world_size, "world_size")
    i = _check_positive_int(interleave, "interleave")
    _check_index(j, "j")
    _check_index(rank, "rank")
    if not isinstance(rank, Tensor):
        _check(rank < n, "rank", f"rank < world_size = {n}", rank)
    return (j // i) * n * i + rank * i + j % i


# ---------------------------------------------------------------------------
# Query boundary.
# ---------------------------------------------------------------------------


def _check_query_inputs(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                        q_scale: Optional[Tensor], out_dtype: torch.dtype, allow_fp32: bool) -> None:
    _check_dim(ql_nope, "ql_nope", 3)
    _check_dim(q_pe, "q_pe", 3)
    _check_dtype(ql_nope, "ql_nope", torch.bfloat16)
    _check_dtype(q_pe, "q_pe", torch.bfloat16)
    _check_size(q_pe, "q_pe", 0, ql_nope.size(0))
    _check_size(q_pe, "q_pe", 1, ql_nope.size(1))
    rope = q_pe.size(2)
    _check(rope > 0 and rope % 2 == 0, "q_pe", "an even, positive last dimension", rope)
    _check_dim(positions, "positions", 1)
    _check_size(positions, "positions", 0, ql_nope.size(0))
    _check_dtype(positions, "positions", torch.int64, torch.int32)
    _check_dim(cos_sin_cache, "cos_sin_cache", 2)
    _check_size(cos_sin_cache, "cos_sin_cache", 1, rope)
    _check_dtype(cos_sin_cache, "cos_sin_cache", torch.float32, torch.bfloat16)
    _check_same_device(q_pe, "q_pe", ql_nope, "ql_nope")
    _check_same_device(positions, "positions", ql_nope, "ql_nope")
    _check_same_device(cos_sin_cache, "cos_sin_cache", ql_nope, "ql_nope")
    allowed = (torch.bfloat16, torch.float8_e4m3fn) + ((torch.float32,) if allow_fp32 else ())
    _check(out_dtype in allowed, "out_dtype", " or ".join(str(d) for d in allowed), out_dtype)
    if q_scale is not None:
        _check_tensor(q_scale, "q_scale")
        _check(q_scale.numel() == 1, "q_scale", "one element", f"shape {list(q_scale.shape)}")
        _check_dtype(q_scale, "q_scale", torch.float32)
        _check_same_device(q_scale, "q_scale", ql_nope, "ql_nope")
        _check(out_dtype == torch.float8_e4m3fn, "q_scale", "None for a non-fp8 output", "a scale tensor")


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
        _check(lo >= 0 and hi < cos_sin_cache.size(0), "positions",
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
    # Saturate; torch.clamp keeps NaN as NaN, and the cast keeps it NaN.
    out = torch.clamp(out, -E4M3_MAX, E4M3_MAX)
    return out.to(torch.float8_e4m3fn)


def query_gathered_layout(per_rank_outputs: Sequence[Tensor]) -> Tensor:
    """The gathered query: per-rank ``[T, H_loc, W]`` outputs concatenated on heads
    (head index ``src_rank * H_loc + h``), exactly ``all_gather`` on dim 1."""
    _check(len(per_rank_outputs) >= 1, "per_rank_outputs", "at least one tensor", len(per_rank_outputs))
    first = per_rank_outputs[0]
    for r, t in enumerate(per_rank_outputs):
        _check_dim(t, f"per_rank_outputs[{r}]", 3)
        _check(t.shape == first.shape, f"per_rank_outputs[{r}]", f"shape {list(first.shape)}",
               f"shape {list(t.shape)}")
        _check_dtype(t, f"per_rank_outputs[{r}]", first.dtype)
    return torch.cat(list(per_rank_outputs), dim=1)


# ---------------------------------------------------------------------------
# Top-K boundary.
# ---------------------------------------------------------------------------


def _check_topk_inputs(scores: Tensor, ids: Tensor, k: int, scores_arg: str = "scores",
                       ids_arg: str = "ids") -> None:
    _check_dim(scores, scores_arg, 2)
    _check_dim(ids, ids_arg, 2)
    _check_dtype(scores, scores_arg, torch.float32)
    _check_dtype(ids, ids_arg, torch.int32)
    _check_size(ids, ids_arg, 0, scores.size(0))
    _check_size(ids, ids_arg, 1, scores.size(1))
    _check_same_device(ids, ids_arg, scores, scores_arg)
    _check(isinstance(k, int) and not isinstance(k, bool), "k", "an int", type(k).__name__)
    _check(k >= 1, "k", "k >= 1", k)


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
    _check(len(shards) >= 1, "shards", "at least one (scores, ids) shard", len(shards))
    for r, shard in enumerate(shards):
        _check(isinstance(shard, (tuple, list)) and len(shard) == 2, f"shards[{r}]", "a (scores, ids) pair",
               type(shard).__name__)
        _check_topk_inputs(shard[0], shard[1], k, f"shards[{r}].scores", f"shards[{r}].ids")
        _check_size(shard[0], f"shards[{r}].scores", 0, shards[0][0].size(0))
    scores = torch.cat([s for s, _ in shards], dim=1)
    ids = torch.cat([i for _, i in shards], dim=1)
    return topk_select_ref(scores, ids, k)


# ---------------------------------------------------------------------------
# Output/LSE boundary.
# ---------------------------------------------------------------------------


def _lse_weights(lse: Tensor, base2: bool) -> Tuple[Tensor, Tensor]:
    """Combine weights ``w [N, ...]`` and global LSE ``L [...]`` of stacked shard
    LSEs ``lse [N, ...]``, computed in ``lse.dtype`` (DESIGN.md section 2)."""
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


def _check_lse_stack(partial_out: Tensor, partial_lse: Tensor) -> None:
    _check_dim(partial_out, "partial_out", 4)
    _check_dim(partial_lse, "partial_lse", 3)
    _check(partial_out.is_floating_point() and partial_out.element_size() >= 2, "partial_out",
           "a float32, float16 or bfloat16 tensor", f"dtype {partial_out.dtype}")
    _check_dtype(partial_lse, "partial_lse", torch.float32, torch.float64)
    for d in range(3):
        _check_size(partial_lse, "partial_lse", d, partial_out.size(d))
    _check_same_device(partial_lse, "partial_lse", partial_out, "partial_out")
    _check(partial_out.size(0) >= 1, "partial_out", "at least one shard in dimension 0", partial_out.size(0))


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
    n = _check_positive_int(world_size, "world_size")
    _check(isinstance(rank, int) and 0 <= rank < n, "rank", f"an int in [0, {n})", rank)
    _check_dim(out, "out", 3)
    heads = out.size(1)
    _check(heads % n == 0, "out", f"heads divisible by the world size {n}", heads)
    hl = heads // n
    sl = slice(rank * hl, (rank + 1) * hl)
    if lse is not None:
        _check_dim(lse, "lse", 2)
        _check(lse.shape == out.shape[:2], "lse", f"shape {list(out.shape[:2])}", f"shape {list(lse.shape)}")
        return out[:, sl], lse[:, sl]
    return out[:, sl], None


# ---------------------------------------------------------------------------
# Collective paths through torch.distributed (gloo on CPU, NCCL on GPU).
# ---------------------------------------------------------------------------

# torch >= 2.12 names the tensor collectives *_single and deprecates the old
# names; older releases (the GPU machine runs 2.11) only have the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _unsupported_on_gloo(error: Exception, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``error`` is gloo refusing a collective it does not implement."""
    return "gloo" in str(dist.get_backend(group)) and "support" in str(error).lower()


def _all_gather_stack(x: Tensor, group: Optional[dist.ProcessGroup], use_list: bool = False) -> Tensor:
    """``[N, *x.shape]`` rank-major stack of every rank's ``x``."""
    n = dist.get_world_size(group)
    x = x.contiguous()  # x.dim() >= 1 for every caller
    out = x.new_empty((n,) + tuple(x.shape))
    if not use_list:
        try:
            # The concatenation form [N*x0, ...]: gloo rejects the stacked
            # form [N, x0, ...] (NCCL takes both).
            _all_gather_tensor(out.view((n * x.size(0),) + tuple(x.shape[1:])), x, group=group)
            return out
        except (RuntimeError, NotImplementedError) as e:
            # Older gloo builds lack the single-tensor form. That failure is
            # raised before any communication, identically on every rank;
            # anything else (a timeout, a peer gone) is not retried.
            if not _unsupported_on_gloo(e, group):
                raise
    dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


def _reduce_scatter_dim0(x: Tensor, group: Optional[dist.ProcessGroup], use_all_reduce: bool = False) -> Tensor:
    """Sum of every rank's ``x`` (in ``x.dtype``), keeping this rank's
    ``1/N`` slice of dim 0."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    part = x.size(0) // n
    if not use_all_reduce:
        out = x.new_empty((part,) + tuple(x.shape[1:]))
        try:
            _reduce_scatter_tensor(out, x, group=group)
            return out
        except (RuntimeError, NotImplementedError) as e:
            if not _unsupported_on_gloo(e, group):  # see _all_gather_stack
                raise
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x[rank * part:(rank + 1) * part]


def query_all_gather(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                     q_scale: Optional[Tensor] = None, neox: bool = False,
                     out_dtype: torch.dtype = torch.bfloat16,
                     group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Collective query path: the local producer kernel, then all_gather on heads.
    Returns ``[T, N*H_loc, Dn + R]`` in ``out_dtype``."""
    _check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype, allow_fp32=False)
    local = torch.ops.sdcp.query_rope_quant(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype)
    rows, hl, width = local.shape
    # Gather raw bytes: gloo has no float8 (and not every build has bf16).
    stacked = _all_gather_stack(local.view(torch.uint8), group)  # [N, T, H_loc, W*eb]
    n = stacked.size(0)
    gathered = stacked.permute(1, 0, 2, 3).reshape(rows, n * hl, -1)
    return gathered.view(out_dtype)


def topk_all_gather_merge(scores: Tensor, ids: Tensor, k: int,
                          group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Collective top-K path: all_gather of the ``(score, id)`` pairs, then
    ``torch.ops.sdcp.topk_select`` over the ``N*C`` gathered candidates.
    Returns ``[T, k]`` int32 global ids."""
    _check_topk_inputs(scores, ids, k)
    rows, c = scores.shape
    # One packed tensor, one collective: [T, C, 2] int32 of (score bits, id).
    packed = torch.stack([scores.contiguous().view(torch.int32), ids], dim=-1)
    stacked = _all_gather_stack(packed, group)  # [N, T, C, 2]
    n = stacked.size(0)
    merged = stacked.permute(1, 0, 2, 3).reshape(rows, n * c, 2)
    all_scores = merged[..., 0].contiguous().view(torch.float32)
    all_ids = merged[..., 1].contiguous()
    return torch.ops.sdcp.topk_select(all_scores, all_ids, k)


def lse_all_gather_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool = False,
                                  return_lse: bool = False, group: Optional[dist.ProcessGroup] = None,
                                  ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Collective Output/LSE path (vLLM's ``cp_lse_ag_out_rs``): all_gather the
    LSE, rescale this rank's partial output by its weight, reduce_scatter on heads.

    Returns ``[T, H/N, D]`` in ``partial_out.dtype`` for this rank's heads, and
    with ``return_lse`` also their global LSE ``[T, H/N]`` fp32. The sum runs
    in the communication dtype, so it is close to, never bitwise equal to,
    ``lse_combine_ref``.
    """
    return _lse_all_gather_reduce_scatter(partial_out, partial_lse, base2, return_lse, group)


def _lse_all_gather_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool, return_lse: bool,
                                   group: Optional[dist.ProcessGroup], use_all_reduce: bool = False,
                                   ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    # use_all_reduce forces the all_reduce + slice fallback (tests cover both).
    _check_dim(partial_out, "partial_out", 3)
    _check_dim(partial_lse, "partial_lse", 2)
    _check(partial_out.is_floating_point() and partial_out.element_size() >= 2, "partial_out",
           "a float32, float16 or bfloat16 tensor", f"dtype {partial_out.dtype}")
    _check_dtype(partial_lse, "partial_lse", torch.float32)
    _check_size(partial_lse, "partial_lse", 0, partial_out.size(0))
    _check_size(partial_lse, "partial_lse", 1, partial_out.size(1))
    _check_same_device(partial_lse, "partial_lse", partial_out, "partial_out")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    heads = partial_out.size(1)
    _check(heads % n == 0, "partial_out", f"heads divisible by the world size {n}", heads)
    lses = _all_gather_stack(partial_lse, group)  # [N, T, H] fp32
    w, big_l = _lse_weights(lses, base2)
    wr = w[rank].unsqueeze(-1)
    # where, not a product: a zero-weight payload (possibly NaN) must add 0.
    scaled = torch.where(wr != 0, partial_out.float() * wr, 0.0).to(partial_out.dtype)
    # reduce_scatter splits dim 0: make heads leading, then transpose back.
    shard = _reduce_scatter_dim0(scaled.transpose(0, 1), group, use_all_reduce)  # [H/N, T, D]
    out = shard.transpose(0, 1).contiguous()
    if not return_lse:
        return out
    hl = heads // n
    return out, big_l[:, rank * hl:(rank + 1) * hl].contiguous()


def lse_all_gather_correct_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool = False,
                                          return_lse: bool = False, group: Optional[dist.ProcessGroup] = None,
                                          *, out: Optional[Tensor] = None, out_lse: Optional[Tensor] = None,
                                          ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Collective Output/LSE path as engines run it: all_gather of the LSE
    ``[T, H]`` into ``[N, T, H]``, ONE fused correction kernel
    (``torch.ops.sdcp.lse_correct``: the global LSE and this rank's weighted
    partial, written head-major ``[H, T, D]``), then reduce_scatter (sum) on
    heads, dim 0, with no transpose copy.

    Returns this rank's heads ``[T, H/N, D]`` as a view of the head-major
    ``[H/N, T, D]`` reduce_scatter output (or ``out``, a caller-owned
    ``[T, H/N, D]`` it is copied into), and with ``return_lse`` their global
    LSE ``[T, H/N]`` fp32 (a column slice of ``[T, H]``, or ``out_lse``).
    Same semantics and the same sanitising as ``lse_all_gather_reduce_scatter``;
    the sum runs in the communication dtype (close to, not bitwise equal to,
    ``lse_combine_ref``). On gloo without reduce_scatter it falls back to
    all_reduce + slice.
    """
    return _lse_all_gather_correct_reduce_scatter(partial_out, partial_lse, base2, return_lse, group, out, out_lse)


def _lse_all_gather_correct_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool, return_lse: bool,
                                           group: Optional[dist.ProcessGroup], out: Optional[Tensor] = None,
                                           out_lse: Optional[Tensor] = None, use_all_reduce: bool = False,
                                           ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    # use_all_reduce forces the all_reduce + slice fallback (tests cover both).
    _check_dim(partial_out, "partial_out", 3)
    _check_dim(partial_lse, "partial_lse", 2)
    _check(partial_out.is_floating_point() and partial_out.element_size() >= 2, "partial_out",
           "a float32, float16 or bfloat16 tensor", f"dtype {partial_out.dtype}")
    _check_dtype(partial_lse, "partial_lse", torch.float32)
    _check_size(partial_lse, "partial_lse", 0, partial_out.size(0))
    _check_size(partial_lse, "partial_lse", 1, partial_out.size(1))
    _check_same_device(partial_lse, "partial_lse", partial_out, "partial_out")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, heads, dim = partial_out.shape
    _check(heads % n == 0, "partial_out", f"heads divisible by the world size {n}", heads)
    hl = heads // n
    if out is not None:
        _check_tensor(out, "out")
        _check(tuple(out.shape) == (rows, hl, dim), "out", f"shape {[rows, hl, dim]}", f"shape {list(out.shape)}")
        _check_dtype(out, "out", partial_out.dtype)
    if out_lse is not None:
        _check_tensor(out_lse, "out_lse")
        _check(tuple(out_lse.shape) == (rows, hl), "out_lse", f"shape {[rows, hl]}", f"shape {list(out_lse.shape)}")
        _check_dtype(out_lse, "out_lse", torch.float32)
    lses = _all_gather_stack(partial_lse, group)  # [N, T, H] fp32
    scaled, big_l = torch.ops.sdcp.lse_correct(partial_out.contiguous(), lses, rank, base2)  # [H, T, D], [T, H]
    shard = _reduce_scatter_dim0(scaled, group, use_all_reduce).transpose(0, 1)  # [T, H/N, D] view
    if out is not None:
        out.copy_(shard)
        shard = out
    if not return_lse:
        return shard
    lse = big_l[:, rank * hl:(rank + 1) * hl]
    if out_lse is not None:
        out_lse.copy_(lse)
        lse = out_lse
    return shard, lse
