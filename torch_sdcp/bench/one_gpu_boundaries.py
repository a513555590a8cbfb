"""The boundaries as N virtual ranks run them (``--one-gpu N``, bench/one_gpu.py):
each one's workspace parameters, its inputs, one rank's call, the blocks of
one rank's grid (as csrc/ computes them) and the check of every rank's result
against the plain-PyTorch reference (torch_sdcp.reference)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_sdcp.bench.boundaries import (
    UP_PROJECTED_HEAD_DIM,
    output_lse_inputs,
    query_inputs,
    signal_input,
    topk_inputs,
)
from torch_sdcp.families import WorkspaceKind

# Grid sizes as csrc/ computes them (dataflag_grid in csrc/dataflag.cuh and its
# callers); change them with the kernels.
DATAFLAG_MAX_BLOCKS = 384  # kDataFlagBlocks (csrc/dataflag.h)
DATAFLAG_BLOCKS_PER_SM = 2  # dataflag_grid's per_sm
ITEMS_PER_BLOCK = 8  # kWarps (one warp per item) of output_lse_cuda.cu and query_cuda.cu
EXCHANGE_WORDS_PER_BLOCK = 256  # kThreads of exchange_cuda.cu (one 4-byte word per thread)
SIGNAL_BYTES = 8  # the signal boundary's exchange (signal_input)


class CheckFailed(AssertionError):
    """A virtual rank's result differs from the reference."""


