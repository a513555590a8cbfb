"""The one-GPU world-N measurement, ``python -m torch_sdcp.bench --one-gpu N``:
N virtual ranks in this process on one GPU, each with its own workspace
(torch_sdcp.peer.virtual_ranks), running the DCP-N kernels against each
other. What it measures is the kernel side of a DCP-N call (the N-way
instances, their headers, polls and stores) with HBM in place of NVLink and
the N grids sharing one GPU's SMs: not a multi-GPU figure.

One step is one boundary call of every virtual rank, each rank's on its own
stream, so the N calls run concurrently. Two ways of timing it
(``--one-gpu-method``; the table names the one used):

- graph-per-rank (the default): every rank's S steps (``--one-gpu-steps``,
  64) are captured in a CUDA graph of its own; one replay launches the N
  graphs on the N streams, forked from rank 0's and joined back to it, and
  CUDA events on rank 0's stream time the replays. The fork, the join and
  the N graph launches of a replay, and the skew of a rank whose graph
  starts late (its peers wait for it at its first step only), count 1/S
  each in the figure per step.
- one-graph: the bench's Timer captures k steps (k8, k1) in ONE CUDA graph,
  every rank's call a branch of it. A graph does not promise that its
  branches run concurrently: at N = 4 and 8 some cells whose grids fit time
  out at the first replay (docs/NOTES.md). Kept for the figures of the plain
  bench's method (k8 / k1) where it runs.

World 1 (one virtual rank, no peer) is run beside world N the same way, as
the floor.

Before timing, one step on inputs that differ between the ranks is checked
against the plain-PyTorch reference (torch_sdcp.reference); a mismatch fails
the run. Every block of a data-as-flag kernel polls the same block of its
peers, so the N grids must all be resident at once (twice over while
programmatic dependent launch is on: a rank's next kernel may hold its blocks
beside the current one): a row whose N grids cannot be (by the grid sizes of
csrc/ and an assumed number of blocks per SM) is skipped and said so, and the
workspaces' short timeout turns a wrong assumption into a reported error
instead of a hang.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_sdcp.bench.boundaries import output_lse_inputs, query_inputs, signal_input, topk_inputs
from torch_sdcp.bench.timing import Timer
from torch_sdcp.families import WorkspaceKind

#: The virtual world sizes (the kernels have N-way instances for 2, 4 and 8; 1 is the floor).
WORLDS = (1, 2, 4, 8)
BOUNDARIES = ("signal", "query", "topk", "output_lse")
DEFAULT_ROWS = "1,32,128"
DEFAULT_TIMEOUT_S = 3.0
#: The ways of timing a step (--one-gpu-method), the default first.
METHODS = ("graph-per-rank", "one-graph")
DEFAULT_STEPS_PER_GRAPH = 64
#: graph-per-rank: --replays defaults to this many steps per trial over the steps per graph.
STEPS_PER_TRIAL = 1024
ONE_GRAPH_KS = (8, 1)
#: The head start before a graph-per-rank trial is a spin of this many cycles per
#: microsecond: at least the SM clock (an H200 runs up to 1,980 MHz), so it spins at
#: least as long as asked; its length on the GPU is measured.
SPIN_CYCLES_PER_US = 2000
MAX_HEAD_START_US = 50_000.0
NOTE = "one GPU, {n} virtual ranks: kernel side, HBM in place of NVLink; not a multi-GPU figure"

# Grid sizes as csrc/ computes them (dataflag_grid in csrc/dataflag.cuh and its
# callers); change them with the kernels.
DATAFLAG_MAX_BLOCKS = 384  # kDataFlagBlocks (csrc/dataflag.h)
DATAFLAG_BLOCKS_PER_SM = 2  # dataflag_grid's per_sm
ITEMS_PER_BLOCK = 8  # kWarps (one warp per item) of output_lse_cuda.cu and query_cuda.cu
EXCHANGE_WORDS_PER_BLOCK = 256  # kThreads of exchange_cuda.cu (one 4-byte word per thread)
SIGNAL_BYTES = 8  # the signal boundary's exchange (signal_input)

#: Blocks of one kernel that fit on one SM, assumed (not queried): the
#: data-as-flag kernels run 256 threads at up to 128 registers (ptxas: 107 to
#: 125, docs/NOTES.md), 2 blocks per SM; the top-K merge runs 1024 threads with
#: about 144 KiB of shared memory (k = C = 2048), 1 block per SM.
ASSUMED_BLOCKS_PER_SM = {"signal": 2, "query": 2, "topk": 1, "output_lse": 2}


class CheckFailed(AssertionError):
    """A virtual rank's result differs from the reference."""


