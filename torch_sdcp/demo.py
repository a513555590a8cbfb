"""Smoke demo: every torch_sdcp operator through the host (shared-memory)
backend on local ranks, each checked against its reference.

    python -m torch_sdcp.demo [--world-size 2] [--rows 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, rows: int, store_path: str, queue) -> None:
    import torch_sdcp
    from torch_sdcp import ops, reference
    from torch_sdcp.inputs import rope_cache

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    lines = []

    def report(name: str, ok: bool, detail: str, seconds: float) -> None:
        lines.append((name, ok, detail, seconds))

    g = torch.Generator().manual_seed(1234)  # identical global inputs on every rank
    h_loc, heads, dim, k = 4, 4 * world, 512, 64
    try:
        # Query boundary: fused RoPE/FP8 producer into every inbox.
        t0 = time.perf_counter()
        nope = torch.randn(world, rows, h_loc, 512, generator=g).to(torch.bfloat16)
        pe = torch.randn(world, rows, h_loc, 64, generator=g).to(torch.bfloat16)
        pos = torch.randint(0, 1024, (rows,), generator=g)
        cache = rope_cache(1024, 64)
        scale = torch.tensor([0.05])
        with torch_sdcp.QueryWorkspace(None, rows, h_loc, backend="host") as ws:
            got = ws.gather(nope[rank], pe[rank], pos, cache, scale)
        want = torch.cat([reference.query_rope_quant_ref(nope[r], pe[r], pos, cache, scale,
                                                         out_dtype=torch.float8_e4m3fn) for r in range(world)], 1)
        report("query_gather (fp8)", torch.equal(got.view(torch.uint8), want.view(torch.uint8)),
               f"{list(got.shape)} bit-identical to producer + all_gather", time.perf_counter() - t0)

        # Top-K boundary: consumers read the owners' shards in place.
        t0 = time.perf_counter()
        scores = torch.randn(world, rows, 2 * k, generator=g)
        gids = torch.randperm(world * rows * 2 * k, generator=g).view(world, rows, 2 * k).to(torch.int32)
        with torch_sdcp.TopKWorkspace(None, rows, k, candidates_per_rank=2 * k, backend="host") as ws:
            got = ws.merge(scores[rank], gids[rank])
        want = reference.topk_merge_ref([(scores[r], gids[r]) for r in range(world)], k)
        report("topk_merge", torch.equal(got, want), f"{list(got.shape)} identical to the stable reference",
               time.perf_counter() - t0)

        # Output/LSE boundary: producers store head shards into the owners' inboxes.
        t0 = time.perf_counter()
        part = torch.randn(world, rows, heads, dim, generator=g).to(torch.bfloat16)
        lse = torch.randn(world, rows, heads, generator=g) * 3
        with torch_sdcp.OutputLSEWorkspace(None, rows, heads, dim, backend="host") as ws:
            out, out_lse = ws.combine(part[rank], lse[rank], return_lse=True)
        ref_out, ref_lse = reference.lse_combine_ref64(part, lse)
        sl = slice(rank * h_loc, (rank + 1) * h_loc)
        err = ((out.double() - ref_out[:, sl]).norm() / ref_out[:, sl].norm()).item()
        report("output_lse_combine", err < 1e-2 and torch.allclose(out_lse.double(), ref_lse[:, sl], atol=1e-5),
               f"{list(out.shape)} rel. error {err:.1e} vs fp64", time.perf_counter() - t0)

        # The signalling primitive.
        t0 = time.perf_counter()
        x = torch.full((rows, 16), float(rank))
        with torch_sdcp.ExchangeWorkspace(None, x.numel() * 4, backend="host") as ws:
            got = ws.all_gather(x)
        report("peer_all_gather", all(bool((got[r] == r).all()) for r in range(world)),
               f"{list(got.shape)} rank-major", time.perf_counter() - t0)

        # Local kernels against their references.
        t0 = time.perf_counter()
        ok = torch.equal(ops.topk_select(scores[rank], gids[rank], k),
                         reference.topk_select_ref(scores[rank], gids[rank], k))
        report("topk_select", ok, "local stable selection", time.perf_counter() - t0)
        t0 = time.perf_counter()
        o, lo = ops.lse_combine(part, lse)
        err = ((o.double() - ref_out).norm() / ref_out.norm()).item()
        report("lse_combine", err < 1e-2, f"local combine, rel. error {err:.1e}", time.perf_counter() - t0)
        t0 = time.perf_counter()
        q = ops.query_rope_quant(nope[rank], pe[rank], pos, cache, rope_style="neox")
        ok = torch.equal(q, reference.query_rope_quant_ref(nope[rank], pe[rank], pos, cache, neox=True))
        report("query_rope_quant", ok, "local producer, bf16, NeoX", time.perf_counter() - t0)
        queue.put((rank, lines, None))
    except Exception as e:  # report, never hang the parent
        queue.put((rank, lines, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args(argv)
    if args.world_size < 1 or args.rows < 1:
        p.error("--world-size and --rows must be >= 1")
    print(f"torch_sdcp smoke demo: {args.world_size} local ranks, host backend, {args.rows} rows", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdcp-demo-") as d:
        procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, args.rows, os.path.join(d, "store"), queue))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        results: dict = {}
        deadline = time.monotonic() + 300
        while len(results) < args.world_size and time.monotonic() < deadline:
            try:
                rank, lines, err = queue.get(timeout=1.0)
                results[rank] = (lines, err)
            except Exception:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    break
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failed = len(results) < args.world_size
    for rank in sorted(results):
        lines, err = results[rank]
        print(f"\nrank {rank}:")
        for name, ok, detail, seconds in lines:
            failed |= not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {name:<20} {detail}  ({seconds * 1e3:.1f} ms)")
        if err:
            failed = True
            print(f"  FAIL {err}")
    if len(results) < args.world_size:
        print(f"\nonly {len(results)} of {args.world_size} ranks reported")
    print("\nall operators agree with their references" if not failed else "\nFAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