def dataflag_grid(items: int, items_per_block: int, sms: int) -> int:
    """csrc/dataflag.cuh dataflag_grid: blocks for ``items``, capped near 2 per SM."""
    cap = min(DATAFLAG_BLOCKS_PER_SM * sms, DATAFLAG_MAX_BLOCKS)
    return max(1, min(-(-items // items_per_block), cap))


@dataclass(frozen=True)
class Geometry:
    """The model's sizes (the bench's preset and overrides)."""

    heads: int
    head_dim: int
    rope_dim: int
    k: int
    query_dtype: torch.dtype


class Boundary:
    """One boundary as N virtual ranks run it."""

    name: str
    kind: WorkspaceKind
    #: What each virtual rank runs (the table's legend).
    runs: str

    def __init__(self, geo: Geometry, device: torch.device):
        self.geo, self.device = geo, device

    def params(self, rows: int, world: int) -> list[int]:
        """The workspace's creation parameters (those of the bench's workspace, max_rows = rows)."""
        raise NotImplementedError

    def timed_inputs(self, rows: int, rank: int, world: int) -> tuple:
        """Rank ``rank``'s inputs as the bench makes them."""
        raise NotImplementedError

    def check_inputs(self, rows: int, rank: int, world: int) -> tuple:
        """Inputs that differ between the ranks (a rank that read another
        source than the one it should would not pass the check)."""
        return self.timed_inputs(rows, rank, world)

    def call(self, handle: int, inputs: tuple) -> Any:
        raise NotImplementedError

    def grid(self, rows: int, world: int, sms: int) -> int:
        """Blocks of one rank's grid."""
        raise NotImplementedError

    def rank_bytes(self, rows: int, world: int) -> int | None:
        """The least bytes one rank's call moves through memory (None: not counted), as the
        plain bench's tables count them at world ``world``."""
        return None

    def check(self, results: Sequence[Any], inputs: Sequence[tuple], rows: int, world: int) -> None:
        """Raise CheckFailed unless every rank's result is the reference's."""
        raise NotImplementedError

    @staticmethod
    def seed(rows: int, rank: int) -> int:
        return 1_000_003 * (rank + 1) + rows


class Signal(Boundary):
    name, kind = "signal", WorkspaceKind.EXCHANGE
    runs = "sdcp::peer_all_gather of 8 bytes per rank"

    def params(self, rows, world):
        return [64]  # the bench's ExchangeWorkspace(None, 64)

    def timed_inputs(self, rows, rank, world):
        return (signal_input(rank, self.device),)

    def call(self, handle, inputs):
        from torch_sdcp import ops

        return ops.peer_all_gather(inputs[0], handle)

    def grid(self, rows, world, sms):
        return dataflag_grid(-(-SIGNAL_BYTES // 4), EXCHANGE_WORDS_PER_BLOCK, sms)

    def check(self, results, inputs, rows, world):
        want = torch.stack([x.cpu() for (x,) in inputs])
        for r, got in enumerate(results):
            if not torch.equal(got.cpu(), want):
                raise CheckFailed(f"signal, world {world}: rank {r} gathered {got.cpu().tolist()}, "
                                  f"expected {want.tolist()}")


class OutputLSE(Boundary):
    name, kind = "output_lse", WorkspaceKind.OUTPUT_LSE
    runs = "sdcp::output_lse_combine (bf16): every rank's head shard and LSE stored into its owner's buffer, combined"

    @property
    def head_dim(self) -> int:
        """Values per head (the preset's latent width)."""
        return self.geo.head_dim

    def params(self, rows, world):
        return [rows, self.geo.heads, self.head_dim, 2]

    def timed_inputs(self, rows, rank, world):  # the bench gives every rank the same partials
        return output_lse_inputs(torch.Generator().manual_seed(rows), rows, self.geo.heads, self.head_dim,
                                 self.device)

    def check_inputs(self, rows, rank, world):
        return output_lse_inputs(torch.Generator().manual_seed(self.seed(rows, rank)), rows, self.geo.heads,
                                 self.head_dim, self.device)

    def call(self, handle, inputs):
        from torch_sdcp import ops

        return ops.output_lse_combine(inputs[0], inputs[1], handle)

    def grid(self, rows, world, sms):
        return dataflag_grid(rows * (self.geo.heads // world), ITEMS_PER_BLOCK, sms)

    def rank_bytes(self, rows, world):  # partials and LSEs read once, the rank's heads written once (bf16)
        h, d = self.geo.heads, self.head_dim
        return rows * h * (d * 2 + 4) + rows * (h // world) * (d * 2 + 4)

    def check(self, results, inputs, rows, world):
        from torch_sdcp import reference

        out, lse = reference.lse_combine_ref64(torch.stack([po.cpu() for po, _ in inputs]),
                                               torch.stack([pl.cpu() for _, pl in inputs]))
        for r, (got, got_lse) in enumerate(results):
            want, want_lse = reference.output_lse_shard(out, lse, r, world)
            assert want_lse is not None
            try:  # kernel_check's tolerances (one bf16 rounding of an fp32 combine)
                torch.testing.assert_close(got.cpu().double(), want, rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(got_lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)
            except AssertionError as e:
                raise CheckFailed(f"{self.name}, world {world}, rows {rows}: rank {r}: {e}") from None


class OutputLSEUp(OutputLSE):
    name = "output_lse_up"
    runs = ("sdcp::output_lse_combine as output_lse, after the V up-projection: head_dim "
            f"{UP_PROJECTED_HEAD_DIM}, the same heads (vLLM 0.34 combines there from 8 rows on)")

    @property
    def head_dim(self) -> int:
        return UP_PROJECTED_HEAD_DIM


class TopK(Boundary):
    name, kind = "topk", WorkspaceKind.TOPK
    runs = "sdcp::topk_merge (C = k): each owner's best keys stored into every rank's buffer, merged"

    def params(self, rows, world):
        return [rows, self.geo.k, self.geo.k]

    def timed_inputs(self, rows, rank, world):  # already distinct per rank
        return topk_inputs(torch.Generator().manual_seed(rows * 31 + rank), rows, self.geo.k, rank, world,
                           self.device)

    def call(self, handle, inputs):
        from torch_sdcp import ops

        return ops.topk_merge(inputs[0], inputs[1], handle, self.geo.k)

    def grid(self, rows, world, sms):
        return min(rows, sms)  # topk_cuda.cu merge_cuda: one block per row, at most one per SM

    def check(self, results, inputs, rows, world):
        from torch_sdcp import reference

        want = reference.topk_merge_ref([(s.cpu(), i.cpu()) for s, i in inputs], self.geo.k)
        for r, got in enumerate(results):
            if not torch.equal(got.cpu(), want):
                bad = int((got.cpu() != want).sum())
                raise CheckFailed(f"topk, world {world}, rows {rows}: rank {r}: {bad} of {want.numel()} ids "
                                  "differ from the reference")


class Query(Boundary):
    name, kind = "query", WorkspaceKind.QUERY
    runs = "sdcp::query_gather (RoPE + quantisation, interleaved): each rank's heads stored into every rank's buffer"

    def __init__(self, geo: Geometry, device: torch.device):
        super().__init__(geo, device)
        from torch_sdcp.inputs import rope_cache

        self.cache = rope_cache(4096, geo.rope_dim).to(device)
        fp8 = geo.query_dtype == torch.float8_e4m3fn
        self.scale = torch.tensor([0.05], device=device) if fp8 else None

    def params(self, rows, world):
        elem = torch.empty((), dtype=self.geo.query_dtype).element_size()
        return [rows, self.geo.heads // world, self.geo.head_dim + self.geo.rope_dim, elem]

    def _inputs(self, seed: int, rows: int, world: int) -> tuple:
        return query_inputs(torch.Generator().manual_seed(seed), rows, self.geo.heads // world, self.geo.head_dim,
                            self.geo.rope_dim, self.device)

    def timed_inputs(self, rows, rank, world):  # the bench gives every rank the same query parts
        return self._inputs(rows, rows, world)

    def check_inputs(self, rows, rank, world):
        return self._inputs(self.seed(rows, rank), rows, world)

    def call(self, handle, inputs):
        from torch_sdcp import ops

        nope, pe, pos = inputs
        return ops.query_gather(nope, pe, pos, self.cache, self.scale, handle, rope_style="interleaved",
                                out_dtype=self.geo.query_dtype)

    def grid(self, rows, world, sms):
        return dataflag_grid(rows * (self.geo.heads // world), ITEMS_PER_BLOCK, sms)

    def rank_bytes(self, rows, world):  # the rank's parts, positions and cache rows read, the gathered query written
        g = self.geo
        hl, out = g.heads // world, torch.empty((), dtype=g.query_dtype).element_size()
        return rows * hl * (g.head_dim + g.rope_dim) * 2 + rows * (8 + g.rope_dim * 4) + rows * g.heads * (
            g.head_dim + g.rope_dim) * out

    def check(self, results, inputs, rows, world):
        from torch_sdcp import reference

        scale = None if self.scale is None else self.scale.cpu()
        want = reference.query_gathered_layout([
            reference.query_rope_quant_ref(nope.cpu(), pe.cpu(), pos.cpu(), self.cache.cpu(), scale, neox=False,
                                           out_dtype=self.geo.query_dtype) for nope, pe, pos in inputs])
        for r, got in enumerate(results):
            same = got.cpu().view(torch.uint8) == want.view(torch.uint8)
            if not bool(same.all()):
                raise CheckFailed(f"query, world {world}, rows {rows}: rank {r}: {int((~same).sum())} of "
                                  f"{same.numel()} bytes differ from the reference")


BOUNDARY_CLASSES: dict[str, type[Boundary]] = {"signal": Signal, "query": Query, "topk": TopK,
                                               "output_lse": OutputLSE, "output_lse_up": OutputLSEUp}
