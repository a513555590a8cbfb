"""The one-GPU world-N measurement, ``python -m torch_sdcp.bench --one-gpu N``:
N virtual ranks in this process on one GPU, each with its own workspace
(bench/virtual_ranks.py), running the DCP-N kernels against each
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

Beside torch_sdcp's cells of a row, the competitors of the boundary (vLLM a2a
and FlashInfer fused at output_lse and output_lse_up, vLLM direct at topk) run
on virtual ranks of their own buffers, timed by the same method and checked
(bench/one_gpu_competitors.py); their waiting grids obey the co-residency
rule, and a competitor's failed cell stays in its cell (said, not counted in
the exit status).

This file holds the run (its options' types, the co-residency rule, one cell,
bench.json); one_gpu_boundaries the boundaries as the virtual ranks run them
(inputs, calls, grids, reference checks), one_gpu_timing the two methods and
one_gpu_report the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from torch_sdcp.bench.one_gpu_boundaries import BOUNDARY_CLASSES, Boundary, CheckFailed, Geometry
from torch_sdcp.bench.one_gpu_competitors import CompetitorRanks, WaitingGrid, competitors_of, run_competitor_cell
from torch_sdcp.bench.one_gpu_report import tables
from torch_sdcp.bench.one_gpu_timing import GraphPerRank, Method, OneGraph, step
from torch_sdcp.bench.presets import PRESETS
from torch_sdcp.bench.timing import Timer

#: The virtual world sizes (the kernels have N-way instances for 2, 4 and 8; 1 is the floor).
WORLDS = (1, 2, 4, 8)
BOUNDARIES = ("signal", "query", "topk", "output_lse", "output_lse_up")
DEFAULT_ROWS = "1,32,128"
DEFAULT_TIMEOUT_S = 3.0
#: The ways of timing a step (--one-gpu-method), the default first.
METHODS = ("graph-per-rank", "one-graph")
DEFAULT_STEPS_PER_GRAPH = 64
#: graph-per-rank: --replays defaults to this many steps per trial over the steps per graph.
STEPS_PER_TRIAL = 1024
NOTE = "one GPU, {n} virtual ranks: kernel side, HBM in place of NVLink; not a multi-GPU figure"

#: Blocks of one kernel that fit on one SM, assumed (not queried): the
#: data-as-flag kernels run 256 threads at up to 128 registers (ptxas: 107 to
#: 125, docs/NOTES.md), 2 blocks per SM; the top-K merge runs 1024 threads with
#: about 144 KiB of shared memory (k = C = 2048), 1 block per SM.
ASSUMED_BLOCKS_PER_SM = {"signal": 2, "query": 2, "topk": 1, "output_lse": 2, "output_lse_up": 2}
#: Blocks the kernels launch per SM they size their grids for (csrc/dataflag.cuh
#: dataflag_grid: 2; the top-K merge: one per row, at most one per SM).
GRID_BLOCKS_PER_SM = {"signal": 2, "query": 2, "topk": 1, "output_lse": 2, "output_lse_up": 2}
#: The SMs the kernels size their grids for when set (csrc/dataflag.cuh grid_sms; read at the first launch).
GRID_SMS_ENV = "SDCP_BENCH_GRID_SMS"


def cuda_missing() -> str | None:
    """Why this machine cannot run the measurement (None: it can)."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() False"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("sdcp::output_lse_combine", "CUDA"):
        return "an extension built without the CUDA kernels"
    return None


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


class HasGrid(Protocol):
    def grid(self, rows: int, world: int, sms: int) -> int: ...


def residency(boundary: HasGrid, rows: int, world: int, sms: int, blocks_per_sm: int,
              pdl: bool, grid_sms: int | None = None) -> tuple[int, str | None]:
    """(blocks of one rank's grid, why the N grids cannot all be resident, or None).
    ``boundary``: a Boundary, or a competitor's waiting grid (one_gpu_competitors.WaitingGrid).
    While PDL is on every rank counts twice its grid: a rank's early-launched
    next kernel can take the slots a late peer's current kernel needs, and the
    current one then waits for that peer until it gives up. ``grid_sms``: the
    SMs the kernels size their grids for (SDCP_BENCH_GRID_SMS), if fewer."""
    blocks = boundary.grid(rows, world, grid_sms or sms)
    fit = blocks_per_sm * sms
    need = world * blocks * grids_per_rank(pdl)
    if world > 1 and need > fit:
        pdl_note = (", twice over while PDL is on (each rank's next kernel may hold its blocks beside it; "
                    "SDCP_PDL=0 turns PDL off)") if pdl else ""
        return blocks, (f"not co-resident: {world} grids of {blocks} blocks{pdl_note} = {need} blocks, "
                        f"{fit} fit ({sms} SMs x {blocks_per_sm} per SM, assumed)")
    return blocks, None