def cuda_missing() -> str | None:
    """Why this machine cannot run the measurement (None: it can)."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() False"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("sdcp::output_lse_combine", "CUDA"):
        return "an extension built without the CUDA kernels"
    return None


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


# ---------------------------------------------------------------------------------------------
# The boundaries: workspace, inputs, one rank's call, its grid, the reference check
# ---------------------------------------------------------------------------------------------


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

    def params(self, rows, world):
        return [rows, self.geo.heads, self.geo.head_dim, 2]

    def timed_inputs(self, rows, rank, world):  # the bench gives every rank the same partials
        return output_lse_inputs(torch.Generator().manual_seed(rows), rows, self.geo.heads, self.geo.head_dim,
                                 self.device)

    def check_inputs(self, rows, rank, world):
        return output_lse_inputs(torch.Generator().manual_seed(self.seed(rows, rank)), rows, self.geo.heads,
                                 self.geo.head_dim, self.device)

    def call(self, handle, inputs):
        from torch_sdcp import ops

        return ops.output_lse_combine(inputs[0], inputs[1], handle)

    def grid(self, rows, world, sms):
        return dataflag_grid(rows * (self.geo.heads // world), ITEMS_PER_BLOCK, sms)

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
                raise CheckFailed(f"output_lse, world {world}, rows {rows}: rank {r}: {e}") from None


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
                                               "output_lse": OutputLSE}


# ---------------------------------------------------------------------------------------------
# One step, one cell (a boundary at one row count and world size)
# ---------------------------------------------------------------------------------------------


def step(streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]]) -> list:
    """Every rank's call on its own stream, forked from the current stream and
    joined back (in a CUDA graph: N concurrent branches)."""
    current = torch.cuda.current_stream()
    results = []
    for stream, call in zip(streams, calls, strict=True):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            results.append(call())
    for stream in streams:
        current.wait_stream(stream)
    return results


def pdl_on(device: torch.device) -> bool:
    """Whether the data-as-flag kernels launch programmatically on ``device``
    (csrc/dataflag.cuh dataflag_pdl: compute capability 9.0 or later, unless
    SDCP_PDL=0; the kernels read it once, at their first launch)."""
    return torch.cuda.get_device_capability(device)[0] >= 9 and os.environ.get("SDCP_PDL") != "0"


def grids_per_rank(pdl: bool) -> int:
    """Grids of one rank that may hold SM slots at once. Under PDL a rank's
    next kernel is launched as soon as every block of its current one has
    started (pdl_wait_and_release), and its blocks sit in griddepcontrol.wait
    until the current one completes: two grids. The one after cannot start
    before that wait returns."""
    return 2 if pdl else 1


def capture_rank_graphs(streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                        steps: int) -> list[torch.cuda.CUDAGraph]:
    """Rank r's ``steps`` calls captured in a graph of its own, on its own stream."""
    graphs = []
    for stream, call in zip(streams, calls, strict=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(steps):
                call()
        graphs.append(graph)
    return graphs


class RankGraphReplay:
    """One replay of every rank's graph: rank 0's on its own stream (the lead,
    which holds the timing events), every other rank's on its own, forked from
    the lead and joined back to it. N streams in all (a ninth, at N = 8, would
    be more than the default 8 hardware queues, CUDA_DEVICE_MAX_CONNECTIONS)."""

    def __init__(self, streams: Sequence[torch.cuda.Stream], graphs: Sequence[torch.cuda.CUDAGraph]):
        self.lead, self.others = streams[0], list(streams[1:])
        self.graphs = list(graphs)
        self.fork = torch.cuda.Event()
        self.joins = [torch.cuda.Event() for _ in self.others]

    def __call__(self) -> None:
        if self.others:
            self.fork.record(self.lead)
        with torch.cuda.stream(self.lead):
            self.graphs[0].replay()
        for stream, graph, join in zip(self.others, self.graphs[1:], self.joins, strict=True):
            stream.wait_event(self.fork)
            with torch.cuda.stream(stream):
                graph.replay()
            join.record(stream)
        for join in self.joins:
            self.lead.wait_event(join)


class GraphPerRank:
    """--one-gpu-method graph-per-rank: microseconds per step, ``steps`` steps
    per rank graph (RankGraphReplay), ``replays`` replays per trial, median
    over ``trials``. A trial starts with a spin on the lead stream (the head
    start: twice the host's time to launch a trial's replays, measured once
    before) so that the GPU runs the timed replays with every launch already
    queued; a trial whose launches took longer than its head start is counted
    (``host_late_trials``): its figure may include host time."""

    name = "graph-per-rank"

    def __init__(self, steps: int, replays: int, trials: int):
        self.steps, self.replays, self.trials = steps, replays, trials
        self.keys: tuple[str, ...] = (f"k{steps}",)

    def _launch(self, replay: RankGraphReplay) -> float:
        """Seconds the host takes to launch one trial's replays."""
        t0 = time.perf_counter()
        for _ in range(self.replays):
            replay()
        return time.perf_counter() - t0

    def measure(self, streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                after_first_replay: Callable[[], None]) -> dict:
        lead = streams[0]
        for _ in range(2):  # warm-up, eager (what capture must not do for the first time)
            step(streams, calls)
        torch.cuda.synchronize(lead.device)
        graphs = capture_rank_graphs(streams, calls, self.steps)
        replay = RankGraphReplay(streams, graphs)
        torch.cuda.synchronize(lead.device)
        replay()
        torch.cuda.synchronize(lead.device)
        after_first_replay()  # a wait that gave up is an error, not a figure
        head_start_us = min(2e6 * self._launch(replay) + 50.0, MAX_HEAD_START_US)
        torch.cuda.synchronize(lead.device)
        per_step, host_per_step, host_late = [], [], 0
        for _ in range(self.trials):
            spin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(lead):
                spin.record()
                torch.cuda._sleep(int(head_start_us * SPIN_CYCLES_PER_US))
                start.record()
                host_s = self._launch(replay)
                end.record()
            end.synchronize()
            host_late += host_s * 1e6 > spin.elapsed_time(start) * 1e3
            per_step.append(start.elapsed_time(end) * 1e3 / (self.replays * self.steps))
            host_per_step.append(host_s * 1e6 / (self.replays * self.steps))
        return {self.keys[0]: statistics.median(per_step), "trials_us": per_step,
                "host_us_per_step": statistics.median(host_per_step), "head_start_us": head_start_us,
                "host_late_trials": host_late}


class OneGraph:
    """--one-gpu-method one-graph: the bench's Timer (k8 / k1, max over the
    one process, median over trials) over ``step``: every rank's call a branch
    of one CUDA graph."""

    name = "one-graph"
    keys = tuple(f"k{k}" for k in ONE_GRAPH_KS)

    def __init__(self, timer: Timer):
        self.timer = timer
        self.replays, self.trials = timer.replays, timer.trials

    def measure(self, streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                after_first_replay: Callable[[], None]) -> dict:
        return self.timer.measure(lambda: step(streams, calls), ONE_GRAPH_KS)


def residency(boundary: Boundary, rows: int, world: int, sms: int, blocks_per_sm: int,
              pdl: bool) -> tuple[int, str | None]:
    """(blocks of one rank's grid, why the N grids cannot all be resident, or None).
    While PDL is on every rank counts twice its grid: a rank's early-launched
    next kernel can take the slots a late peer's current kernel needs, and the
    current one then waits for that peer until it gives up."""
    blocks = boundary.grid(rows, world, sms)
    fit = blocks_per_sm * sms
    need = world * blocks * grids_per_rank(pdl)
    if world > 1 and need > fit:
        pdl_note = (", twice over while PDL is on (each rank's next kernel may hold its blocks beside it; "
                    "SDCP_PDL=0 turns PDL off)") if pdl else ""
        return blocks, (f"not co-resident: {world} grids of {blocks} blocks{pdl_note} = {need} blocks, "
                        f"{fit} fit ({sms} SMs x {blocks_per_sm} per SM, assumed)")
    return blocks, None


def health(ranks, timeout_s: float, stage: str) -> None:
    """Raise when a virtual rank's workspace is poisoned (a wait timed out, a
    header mismatched); ``stage`` says where (the message names it)."""
    for r, handle in enumerate(ranks.handles):
        try:
            torch.ops.sdcp.workspace_check(handle)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0][:300]
            raise RuntimeError(f"virtual rank {r} failed {stage} (a wait gives up after {timeout_s:g} s; the "
                               f"grids may not have been co-resident): {first}") from None


