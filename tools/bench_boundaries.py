"""Side-by-side latency of each boundary: the collective (NCCL) path, the
symmetric-memory competitor (Output/LSE) and torch_sdcp, on local GPUs.

Method (DESIGN.md section 6): K calls captured back to back in one CUDA graph
(K = 8, and K = 1 for the isolated figure), 100 replays per trial, 7 trials;
per-call time = max over ranks of each trial, median over trials.

    python tools/bench_boundaries.py --world-size 2 --boundaries output_lse,topk,query,signal
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def time_graph(fn, calls: int, replays: int, trials: int) -> list[float]:
    """Per-call microseconds of each trial, this rank."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            graph.replay()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / (replays * calls))
    del graph
    return out


def across_ranks(times: list[float]) -> float:
    """Median over trials of the max over ranks."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    return statistics.median(max(r[i] for r in every) for i in range(len(times)))


def measure(fn, args) -> dict:
    return {"k8": across_ranks(time_graph(fn, 8, args.replays, args.trials)),
            "k1": across_ranks(time_graph(fn, 1, args.replays, args.trials))}


def bench_output_lse(args, rank, world, device, results):
    import torch_sdcp
    from torch_sdcp import reference
    sys.path.insert(0, HERE)
    from symm_mem_competitor import SymmMemOutputLSE

    h, d = args.heads, args.head_dim
    ws = torch_sdcp.OutputLSEWorkspace(None, max(args.rows), h, d, device=device)
    try:
        comp = SymmMemOutputLSE(None, max(args.rows), h, d, torch.bfloat16, device)
    except Exception as e:  # a machine that cannot run a path says so
        comp, comp_err = None, f"{type(e).__name__}: {e}"
    for t in args.rows:
        g = torch.Generator(device="cpu").manual_seed(t)
        po = torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(device)
        pl = (torch.randn(t, h, generator=g) * 3).to(device)
        row = {"rows": t}
        row["nccl"] = measure(lambda: reference.lse_all_gather_reduce_scatter(po, pl, return_lse=True), args)
        row["symm_mem"] = measure(lambda: comp.combine(po, pl), args) if comp else {"error": comp_err}
        row["sdcp"] = measure(lambda: ws.combine(po, pl, return_lse=True), args)
        results.append(row)
        if rank == 0:
            print(f"output_lse rows={t}: {row}", flush=True)
    if rank == 0:
        results.append({"workspace_bytes_per_rank": ws.physical_bytes,
                        "symm_mem_bytes_per_rank": comp.physical_bytes if comp else None,
                        "workspace_bytes_n4_two_slots": torch.ops.sdcp.workspace_nbytes(
                            1, [128, 64, 512, 2], 4)})
    ws.close()


def bench_topk(args, rank, world, device, results):
    import torch_sdcp
    from torch_sdcp import reference

    k = args.k
    ws = torch_sdcp.TopKWorkspace(None, max(args.rows), k, candidates_per_rank=k, device=device)
    for t in args.rows:
        g = torch.Generator().manual_seed(t + 100 * rank)
        scores = torch.randn(t, k, generator=g).to(device)
        ids = (torch.randperm(t * k, generator=g).view(t, k) * world + rank).to(torch.int32).to(device)
        row = {"rows": t}
        row["nccl"] = measure(lambda: reference.topk_all_gather_merge(scores, ids, k), args)
        row["sdcp"] = measure(lambda: ws.merge(scores, ids), args)
        results.append(row)
        if rank == 0:
            print(f"topk rows={t}: {row}", flush=True)
    if rank == 0:
        results.append({"workspace_bytes_per_rank": ws.physical_bytes})
    ws.close()


def bench_query(args, rank, world, device, results):
    import torch_sdcp
    from torch_sdcp import reference

    hl = args.heads // world
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        ws = torch_sdcp.QueryWorkspace(None, max(args.rows), hl, dtype=dtype, device=device)
        for t in args.rows:
            g = torch.Generator().manual_seed(t)
            nope = torch.randn(t, hl, 512, generator=g).to(torch.bfloat16).to(device)
            pe = torch.randn(t, hl, 64, generator=g).to(torch.bfloat16).to(device)
            pos = torch.randint(0, 4096, (t,), generator=g).to(device)
            cache = torch.randn(4096, 64, generator=g).to(device)
            scale = torch.tensor([0.05], device=device) if dtype == torch.float8_e4m3fn else None
            row = {"rows": t, "dtype": str(dtype).replace("torch.", "")}
            row["nccl"] = measure(lambda: reference.query_all_gather(nope, pe, pos, cache, scale, out_dtype=dtype),
                                  args)
            row["sdcp"] = measure(lambda: ws.gather(nope, pe, pos, cache, scale), args)
            results.append(row)
            if rank == 0:
                print(f"query {row['dtype']} rows={t}: {row}", flush=True)
        if rank == 0:
            results.append({"dtype": str(dtype), "workspace_bytes_per_rank": ws.physical_bytes})
        ws.close()


def bench_signal(args, rank, world, device, results):
    import torch_sdcp

    ws = torch_sdcp.ExchangeWorkspace(None, 64, device=device)
    x = torch.full((2,), float(rank), device=device)
    row = {"what": "peer_all_gather of 8 bytes (publish + wait)", "sdcp": measure(lambda: ws.all_gather(x), args)}
    out = [torch.empty_like(x) for _ in range(world)]
    row["nccl_all_gather"] = measure(lambda: dist.all_gather(out, x), args)
    results.append(row)
    if rank == 0:
        print(f"signal: {row}", flush=True)
    ws.close()


BENCHES = {"output_lse": bench_output_lse, "topk": bench_topk, "query": bench_query, "signal": bench_signal}


def _rank_main(rank, world, args, store_path, out_path):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=device)
    results = {}
    for name in args.boundaries:
        results[name] = []
        try:
            BENCHES[name](args, rank, world, device, results[name])
        except Exception as e:
            results[name].append({"error": f"{type(e).__name__}: {e}"})
            if rank == 0:
                import traceback
                traceback.print_exc()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world, "device": torch.cuda.get_device_name(device),
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def fmt(x):
    return f"{x:8.2f}" if isinstance(x, (int, float)) else f"{'n/a':>8}"


def print_tables(data: dict) -> None:
    for name, rows in data["results"].items():
        print(f"\n== {name} (world {data['world_size']}, {data['device']}) ==")
        for row in rows:
            if "rows" not in row:
                print("  ", row)
                continue
            paths = [p for p in ("nccl", "symm_mem", "sdcp") if p in row]
            head = f"  rows {row['rows']:>4} {row.get('dtype', '')}"
            cells = []
            for k in ("k8", "k1"):
                for p in paths:
                    cells.append(f"{p}/{k} {fmt(row[p].get(k))}")
                s = row["sdcp"].get(k)
                for p in paths:
                    if p != "sdcp" and isinstance(row[p].get(k), float) and s:
                        cells.append(f"{p}/sdcp {row[p][k] / s:5.2f}x")
            print(head, " | ".join(cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--boundaries", default="signal,output_lse,topk,query")
    p.add_argument("--rows", default="1,8,16,32,64,128")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--out", default="bench.json")
    args = p.parse_args(argv)
    args.boundaries = [b for b in args.boundaries.split(",") if b]
    args.rows = [int(r) for r in args.rows.split(",")]
    for b in args.boundaries:
        if b not in BENCHES:
            p.error(f"--boundaries: expected names from {sorted(BENCHES)}, got {b!r}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(args.world_size, args, os.path.join(d, "store"), args.out),
                 nprocs=args.world_size, join=True)
    with open(args.out) as f:
        print_tables(json.load(f))


if __name__ == "__main__":
    main()
