"""Side by side: what each DCP boundary costs through the collective path, the
symmetric-memory competitors (Output/LSE, CUDA only) and torch_sdcp, plus a
synthetic MLA decode step. Output/LSE runs twice: at the preset's latent
width (output_lse) and after the V up-projection, head_dim 128
(output_lse_up). Every table is printed with a legend that names each path's
kernels and communication (LEGEND below).

    python -m torch_sdcp.bench [--world-size N] [--preset glm-5] [--rows 1,8,32]
                               [--boundaries query,topk,output_lse,output_lse_up,decode] [--out DIR]
                               [--topk-distributions]
    python -m torch_sdcp.bench --one-gpu N [--rows 1,32,128]
                               [--boundaries signal,query,topk,output_lse,output_lse_up]
                               [--one-gpu-method graph-per-rank|one-graph] [--one-gpu-steps 64]

Launches its own local ranks (or runs under torchrun), picks the CUDA backend
when there is one GPU per rank and the CUDA kernels are built, the host
(shared-memory) backend otherwise. Prints one table per boundary, writes the
raw numbers (bench.json), the tables (tables.txt) and a plot (latency.png)
into the output folder, and ends with one verdict per boundary (CUDA:
torch_sdcp's k8 against the strongest baseline of each row) and the files it
wrote.

Method (docs/DESIGN.md section 6). CUDA: K calls captured back to back in one CUDA
graph (k8: K = 8; k1: one call per graph), `--replays` replays per trial,
`--trials` trials. Host: the same K calls timed on the wall clock. Per-call
time = max over ranks of a trial, median over trials. Ratios are against the
strongest (fastest) baseline of each row. Host numbers check the protocol on
shared memory: they are not performance, and no ratio is printed for them.

--one-gpu N (1, 2, 4 or 8): N virtual ranks in this one process on one GPU,
each rank's workspace its own allocation, the DCP-N kernels run against each
other on N streams, world 1 beside them as the floor (bench/one_gpu.py). The
kernel side with HBM in place of NVLink: not a multi-GPU figure. Method
graph-per-rank (the default): each rank's --one-gpu-steps steps (64) in a CUDA
graph of its own, the N graphs launched on N streams per replay, us per step;
one-graph: k8 / k1 as above, every rank's call a branch of one graph. The
competitors (vLLM a2a and FlashInfer fused at output_lse and output_lse_up,
vLLM direct at topk) run on the same virtual ranks beside torch_sdcp's cells
(bench/one_gpu_competitors.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from torch_sdcp.bench import one_gpu
from torch_sdcp.bench.boundaries import (
    bench_decode,
    bench_output_lse,
    bench_output_lse_up,
    bench_query,
    bench_signal,
    bench_topk,
)
from torch_sdcp.bench.presets import PRESETS
from torch_sdcp.bench.report import plot, tables, verdicts
from torch_sdcp.bench.timing import Timer
from torch_sdcp.cli_types import positive_int, positive_seconds

BOUNDARIES = ("signal", "query", "topk", "output_lse", "output_lse_up", "decode")


class Context:
    def __init__(self, args, rank: int, world: int, backend: str, device: torch.device):
        self.rank, self.world, self.backend, self.device = rank, world, backend, device
        preset = PRESETS[args.preset]
        self.heads = args.heads or preset["heads"]
        self.head_dim, self.rope_dim, self.k = preset["head_dim"], preset["rope_dim"], args.k or preset["k"]
        self.query_dtype = torch.float8_e4m3fn if args.query_dtype == "fp8" else torch.bfloat16
        self.requests, self.context, self.layers, self.sparse = args.requests, args.context, args.layers, args.sparse
        self.eager_collective = args.eager_collective
        self.topk_distributions = args.topk_distributions
        self.tag = args.tag
        self.timer = Timer(device, args.replays, args.trials)
        self.started = time.monotonic()

    def progress(self, what: str) -> None:
        if self.rank == 0:
            print(f"[{time.monotonic() - self.started:6.1f} s] {what} done", file=sys.stderr, flush=True)


def choose_backend(requested: str, world: int) -> str:
    if requested != "auto":
        return requested
    cuda_built = torch._C._dispatch_has_kernel_for_dispatch_key("sdcp::output_lse_combine", "CUDA")
    return "cuda" if cuda_built and torch.cuda.is_available() and torch.cuda.device_count() >= world else "host"


def run_rank(rank: int, world: int, args, store_path: str | None) -> None:
    import torch_sdcp  # noqa: F401

    # NVLink multicast stays off (docs/DESIGN.md section 6), for NCCL and for
    # torch symmetric memory alike.
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[key] = value

    backend = choose_backend(args.backend, world)
    if backend == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        kw: dict = {"device_id": device} if backend == "cuda" else {}
        dist.init_process_group("nccl" if backend == "cuda" else "gloo",
                                store=dist.FileStore(store_path, world) if store_path else None,
                                rank=rank if store_path else -1, world_size=world if store_path else -1, **kw)
    ctx = Context(args, rank, world, backend, device)
    results: dict = {}
    for name in args.boundaries:
        results[name] = []
        try:
            if name == "decode":
                bench_decode(ctx, results[name])
            else:
                {"signal": bench_signal, "query": bench_query, "topk": bench_topk,
                 "output_lse": bench_output_lse, "output_lse_up": bench_output_lse_up}[name](
                    ctx, args.rows, results[name])
        except Exception as e:
            results[name].append({"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
            if rank == 0:
                traceback.print_exc()
    if rank == 0:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "world_size": world, "backend": backend,
                "device": torch.cuda.get_device_name(device) if backend == "cuda" else "cpu (host backend)",
                "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}}
        if backend == "host":  # a reader of the JSON alone must not take these figures for speed
            meta.update(performance=False, note="host backend: protocol checks on shared memory, not performance")
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()



def row_list(text: str) -> str:
    """argparse type: comma-separated ints >= 1; kept as text, parsed where the defaults are chosen."""
    try:
        rows = [int(piece) for piece in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_sdcp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="local ranks, one GPU each (default: the visible GPUs when there are 2 or more, else 2)")
    p.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm-5", help="model geometry (default glm-5)")
    p.add_argument("--heads", type=positive_int, default=0, help="total heads (overrides the preset)")
    p.add_argument("--k", type=positive_int, default=0, help="index_topk (overrides the preset)")
    p.add_argument("--rows", default=None, type=row_list,
                   help="decode rows, comma separated (default 1,32,128,512,1024,4096 on CUDA: up to vLLM's "
                        "default bound and its MTP regime; 1,8,32 on the host backend)")
    p.add_argument("--boundaries", default=None,
                   help=f"comma separated (default {','.join(BOUNDARIES)}; with --one-gpu "
                        f"{','.join(one_gpu.BOUNDARIES)})")
    p.add_argument("--query-dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="decode demo: concurrent requests (default 32; 4 on host)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="decode demo: tokens per request (default 3072; 256 on host)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decode demo: layers per step (default 8; 2 on host)")
    p.add_argument("--sparse", action="store_true", help="decode demo: add the top-K boundary")
    p.add_argument("--eager-collective", action="store_true",
                   help="Output/LSE: also time the collective path with the correction as eager torch ops")
    p.add_argument("--topk-distributions", action="store_true",
                   help="top-K: also time the owner's ordering step alone (sdcp::topk_select over one rank's C "
                        "candidates) for uniform, normal, 80-distinct-value and all-equal scores (the sort_* "
                        "entries of the kernel-alone line)")
    p.add_argument("--tag", action="store_true",
                   help="also time each torch_sdcp call with a call tag (tag=7), beside the untagged one")
    p.add_argument("--replays", type=positive_int, default=None,
                   help=f"per trial (default 100 on CUDA, 3 on host; --one-gpu graph-per-rank: "
                        f"{one_gpu.STEPS_PER_TRIAL} / --one-gpu-steps)")
    p.add_argument("--trials", type=positive_int, default=None, help="default 7 on CUDA, 3 on host")
    p.add_argument("--out", default=None, help="output folder (default sdcp-bench-<date>-<time>)")
    one = p.add_argument_group("one GPU, N virtual ranks (--one-gpu)")
    one.add_argument("--one-gpu", type=one_gpu.world_size, default=None, metavar="N",
                     help="run N virtual ranks (1, 2, 4 or 8) in this process on one GPU against each other, world 1 "
                          "beside them: the kernel side of DCP-N with HBM in place of NVLink, not a multi-GPU figure "
                          f"(boundaries {','.join(one_gpu.BOUNDARIES)}; rows default {one_gpu.DEFAULT_ROWS})")
    one.add_argument("--one-gpu-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                     help="how long a wait on a virtual peer may take before the call gives up and is reported "
                          f"(default {one_gpu.DEFAULT_TIMEOUT_S:g}: a grid that cannot be resident fails fast)")
    one.add_argument("--blocks-per-sm", type=positive_int, default=None,
                     help="blocks of one kernel assumed to fit on an SM, for the co-residency of the N grids "
                          "(default per kernel: " + ", ".join(f"{b} {v}" for b, v in
                                                             one_gpu.ASSUMED_BLOCKS_PER_SM.items()) + ")")
    one.add_argument("--one-gpu-slice", action="store_true",
                     help="size each virtual rank's grids for its share of the SMs (SDCP_BENCH_GRID_SMS), so that "
                          "every row count runs: a cell's figure is then N ranks' work on one GPU, not a "
                          "whole-GPU rank's (the table says so)")
    one.add_argument("--one-gpu-method", type=one_gpu.method_name, default=None, metavar="METHOD",
                     help="how a step is timed: graph-per-rank (default: each rank's steps in a CUDA graph of its "
                          "own, the N graphs launched on N streams) or one-graph (k8 / k1, every rank's call a "
                          "branch of one graph; at N = 4 and 8 some cells time out)")
    one.add_argument("--one-gpu-steps", type=positive_int, default=None, metavar="S",
                     help="graph-per-rank: steps per rank graph, so that a replay's launches and a late rank's "
                          f"start count 1/S per step (default {one_gpu.DEFAULT_STEPS_PER_GRAPH})")
    return p


def parse_args(argv=None):
    p = parser()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    args = p.parse_args(argv)
    if args.one_gpu is not None:
        return one_gpu_args(p, args)
    for name in ("one_gpu_timeout", "blocks_per_sm", "one_gpu_method", "one_gpu_steps", "one_gpu_slice"):
        if getattr(args, name) not in (None, False):
            p.error(f"argument --{name.replace('_', '-')}: expected only with --one-gpu, got it without")
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if cuda else 2
    host = choose_backend(args.backend, args.world_size) == "host"
    args.rows = [int(x) for x in (args.rows or ("1,8,32" if host else "1,32,128,512,1024,4096")).split(",") if x]
    args.boundaries = [b for b in (args.boundaries or ",".join(BOUNDARIES)).split(",") if b]
    for b in args.boundaries:
        if b not in BOUNDARIES:
            p.error(f"argument --boundaries: expected names from {BOUNDARIES}, got {b!r}")
    if not args.boundaries:
        p.error(f"argument --boundaries: expected names from {BOUNDARIES}, got none")
    heads = args.heads or (8 * args.world_size if host else PRESETS[args.preset]["heads"])
    if heads % args.world_size:
        p.error(f"argument --heads: expected a multiple of --world-size {args.world_size}, got {heads}"
                + ("" if args.heads else f" (preset {args.preset})"))
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"argument --out: expected a folder, got the file {args.out!r}")
    args.requests = args.requests or (4 if host else 32)
    args.context = args.context or (256 if host else 3072)
    args.layers = args.layers or (2 if host else 8)
    args.replays = args.replays or (3 if host else 100)
    args.trials = args.trials or (3 if host else 7)
    if host and not args.k:
        args.k = 256  # the host backend sorts on the CPU: keep the default run short
    if host and not args.heads:
        args.heads = 8 * args.world_size
    args.out = args.out or time.strftime("sdcp-bench-%Y%m%d-%H%M%S")
    return args


def one_gpu_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The options of --one-gpu N, checked and completed (its own defaults); a
    bad combination is a usage error naming the option."""
    n = args.one_gpu
    if args.world_size not in (None, 1):
        p.error(f"argument --world-size: expected 1 or none with --one-gpu (its {n} virtual ranks share one "
                f"process), got {args.world_size}")
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched != "1":
        p.error(f"argument --one-gpu: expected one process, got WORLD_SIZE={launched} (torchrun)")
    if args.backend == "host":
        p.error("argument --backend: expected 'cuda' or 'auto' with --one-gpu, got 'host'")
    for flag in ("tag", "eager_collective", "topk_distributions", "sparse"):
        if getattr(args, flag):
            p.error(f"argument --{flag.replace('_', '-')}: expected only without --one-gpu (it times torch_sdcp's "
                    "peer calls alone), got it with --one-gpu")
    names = [b for b in (args.boundaries or ",".join(one_gpu.BOUNDARIES)).split(",") if b]
    for b in names:
        if b not in one_gpu.BOUNDARIES:
            p.error(f"argument --boundaries: expected names from {one_gpu.BOUNDARIES} with --one-gpu, got {b!r}")
    if not names:
        p.error(f"argument --boundaries: expected names from {one_gpu.BOUNDARIES}, got none")
    heads = args.heads or PRESETS[args.preset]["heads"]
    if heads % n:
        p.error(f"argument --heads: expected a multiple of --one-gpu {n}, got {heads}"
                + ("" if args.heads else f" (preset {args.preset})"))
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"argument --out: expected a folder, got the file {args.out!r}")
    method = args.one_gpu_method or one_gpu.METHODS[0]
    if method != one_gpu.GraphPerRank.name and args.one_gpu_steps is not None:
        p.error(f"argument --one-gpu-steps: expected only with --one-gpu-method {one_gpu.GraphPerRank.name}, got "
                f"it with {method}")
    missing = one_gpu.cuda_missing()  # last: every other mistake is reported on any machine
    if missing:
        p.error(f"argument --one-gpu: expected a CUDA GPU and the CUDA kernels, got {missing}")
    args.world_size, args.backend, args.boundaries = 1, "cuda", names
    args.rows = [int(x) for x in (args.rows or one_gpu.DEFAULT_ROWS).split(",")]
    args.one_gpu_timeout = args.one_gpu_timeout or one_gpu.DEFAULT_TIMEOUT_S
    args.one_gpu_method = method
    if method == one_gpu.GraphPerRank.name:
        args.one_gpu_steps = args.one_gpu_steps or one_gpu.DEFAULT_STEPS_PER_GRAPH
        # about as many steps per trial as the plain bench's 100 replays of k8
        args.replays = args.replays or max(1, one_gpu.STEPS_PER_TRIAL // args.one_gpu_steps)
    args.replays, args.trials = args.replays or 100, args.trials or 7
    args.out = args.out or time.strftime("sdcp-bench-onegpu-%Y%m%d-%H%M%S")
    return args


def make_out_folder(out: str) -> str:
    """The output folder made (the last check of the options: nothing is made
    for a bad one), its absolute path; one that cannot be made or written to
    is a usage error naming --out."""
    step = "cannot make it"
    try:
        os.makedirs(out, exist_ok=True)
        step = "cannot write a file in it"
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        parser().error(f"argument --out: expected a folder it can write to, got {out!r}: {step} ({e.strerror or e})")
    return os.path.abspath(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = make_out_folder(args.out)
    if args.one_gpu is not None:
        return one_gpu.run(args)
    backend = choose_backend(args.backend, args.world_size)
    print(f"torch_sdcp bench: world size {args.world_size}, {backend} backend, rows {args.rows}, "
          f"boundaries {args.boundaries}; writing {args.out}", flush=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="sdcp-bench-") as d:
            mp.spawn(run_rank, args=(args.world_size, args, os.path.join(d, "store")), nprocs=args.world_size,
                     join=True)
    with open(os.path.join(args.out, "bench.json")) as f:
        data = json.load(f)
    text = tables(data)
    print(text)
    with open(os.path.join(args.out, "tables.txt"), "w") as f:
        f.write(text + "\n")
    note = plot(data, os.path.join(args.out, "latency.png"))
    print("\n" + "\n".join(verdicts(data)))
    print(f"\nwrote {args.out}:\ntables: {os.path.join(args.out, 'tables.txt')}")
    print(f"plot: {note}" if note else f"plot: {os.path.join(args.out, 'latency.png')}")
    print(f"raw numbers: {os.path.join(args.out, 'bench.json')}")
    return 0