Method = GraphPerRank | OneGraph


def run_cell(boundary: Boundary, rows: int, world: int, method: Method, timeout_s: float) -> dict:
    """Check one step against the reference, then time it. Returns
    {"check": "ok", <method.keys>: us per step, ...}; raises CheckFailed on a mismatch."""
    from torch_sdcp.peer.virtual_ranks import VirtualRanks

    device = boundary.device
    with VirtualRanks(boundary.kind, boundary.params(rows, world), world, device, timeout_s) as ranks:
        streams = [torch.cuda.Stream(device) for _ in range(world)]
        inputs = [boundary.check_inputs(rows, r, world) for r in range(world)]
        torch.cuda.synchronize(device)
        results = step(streams, [functools.partial(boundary.call, h, x) for h, x in zip(ranks.handles, inputs,
                                                                                         strict=True)])
        torch.cuda.synchronize(device)
        health(ranks, timeout_s, "in the reference check's step")  # a timed-out call's result is not a mismatch
        boundary.check(results, inputs, rows, world)
        del results, inputs
        timed = [boundary.timed_inputs(rows, r, world) for r in range(world)]
        calls = [functools.partial(boundary.call, h, x) for h, x in zip(ranks.handles, timed, strict=True)]
        torch.cuda.synchronize(device)
        cell: dict = {"check": "ok", **method.measure(
            streams, calls, functools.partial(health, ranks, timeout_s, "at the first replay of the rank graphs"))}
        torch.cuda.synchronize(device)
        # a timeout inside the graph replays would otherwise read as a fast figure
        health(ranks, timeout_s, "in the timed replays")
    return cell


