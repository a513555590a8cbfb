"""The query family's test inputs and checks, shared by the test_query_*.py
files: the gathered query's bytes, per-rank queries with the global head
index as a sentinel, the expected gather, and queries full of sentinel and
canonical words."""

from __future__ import annotations

import torch
from _helpers import make_query

from torch_sdcp import reference


def as_bytes(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.view(torch.int16)


def global_query(world, t, h, seed):
    per_rank = [make_query(t, h, seed=seed * 10 + r) for r in range(world)]
    pos, cache = per_rank[0][2], per_rank[0][3]  # positions and cache are shared by the group
    for r, q in enumerate(per_rank):
        q[0][:, :, 0] = float(r * h) + torch.arange(h, dtype=torch.float32)  # sentinel: the global head index
    return [(q[0], q[1], pos, cache) for q in per_rank]


def expected_gather(inputs, scale, rope_style, dtype):
    return torch.cat([reference.query_rope_quant_ref(*x, scale, neox=rope_style == "neox", out_dtype=dtype)
                      for x in inputs], dim=1)


GATHER_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]
SENTINEL, CANONICAL_FP8, CANONICAL_PAIR = -1, 0x7F7F7F7F, 0x7FC07FC0  # 32-bit words (csrc/dataflag.h)


def poisoned_queries(world, t, h, w, dtype, seed):
    """Per-rank q [t, h, w] of `dtype` with sentinel words (all-ones bytes),
    the canonical words themselves, lone 0xFF bytes and NaNs of every kind
    among random values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        q = (torch.randn(t, h, w, generator=g) * 4).to(dtype)
        words = q.view(torch.uint8).view(-1).view(torch.int32)
        u = torch.rand(words.shape, generator=g)
        words[u < 0.15] = SENTINEL
        words[(u >= 0.15) & (u < 0.2)] = CANONICAL_FP8
        words[(u >= 0.2) & (u < 0.25)] = CANONICAL_PAIR
        b = q.view(torch.uint8).view(-1)
        b[torch.rand(b.shape, generator=g) < 0.05] = 0xFF  # lone all-ones bytes: NaN, kept as they are
        out.append(q)
    return out