def slice_sms(sms: int, world: int, pdl: bool, blocks_per_sm: dict[str, int]) -> int:
    """--one-gpu-slice: the SMs each of ``world`` virtual ranks sizes its grids
    for, so that all their grids (two each while PDL is on) are resident at
    once at any row count: a kernel that launches more blocks per SM of its
    grid than fit on an SM (``blocks_per_sm``) takes a smaller slice."""
    over = max(-(-GRID_BLOCKS_PER_SM[b] // fit) for b, fit in blocks_per_sm.items())
    return max(1, sms // (world * grids_per_rank(pdl) * over))


def grid_sms_setting(sms: int, world: int, pdl: bool, blocks_per_sm: dict[str, int], sliced: bool) -> int | None:
    """The SMs the kernels of this process size their grids for, when fewer
    than ``sms``: set here for --one-gpu-slice (before the first launch, when
    the kernels read it), else SDCP_BENCH_GRID_SMS as the user set it."""
    if sliced:
        os.environ[GRID_SMS_ENV] = str(slice_sms(sms, world, pdl, blocks_per_sm))
    text = os.environ.get(GRID_SMS_ENV, "")
    value = int(text) if text.isdigit() else 0
    return value if 0 < value < sms else None


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


def run_cell(boundary: Boundary, rows: int, world: int, method: Method, timeout_s: float) -> dict:
    """Check one step against the reference, then time it. Returns
    {"check": "ok", <method.keys>: us per step, ...}; raises CheckFailed on a mismatch."""
    from torch_sdcp.bench.virtual_ranks import VirtualRanks

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


def fill_cell(cell: dict, measure: Callable[[], dict]) -> int:
    """``cell`` updated with ``measure()``'s figures, or with its mismatch or error (printed); 1
    when it failed, else 0."""
    try:
        cell.update(measure())
    except CheckFailed as e:
        cell.update(check="MISMATCH", error=str(e)[:2000])
        print(f"MISMATCH: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        cell["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        traceback.print_exc()
        return 1
    return 0


def competitor_cells(comp: type[CompetitorRanks], boundary: Boundary, rows: int, worlds: list[int], sms: int,
                     pdl: bool, grid_sms: int | None, method: Method, timeout_s: float) -> tuple[dict, int]:
    """Competitor ``comp``'s cells of one row, by world ({"world1": cell, ...}), and how many failed.
    Its waiting grid obeys the co-residency rule; an error or a mismatch stays in its cell."""
    cells, failed = {}, 0
    for world in worlds:
        blocks, skip = residency(WaitingGrid(comp, boundary), rows, world, sms, comp.blocks_per_sm,
                                 pdl and comp.pdl, grid_sms)
        cell: dict = {"grid_blocks": blocks}
        if skip:
            cell["skipped"] = skip
        else:
            failed += fill_cell(cell, functools.partial(run_competitor_cell, comp, boundary, rows, world, method,
                                                        timeout_s, grid_sms or sms))
        cells[f"world{world}"] = cell
    return cells, failed


# ---------------------------------------------------------------------------------------------
# The run and its JSON
# ---------------------------------------------------------------------------------------------


def run(args) -> int:
    """``python -m torch_sdcp.bench --one-gpu N`` (arguments checked by cli.parse_args)."""
    import torch_sdcp  # noqa: F401  (registers the ops)

    n = args.one_gpu
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    preset = PRESETS[args.preset]
    geo = Geometry(heads=args.heads or preset["heads"], head_dim=preset["head_dim"], rope_dim=preset["rope_dim"],
                   k=args.k or preset["k"],
                   query_dtype=torch.float8_e4m3fn if args.query_dtype == "fp8" else torch.bfloat16)
    worlds = sorted({1, n})
    blocks_per_sm = {b: args.blocks_per_sm or ASSUMED_BLOCKS_PER_SM[b] for b in args.boundaries}
    pdl = pdl_on(device)
    grid_sms = grid_sms_setting(sms, n, pdl, blocks_per_sm, args.one_gpu_slice)
    sized = f"; grids sized for {grid_sms} of {sms} SMs" if grid_sms else ""
    print(f"torch_sdcp bench: {NOTE.format(n=n)}; worlds {worlds}, rows {args.rows}, boundaries {args.boundaries}; "
          f"method {args.one_gpu_method}; PDL {'on' if pdl else 'off'}{sized}; writing {args.out}", flush=True)
    started = time.monotonic()
    failures = competitor_failures = 0
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
                        blocks, skip = residency(boundary, rows, world, sms, blocks_per_sm[name], pdl, grid_sms)
                        cell: dict = {"grid_blocks": blocks}
                        moved = boundary.rank_bytes(rows, world)
                        if moved is not None:
                            cell["rank_bytes"] = moved
                        if skip:
                            cell["skipped"] = skip
                        else:
                            failures += fill_cell(cell, functools.partial(run_cell, boundary, rows, world, method,
                                                                          args.one_gpu_timeout))
                        row[f"world{world}"] = cell
                    for comp in competitors_of(name):
                        cells, failed = competitor_cells(comp, boundary, rows, worlds, sms, pdl, grid_sms, method,
                                                         args.one_gpu_timeout)
                        row.setdefault("competitors", {})[comp.name] = cells
                        competitor_failures += failed
                    results[name].append(row)
                    print(f"[{time.monotonic() - started:6.1f} s] {name} rows={rows} done", file=sys.stderr,
                          flush=True)
        finally:
            if own_group:
                dist.destroy_process_group()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "one_gpu": n, "worlds": worlds,
            "note": NOTE.format(n=n), "multi_gpu": False, "device": torch.cuda.get_device_name(device),
            "sms": sms, "grid_sms": grid_sms, "sliced": args.one_gpu_slice, "blocks_per_sm": blocks_per_sm,
            "blocks_per_sm_assumed": args.blocks_per_sm is None,
            "timeout_s": args.one_gpu_timeout, "pdl": pdl, "grids_per_rank": grids_per_rank(pdl),
            "method": args.one_gpu_method, "figure_keys": list(method.keys), "steps_per_graph": args.one_gpu_steps,
            "replays": args.replays, "trials": args.trials,
            "torch": torch.__version__, "failures": failures, "competitor_failures": competitor_failures,
            "args": dict(vars(args))}
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
    if competitor_failures:  # a competitor's reproduction, not torch_sdcp: said, not the exit status
        print(f"one-GPU bench: {competitor_failures} competitor cell(s) failed: see the table", file=sys.stderr)
    return 1 if failures else 0



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