# ---------------------------------------------------------------------------------------------
# The run, its JSON and its table
# ---------------------------------------------------------------------------------------------


def run(args) -> int:
    """``python -m torch_sdcp.bench --one-gpu N`` (arguments checked by cli.parse_args)."""
    import torch_sdcp  # noqa: F401  (registers the ops)

    n = args.one_gpu
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    from torch_sdcp.bench.cli import PRESETS

    preset = PRESETS[args.preset]
    geo = Geometry(heads=args.heads or preset["heads"], head_dim=preset["head_dim"], rope_dim=preset["rope_dim"],
                   k=args.k or preset["k"],
                   query_dtype=torch.float8_e4m3fn if args.query_dtype == "fp8" else torch.bfloat16)
    worlds = sorted({1, n})
    blocks_per_sm = {b: args.blocks_per_sm or ASSUMED_BLOCKS_PER_SM[b] for b in args.boundaries}
    pdl = pdl_on(device)
    print(f"torch_sdcp bench: {NOTE.format(n=n)}; worlds {worlds}, rows {args.rows}, boundaries {args.boundaries}; "
          f"method {args.one_gpu_method}; PDL {'on' if pdl else 'off'}; writing {args.out}", flush=True)
    started = time.monotonic()
    failures = 0
    results: dict[str, list] = {}
    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="sdcp-onegpu-") as tmp:
        if own_group:  # the Timer agrees over a group: a group of this one process
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0,
                                    world_size=1)
        try:
            method: Method = (OneGraph(Timer(device, args.replays, args.trials))
                              if args.one_gpu_method == OneGraph.name
                              else GraphPerRank(args.one_gpu_steps, args.replays, args.trials))
            for name in args.boundaries:
                boundary = BOUNDARY_CLASSES[name](geo, device)
                results[name] = []
                for rows in ([1] if name == "signal" else args.rows):
                    row: dict = {"rows": rows}
                    for world in worlds:
                        blocks, skip = residency(boundary, rows, world, sms, blocks_per_sm[name], pdl)
                        cell: dict = {"grid_blocks": blocks}
                        if skip:
                            cell["skipped"] = skip
                        else:
                            try:
                                cell.update(run_cell(boundary, rows, world, method, args.one_gpu_timeout))
                            except CheckFailed as e:
                                failures += 1
                                cell.update(check="MISMATCH", error=str(e)[:2000])
                                print(f"MISMATCH: {e}", file=sys.stderr, flush=True)
                            except Exception as e:
                                failures += 1
                                cell["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
                                traceback.print_exc()
                        row[f"world{world}"] = cell
                    results[name].append(row)
                    print(f"[{time.monotonic() - started:6.1f} s] {name} rows={rows} done", file=sys.stderr,
                          flush=True)
        finally:
            if own_group:
                dist.destroy_process_group()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "one_gpu": n, "worlds": worlds,
            "note": NOTE.format(n=n), "multi_gpu": False, "device": torch.cuda.get_device_name(device),
            "sms": sms, "blocks_per_sm": blocks_per_sm, "blocks_per_sm_assumed": args.blocks_per_sm is None,
            "timeout_s": args.one_gpu_timeout, "pdl": pdl, "grids_per_rank": grids_per_rank(pdl),
            "method": args.one_gpu_method, "figure_keys": list(method.keys), "steps_per_graph": args.one_gpu_steps,
            "replays": args.replays, "trials": args.trials,
            "torch": torch.__version__, "failures": failures, "args": dict(vars(args))}
    data = {"meta": meta, "results": results}
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    text = tables(data)
    print(text)
    with open(os.path.join(args.out, "tables.txt"), "w") as f:
        f.write(text + "\n")
    print(f"raw numbers: {os.path.join(args.out, 'bench.json')}")
    if failures:
        print(f"one-GPU bench: {failures} cell(s) failed (mismatch or error): see the table", file=sys.stderr)
    return 1 if failures else 0


