"""Inputs for the boundaries: a RoPE cos/sin cache for the query boundary and
score distributions for the top-K boundary, shared by the benchmark, the demo
and the tools.

The layout of `cos_sin_cache` (the query ops' cache argument) is
`[max_positions, rope_dim]` = cat(cos, sin) along the last dimension, in vLLM's
layout: row p holds cos(p * f_i) for the rope_dim / 2 frequencies f_i, then
sin(p * f_i).
"""

from __future__ import annotations

import torch

SCORE_DISTRIBUTIONS = ("uniform", "normal", "tied80", "equal")


def rope_cache(max_pos: int, rope: int) -> torch.Tensor:
    """A cos/sin cache [max_pos, rope] in the vLLM layout: cat(cos, sin)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def score_distribution(kind: str, t: int, c: int, g: torch.Generator) -> torch.Tensor:
    """Scores [t, c] of one of SCORE_DISTRIBUTIONS (the bench's
    --topk-distributions): uniform in [0, 1), standard normal, 80 distinct
    values, or all equal (ranked by id alone)."""
    if kind == "uniform":
        return torch.rand(t, c, generator=g)
    if kind == "normal":
        return torch.randn(t, c, generator=g)
    if kind == "tied80":
        return torch.randint(0, 80, (t, c), generator=g).float() * 0.25 - 10.0
    return torch.full((t, c), 0.5)
