"""One function per boundary: each times the collective path, the competitors
(Output/LSE, top-K) and torch_sdcp for every row count and appends one row per count."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_sdcp.bench.decode import DecodeStep
from torch_sdcp.bench.timing import guarded
from torch_sdcp.inputs import SCORE_DISTRIBUTIONS, rope_cache, score_distribution

#: The call tag of the "sdcp_tagged" path (--tag): any valid tag costs the same.
TAG = 7


def signal_input(rank: int, device: torch.device) -> torch.Tensor:
    """The 8 bytes rank ``rank`` exchanges."""
    return torch.full((2,), float(rank), device=device)


def output_lse_inputs(g: torch.Generator, rows: int, heads: int, head_dim: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's partials [T, H, D] bf16 and their LSEs [T, H] fp32, drawn from ``g``."""
    po = torch.randn(rows, heads, head_dim, generator=g).to(torch.bfloat16).to(device)
    pl = (torch.randn(rows, heads, generator=g) * 3).to(device)
    return po, pl


def topk_inputs(g: torch.Generator, rows: int, k: int, rank: int, world: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's k candidates per row: scores [T, k] fp32 and global ids [T, k]
    int32 (id % world == rank, so the ranks' ids are disjoint), drawn from ``g``."""
    scores = torch.randn(rows, k, generator=g).to(device)
    ids = (torch.randperm(rows * k, generator=g).view(rows, k) * world + rank).to(torch.int32).to(device)
    return scores, ids


def query_inputs(g: torch.Generator, rows: int, local_heads: int, head_dim: int, rope_dim: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's query parts: nope [T, H_loc, head_dim] and rope [T, H_loc,
    rope_dim] bf16, positions [T] in [0, 4096), drawn from ``g``."""
    nope = torch.randn(rows, local_heads, head_dim, generator=g).to(torch.bfloat16).to(device)
    pe = torch.randn(rows, local_heads, rope_dim, generator=g).to(torch.bfloat16).to(device)
    pos = torch.randint(0, 4096, (rows,), generator=g).to(device)
    return nope, pe, pos


def time_ours(ctx, row: dict, call) -> None:
    """row["sdcp"]: ``call()`` untagged; with --tag, row["sdcp_tagged"]: ``call(tag=TAG)``, timed right after."""
    row["sdcp"] = guarded(ctx.timer, lambda: lambda: call())
    if ctx.tag:
        row["sdcp_tagged"] = guarded(ctx.timer, lambda: lambda: call(tag=TAG))


def bench_signal(ctx, rows_list, out: list) -> None:
    """The fixed cost of one peer round: an exchange of 8 bytes (publish + wait
    on every peer) against the collective all_gather of the same bytes."""
    import torch_sdcp

    ws = torch_sdcp.ExchangeWorkspace(None, 64, backend=ctx.backend, device=ctx.device)
    x = signal_input(ctx.rank, ctx.device)
    gathered = [torch.empty_like(x) for _ in range(ctx.world)]
    row = {"rows": 1, "collective": guarded(ctx.timer, lambda: lambda: dist.all_gather(gathered, x))}
    time_ours(ctx, row, lambda **tag: ws.all_gather(x, **tag))
    out.append(row)
    ctx.progress("signal")
    ws.close()


def bench_output_lse(ctx, rows_list, out: list, head_dim: int | None = None) -> None:
    """The Output/LSE boundary at ``head_dim`` values per head (default the preset's latent width)."""
    import torch_sdcp
    from torch_sdcp import collective

    h, d, dev = ctx.heads, head_dim or ctx.head_dim, ctx.device
    name_of_run = "output_lse" if head_dim is None else "output_lse_up"
    ws = torch_sdcp.OutputLSEWorkspace(None, max(rows_list), h, d, backend=ctx.backend, device=dev)

    def competitor(name):
        if dev.type != "cuda":
            raise RuntimeError("needs CUDA symmetric memory")
        from torch_sdcp.competitors import FlashInferFusedCombine, SymmMemOutputLSE, VllmA2AOutputLSE
        cls = {"symm_mem": SymmMemOutputLSE, "vllm_a2a": VllmA2AOutputLSE, "flashinfer": FlashInferFusedCombine}[name]
        return cls(None, max(rows_list), h, d, torch.bfloat16, dev)

    comps: dict = {}
    for t in rows_list:
        po, pl = output_lse_inputs(torch.Generator().manual_seed(t), t, h, d, dev)
        row = {"rows": t}
        row["collective"] = guarded(ctx.timer, lambda: lambda: collective.lse_all_gather_correct_reduce_scatter(
            po, pl, return_lse=True))
        if ctx.eager_collective:
            row["collective_eager"] = guarded(ctx.timer, lambda: lambda: collective.lse_all_gather_reduce_scatter(
                po, pl, return_lse=True))

        def comp_fn(name):
            def make():
                if name not in comps:
                    comps[name] = competitor(name)
                return lambda: comps[name].combine(po, pl)
            return make

        for name in ("symm_mem", "vllm_a2a", "flashinfer"):
            row[name] = guarded(ctx.timer, comp_fn(name))
        time_ours(ctx, row, lambda **tag: ws.combine(po, pl, return_lse=True, **tag))
        # The least a rank's memory must move: its partials and LSEs read once, its heads' result written once.
        hl = h // ctx.world
        row["bytes"] = t * h * (d * po.element_size() + 4) + t * hl * (d * po.element_size() + 4)
        # vLLM's metadata at decode: one request per row, some shards empty, the last row padding.
        seq_lens = torch.where(torch.arange(t) % 8 == 7, 0, 100 + torch.arange(t)).to(torch.int32).to(dev)
        qsl = torch.arange(t + 1, dtype=torch.int32).clamp_max(max(t - 1, 1)).to(dev)
        row["sdcp_masked"] = guarded(ctx.timer, lambda: lambda: ws.combine(
            po, pl, return_lse=True, seq_lens=seq_lens, query_start_loc=qsl))
        out.append(row)
        ctx.progress(f"{name_of_run} rows={t}")
    sizes = {"workspace_bytes_per_rank": ws.physical_bytes}
    sizes.update({f"{name}_bytes_per_rank": c.physical_bytes for name, c in comps.items()})
    out.append({**sizes, "head_dim": d})
    ws.close()


#: Values per head of the Output/LSE combine after the V up-projection: vLLM
#: 0.34 combines there from 8 rows on (the same heads, 128 values in place of 512).
UP_PROJECTED_HEAD_DIM = 128


def bench_output_lse_up(ctx, rows_list, out: list) -> None:
    """The Output/LSE boundary after the V up-projection (head_dim 128), every path as in bench_output_lse."""
    bench_output_lse(ctx, rows_list, out, head_dim=UP_PROJECTED_HEAD_DIM)


def bench_topk(ctx, rows_list, out: list) -> None:
    import torch_sdcp
    from torch_sdcp import collective, ops

    k, dev, n, r = ctx.k, ctx.device, ctx.world, ctx.rank
    ws = torch_sdcp.TopKWorkspace(None, max(rows_list), k, candidates_per_rank=k, backend=ctx.backend, device=dev)
    comps: dict = {}
    for t in rows_list:
        g = torch.Generator().manual_seed(t * 31 + r)
        scores, ids = topk_inputs(g, t, k, r, n, dev)
        row = {"rows": t}
        row["collective"] = guarded(ctx.timer, lambda: lambda: collective.topk_all_gather_merge(scores, ids, k))
        row["vllm_direct"] = vllm_direct(ctx, comps, max(rows_list), scores, ids)
        time_ours(ctx, row, lambda **tag: ws.merge(scores, ids, **tag))
        row["bytes"] = t * k * (4 + 4) + t * k * 4  # scores and ids read once, k ids written
        # The selection kernel alone: over the gathered N*C candidates (the
        # collective path's share), and over C (an owner's sort).
        gathered_s, gathered_i = scores.repeat(1, n), ids.repeat(1, n)
        row["kernels"] = {
            "select_gathered": guarded(ctx.timer, lambda: lambda: ops.topk_select(gathered_s, gathered_i, k), ks=(8,)),
            "select_own": guarded(ctx.timer, lambda: lambda: ops.topk_select(scores, ids, k), ks=(8,))}
        if ctx.topk_distributions:  # the owner's ordering step alone, per score distribution
            for kind in SCORE_DISTRIBUTIONS:
                ds = score_distribution(kind, t, k, g).to(dev)
                def select(ds: torch.Tensor = ds):
                    return lambda: ops.topk_select(ds, ids, k)

                row["kernels"][f"sort_{kind}"] = guarded(ctx.timer, select, ks=(8,))
        out.append(row)
        ctx.progress(f"topk rows={t}")
    sizes = {"workspace_bytes_per_rank": ws.physical_bytes}
    sizes.update({f"{name}_bytes_per_rank": c.physical_bytes for name, c in comps.items()})
    out.append(sizes)
    ws.close()


def vllm_direct(ctx, comps: dict, max_rows: int, scores: torch.Tensor, ids: torch.Tensor) -> dict:
    """The "vllm_direct" cell of a top-K row: vLLM 0.34.0's direct top-K
    (CUDA only, created on first use, checked once against the collective
    path), k8 only (a graph of an even number of calls keeps its slots
    alternating); rows over vLLM's direct bound are skipped, as vLLM sends
    them to the NCCL all-gather."""
    from torch_sdcp.competitors.vllm_direct_topk import direct_max_rows

    bound, t, k = direct_max_rows(), scores.size(0), ctx.k
    if t > bound:
        return {"error": f"skipped: {t} rows are over vLLM 0.34.0's direct bound, {bound} rows (its DCP workspace "
                         f"bound at the H100/H200 defaults with 3 MTP tokens); vLLM all-gathers them (NCCL)"}

    def make():
        from torch_sdcp import collective

        if ctx.device.type != "cuda":
            raise RuntimeError("needs CUDA symmetric memory")
        if "vllm_direct" not in comps:
            from torch_sdcp.competitors import VllmDirectTopK
            comps["vllm_direct"] = VllmDirectTopK(None, min(max_rows, bound), k, ctx.device)
        got, want = comps["vllm_direct"].merge(scores, ids), collective.topk_all_gather_merge(scores, ids, k)
        if not torch.equal(got, want):
            raise RuntimeError("vLLM direct: its ids differ from the collective path's")
        return lambda: comps["vllm_direct"].merge(scores, ids)

    return guarded(ctx.timer, make, ks=(8,))


def bench_query(ctx, rows_list, out: list) -> None:
    import torch_sdcp
    from torch_sdcp import collective

    hl, dev, dtype = ctx.heads // ctx.world, ctx.device, ctx.query_dtype
    ws = torch_sdcp.QueryWorkspace(None, max(rows_list), hl, nope_dim=ctx.head_dim, rope_dim=ctx.rope_dim,
                                   dtype=dtype, backend=ctx.backend, device=dev)
    cache = rope_cache(4096, ctx.rope_dim).to(dev)
    scale = torch.tensor([0.05], device=dev) if dtype == torch.float8_e4m3fn else None
    for t in rows_list:
        nope, pe, pos = query_inputs(torch.Generator().manual_seed(t), t, hl, ctx.head_dim, ctx.rope_dim, dev)
        row = {"rows": t}
        row["collective"] = guarded(ctx.timer, lambda: lambda: collective.query_all_gather(
            nope, pe, pos, cache, scale, out_dtype=dtype))
        time_ours(ctx, row, lambda **tag: ws.gather(nope, pe, pos, cache, scale, **tag))
        # Inputs read once (nope, rope part, positions, one cache row per row), the gathered query written once.
        out_elem = torch.tensor([], dtype=dtype).element_size()
        row["bytes"] = (t * hl * (ctx.head_dim + ctx.rope_dim) * 2 + t * (pos.element_size() + ctx.rope_dim *
                        cache.element_size()) + t * ctx.heads * (ctx.head_dim + ctx.rope_dim) * out_elem)

        def view_and_release():  # zero-copy: the reader would sit between the two
            ws.gather_view(nope, pe, pos, cache, scale)
            ws.release()

        row["sdcp_view"] = guarded(ctx.timer, lambda: view_and_release)
        out.append(row)
        ctx.progress(f"query rows={t}")
    out.append({"workspace_bytes_per_rank": ws.physical_bytes, "dtype": str(dtype).replace("torch.", "")})
    ws.close()


def bench_decode(ctx, out: list) -> None:
    demo = DecodeStep(ctx, ctx.requests, ctx.context, ctx.layers, ctx.sparse)
    try:
        want = demo.step("collective")
        got = demo.step("sdcp")
        err = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                  for a, b in zip(got, want, strict=False))
        errs: list = [None] * ctx.world
        dist.all_gather_object(errs, err)
        row = {"requests": ctx.requests, "context": ctx.context, "layers": ctx.layers, "sparse": ctx.sparse,
               "max_rel_error": max(errs), "agree": max(errs) < 2e-2, "attention": demo.attention_name,
               "attention_us": demo.attention_us}
        for mode in ("collective", "sdcp"):
            row[mode] = guarded(ctx.timer, lambda: lambda: demo.step(mode), ks=(1,))
        row["compute_only"] = guarded(ctx.timer, lambda: lambda: demo.step("sdcp", compute_only=True), ks=(1,))
        out.append(row)
        ctx.progress("decode step")
    finally:
        demo.close()