def _us(cell: dict, k: str) -> str:
    v = cell.get(k)
    return f"{v:.1f}" if isinstance(v, (int, float)) else "n/a"


def pdl_line(meta: dict) -> str:
    """The table's line on programmatic dependent launch and what the co-residency rule counts for it."""
    if meta.get("pdl"):
        return ("PDL on (SDCP_PDL not 0): a rank's next kernel may hold SM slots while its current one runs, so "
                "every rank counts twice its grid (SDCP_PDL=0 turns PDL off and counts it once)")
    return "PDL off (SDCP_PDL=0 or before compute capability 9.0): every rank counts its grid once"


def method_lines(meta: dict) -> list[str]:
    """The table's lines on how the figure was made (a run before --one-gpu-method: one-graph)."""
    n = meta["one_gpu"]
    head = (f"{meta['date']}: {meta['device']}, torch {meta['torch']}; us per step (one boundary call of every "
            "virtual rank, each on its own stream)")
    if meta.get("method", OneGraph.name) == OneGraph.name:
        return [f"{head}, k8 / k1; method one-graph: k8, 8 steps in ONE CUDA graph, every rank's call a branch of "
                "it (k1: one step per graph), the bench's Timer",
                "a graph does not promise that its branches run concurrently: at N = 4 and 8 some cells whose grids "
                "fit time out at the first replay with this method (docs/NOTES.md)"]
    steps = meta["steps_per_graph"]
    return [f"{head}, k{steps}; method graph-per-rank: each rank's {steps} steps in a CUDA graph of its own, the "
            f"{n} graphs launched on {n} streams forked from rank 0's and joined back; CUDA events on rank 0's "
            f"stream over {meta['replays']} replays, every launch queued first (a spin as head start), median of "
            f"{meta['trials']} trials",
            f"a rank that starts late is waited for by its peers at its first step only: that skew, and the fork, "
            f"join and {n} graph launches of a replay, count 1/{steps} each in a step's figure"]


