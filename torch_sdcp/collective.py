"""The collective paths engines run today, through torch.distributed (gloo on
CPU, NCCL on GPU): the fallback of every workspace (more rows than its bound,
or a group without peer memory) and the benchmark baseline.

- Query: ``query_all_gather`` (the local producer kernel, then all_gather on heads).
- Top-K: ``topk_all_gather_merge`` (all_gather of the candidate pairs, then a top-k).
- Output/LSE: ``lse_all_gather_correct_reduce_scatter`` (LSE all_gather, one fused
  correction kernel, head reduce_scatter: what engines run; the fallback and the
  baseline) and ``lse_all_gather_reduce_scatter`` (the same in eager ops).

Every rank of ``group`` calls them in the same order. Their inputs are checked
before any collective, with the helpers of :mod:`torch_sdcp._checks` (as the
ops check theirs), so that a bad argument is raised before this rank sends
anything. ``all_gather_stack`` is the rank-major all_gather the engine faces
use too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp._checks import (
    check,
    check_bool,
    check_contiguous,
    check_dim,
    check_dtype,
    check_partials,
    check_query_inputs,
    check_same_device,
    check_tensor,
    check_topk_inputs,
)
from torch_sdcp.semantics import lse_weights

__all__ = [
    "all_gather_stack",
    "query_all_gather",
    "all_gather_heads",
    "topk_all_gather_merge",
    "lse_all_gather_reduce_scatter",
    "lse_all_gather_correct_reduce_scatter",
]

# torch >= 2.12 names the tensor collectives *_single and deprecates the old
# names; older releases (the GPU machine runs 2.11) only have the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _unsupported_on_gloo(error: Exception, group: dist.ProcessGroup | None) -> bool:
    """Whether ``error`` is gloo refusing a collective it does not implement."""
    return "gloo" in str(dist.get_backend(group)) and "support" in str(error).lower()


def all_gather_stack(x: Tensor, group: dist.ProcessGroup | None, use_list: bool = False) -> Tensor:
    """``[N, *x.shape]`` rank-major stack of every rank's ``x`` (at least 1-D;
    raw bytes through gloo need ``x.view(torch.uint8)`` for dtypes it lacks).
    ``use_list`` forces the list form of all_gather (tests cover both)."""
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


_all_gather_stack = all_gather_stack  # the former private name, kept for callers that still use it


def _reduce_scatter_dim0(x: Tensor, group: dist.ProcessGroup | None, use_all_reduce: bool = False) -> Tensor:
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
            if not _unsupported_on_gloo(e, group):  # see all_gather_stack
                raise
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x[rank * part:(rank + 1) * part]


def query_all_gather(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                     q_scale: Tensor | None = None, neox: bool = False,
                     out_dtype: torch.dtype = torch.bfloat16,
                     group: dist.ProcessGroup | None = None) -> Tensor:
    """Collective query path: the local producer kernel, then all_gather on heads.
    Returns ``[T, N*H_loc, Dn + R]`` in ``out_dtype``."""
    check_query_inputs(ql_nope, q_pe, positions, cos_sin_cache, q_scale, out_dtype)
    local = torch.ops.sdcp.query_rope_quant(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype)
    rows, hl, width = local.shape
    # Gather raw bytes: gloo has no float8 (and not every build has bf16).
    stacked = all_gather_stack(local.view(torch.uint8), group)  # [N, T, H_loc, W*eb]
    n = stacked.size(0)
    gathered = stacked.permute(1, 0, 2, 3).reshape(rows, n * hl, -1)
    return gathered.view(out_dtype)


def all_gather_heads(q: Tensor, group: dist.ProcessGroup | None = None, out: Tensor | None = None) -> Tensor:
    """Collective all_gather on heads of a query produced elsewhere:
    ``q [T, H_loc, W]`` on every rank -> ``[T, N*H_loc, W]`` (into ``out`` when
    given: contiguous, that shape, ``q``'s dtype and device), raw bytes (gloo
    has no float8). ``out`` is checked before anything is sent."""
    check_dim(q, "q", 3)
    rows, hl, width = q.shape
    n = dist.get_world_size(group)
    if out is not None:
        check_tensor(out, "out")
        check(tuple(out.shape) == (rows, n * hl, width), "out", f"shape {[rows, n * hl, width]}",
              f"shape {list(out.shape)}")
        check_dtype(out, "out", q.dtype)
        check_contiguous(out, "out")
        check_same_device(out, "out", q, "q")
    stacked = all_gather_stack(q.contiguous().view(torch.uint8), group)  # [N, T, H_loc, W*eb]
    if out is None:
        out = q.new_empty((rows, n * hl, width))
    out.view(torch.uint8).view(rows, n, hl, -1).copy_(stacked.permute(1, 0, 2, 3))
    return out


def topk_all_gather_merge(scores: Tensor, ids: Tensor, k: int,
                          group: dist.ProcessGroup | None = None) -> Tensor:
    """Collective top-K path: all_gather of the ``(score, id)`` pairs, then
    ``torch.ops.sdcp.topk_select`` over the ``N*C`` gathered candidates.
    Returns ``[T, k]`` int32 global ids."""
    check_topk_inputs(scores, ids, k)
    rows, c = scores.shape
    # One packed tensor, one collective: [T, C, 2] int32 of (score bits, id).
    packed = torch.stack([scores.contiguous().view(torch.int32), ids], dim=-1)
    stacked = all_gather_stack(packed, group)  # [N, T, C, 2]
    n = stacked.size(0)
    merged = stacked.permute(1, 0, 2, 3).reshape(rows, n * c, 2)
    all_scores = merged[..., 0].contiguous().view(torch.float32)
    all_ids = merged[..., 1].contiguous()
    return torch.ops.sdcp.topk_select(all_scores, all_ids, k)


def _check_lse_options(base2: object, return_lse: object) -> None:
    """Flags are bools: ``return_lse="no"`` is truthy and would return a pair."""
    check_bool(base2, "base2")
    check_bool(return_lse, "return_lse")


def lse_all_gather_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool = False,
                                  return_lse: bool = False, group: dist.ProcessGroup | None = None,
                                  ) -> Tensor | tuple[Tensor, Tensor]:
    """Collective Output/LSE path (vLLM's ``cp_lse_ag_out_rs``): all_gather the
    LSE, rescale this rank's partial output by its weight, reduce_scatter on heads.

    Returns ``[T, H/N, D]`` in ``partial_out.dtype`` for this rank's heads, and
    with ``return_lse`` also their global LSE ``[T, H/N]`` fp32. The sum runs
    in the communication dtype, so it is close to, never bitwise equal to,
    ``lse_combine_ref``.
    """
    return _lse_all_gather_reduce_scatter(partial_out, partial_lse, base2, return_lse, group)


def _lse_all_gather_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool, return_lse: bool,
                                   group: dist.ProcessGroup | None, use_all_reduce: bool = False,
                                   ) -> Tensor | tuple[Tensor, Tensor]:
    # use_all_reduce forces the all_reduce + slice fallback (tests cover both).
    _check_lse_options(base2, return_lse)
    check_partials(partial_out, partial_lse, 2, torch.float32)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    heads = partial_out.size(1)
    check(heads % n == 0, "partial_out", f"heads divisible by the world size {n}", heads)
    lses = all_gather_stack(partial_lse, group)  # [N, T, H] fp32
    w, big_l = lse_weights(lses, base2)
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
                                          return_lse: bool = False, group: dist.ProcessGroup | None = None,
                                          *, out: Tensor | None = None, out_lse: Tensor | None = None,
                                          ) -> Tensor | tuple[Tensor, Tensor]:
    """Collective Output/LSE path as engines run it (the fallback and the
    baseline): all_gather of the LSE ``[T, H]`` into ``[N, T, H]``, ONE fused
    correction kernel (``torch.ops.sdcp.lse_correct``: the global LSE and this
    rank's weighted partial, written head-major ``[H, T, D]``), then
    reduce_scatter (sum) on heads, dim 0, with no transpose copy.

    Returns this rank's heads ``[T, H/N, D]`` as a view of the head-major
    ``[H/N, T, D]`` reduce_scatter output (or ``out``, a caller-owned
    ``[T, H/N, D]`` it is copied into), and with ``return_lse`` their global
    LSE ``[T, H/N]`` fp32 (a column slice of ``[T, H]``, or ``out_lse``).
    Same semantics and sanitising as ``lse_all_gather_reduce_scatter``; the
    sum runs in the communication dtype (close to, not bitwise equal to,
    ``reference.lse_combine_ref``). On gloo without reduce_scatter it falls
    back to all_reduce + slice.
    """
    return _lse_all_gather_correct_reduce_scatter(partial_out, partial_lse, base2, return_lse, group, out, out_lse)


def _lse_all_gather_correct_reduce_scatter(partial_out: Tensor, partial_lse: Tensor, base2: bool, return_lse: bool,
                                           group: dist.ProcessGroup | None, out: Tensor | None = None,
                                           out_lse: Tensor | None = None, use_all_reduce: bool = False,
                                           ) -> Tensor | tuple[Tensor, Tensor]:
    # use_all_reduce forces the all_reduce + slice fallback (tests cover both).
    _check_lse_options(base2, return_lse)
    check_partials(partial_out, partial_lse, 2, torch.float32)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, heads, dim = partial_out.shape
    check(heads % n == 0, "partial_out", f"heads divisible by the world size {n}", heads)
    hl = heads // n
    if out is not None:
        check_tensor(out, "out")
        check(tuple(out.shape) == (rows, hl, dim), "out", f"shape {[rows, hl, dim]}", f"shape {list(out.shape)}")
        check_dtype(out, "out", partial_out.dtype)
    if out_lse is not None:
        check_tensor(out_lse, "out_lse")
        check(tuple(out_lse.shape) == (rows, hl), "out_lse", f"shape {[rows, hl]}", f"shape {list(out_lse.shape)}")
        check_dtype(out_lse, "out_lse", torch.float32)
    lses = all_gather_stack(partial_lse, group)  # [N, T, H] fp32
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
