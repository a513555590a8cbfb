"""The exact semantics of docs/DESIGN.md section 2 that production paths
compute in PyTorch, written once: the engine faces, the collective paths and
the references (:mod:`torch_sdcp.reference`, which re-exports them) all use
these definitions.

- Token ownership: ``token_owner``, ``token_local_index``, ``token_global_index``.
- Output/LSE: ``lse_weights`` (the combine weights and the global LSE) and
  ``mask_empty_shards`` (vLLM's empty-shard mask, out of place).

They run eagerly on any device (csrc/semantics.h is their C++ twin).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torch_sdcp._checks import check, check_int, check_mask_args, check_positive_int

__all__ = ["token_owner", "token_local_index", "token_global_index", "lse_weights", "mask_empty_shards"]

IntOrTensor = int | Tensor


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
# Output/LSE.
# ---------------------------------------------------------------------------


def lse_weights(lse: Tensor, base2: bool) -> tuple[Tensor, Tensor]:
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


def mask_empty_shards(lse: Tensor, seq_lens: Tensor | None, query_start_loc: Tensor | None) -> Tensor:
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