def tables(data: dict) -> str:
    """The one-GPU run's table: per boundary and row count, world 1 (the
    floor) beside world N, us per step by the method the run used."""
    meta = data["meta"]
    n = meta["one_gpu"]
    worlds = meta["worlds"]
    keys = meta.get("figure_keys", [f"k{k}" for k in ONE_GRAPH_KS])
    lines = [f"torch_sdcp bench: {meta['note']}",
             *method_lines(meta),
             "world 1 is the floor: one virtual rank, the same kernels with no peer, timed the same way",
             f"co-residency: {meta['sms']} SMs; blocks per SM "
             + ("assumed" if meta["blocks_per_sm_assumed"] else "given (--blocks-per-sm)") + ": "
             + ", ".join(f"{b} {v}" for b, v in meta["blocks_per_sm"].items())
             + f"; a row whose {n} grids cannot all be resident is skipped; waits give up after "
               f"{meta['timeout_s']:g} s",
             pdl_line(meta)]
    for name, rows in data["results"].items():
        lines.append(f"\n{name}")
        for row in rows:
            cells, notes = [], []
            for world in worlds:
                cell = row.get(f"world{world}", {})
                if "skipped" in cell:
                    cells.append(f"world {world} skipped")
                    notes.append(f"world {world}: {cell['skipped']}")
                elif "error" in cell:
                    cells.append(f"world {world} {'MISMATCH' if cell.get('check') == 'MISMATCH' else 'failed'}")
                    notes.append(f"world {world}: {cell['error']}")
                else:
                    cells.append(f"world {world} " + " / ".join(_us(cell, k) for k in keys))
                    if cell.get("host_late_trials"):
                        notes.append(f"world {world}: the host was still launching when the timed replays began in "
                                     f"{cell['host_late_trials']} of {meta.get('trials', '?')} trials (host "
                                     f"{cell.get('host_us_per_step', float('nan')):.2f} us per step): the figure "
                                     "may include host time")
            floor, top = row.get("world1", {}), row.get(f"world{worlds[-1]}", {})
            first = keys[0]
            if len(worlds) > 1 and all(isinstance(c.get(first), (int, float)) for c in (floor, top)):
                cells.append(f"world {worlds[-1]} - world 1 {top[first] - floor[first]:+.1f} us ({first})")
            grids = ", ".join(f"world {w} {row.get(f'world{w}', {}).get('grid_blocks', '?')}" for w in worlds)
            ran = [c for c in (row.get(f"world{w}", {}) for w in worlds) if "skipped" not in c]
            checked = ("FAILED" if any(c.get("check") == "MISMATCH" for c in ran)
                       else "ok" if all(c.get("check") == "ok" for c in ran)
                       else "not completed (an error, below)")
            lines.append(f"  rows {row['rows']:>4}  " + " | ".join(cells)
                         + f"   (blocks per rank: {grids}; reference check {checked})")
            lines += [f"           {note}" for note in notes]
    lines.append("\nlegend (what each virtual rank runs; every rank's region is its own allocation on this GPU, "
                 "so a store into a peer's buffer goes to this GPU's HBM, and the ranks' grids share its SMs)")
    for name in data["results"]:
        lines.append(f"  {name}: {BOUNDARY_CLASSES[name].runs}")
    if meta.get("failures"):
        lines.append(f"\n{meta['failures']} cell(s) FAILED (mismatch against the reference, or an error)")
    return "\n".join(lines)


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def method_name(text: str) -> str:
    """argparse type of --one-gpu-method: one of METHODS."""
    if text not in METHODS:
        raise argparse.ArgumentTypeError("expected " + " or ".join(repr(m) for m in METHODS) + f", got {text!r}")
    return text


def world_size(text: str) -> int:
    """argparse type of --one-gpu: one of WORLDS."""
    expected = ", ".join(str(w) for w in WORLDS[:-1]) + f" or {WORLDS[-1]}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value not in WORLDS:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value
