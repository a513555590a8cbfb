"""Side by side: what each DCP boundary costs through the collective path, the
symmetric-memory competitors (Output/LSE, CUDA only) and torch_sdcp, plus a
synthetic MLA decode step. Every table is printed with a legend that names
each path's kernels and communication (LEGEND below).

    python -m torch_sdcp.bench [--world-size N] [--preset glm-5] [--rows 1,8,32]
                               [--boundaries query,topk,output_lse,decode] [--out DIR]
                               [--topk-distributions]

Launches its own local ranks (or runs under torchrun), picks the CUDA backend
when there is one GPU per rank and the CUDA kernels are built, the host
(shared-memory) backend otherwise. Prints one table per boundary, writes the
raw numbers (bench.json) and a plot (latency.png) into the output folder.

Method (docs/DESIGN.md section 6). CUDA: K calls captured back to back in one CUDA
graph (k8: K = 8; k1: one call per graph), `--replays` replays per trial,
`--trials` trials. Host: the same K calls timed on the wall clock. Per-call
time = max over ranks of a trial, median over trials. Ratios are against the
strongest (fastest) baseline of each row. Host numbers check the protocol on
shared memory: they are not performance, and no ratio is printed for them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

from torch_sdcp.inputs import SCORE_DISTRIBUTIONS, rope_cache, score_distribution

PRESETS = {
    "glm-5": dict(heads=64, head_dim=512, rope_dim=64, k=2048),
    "deepseek-v3.2": dict(heads=128, head_dim=512, rope_dim=64, k=2048),
}
BOUNDARIES = ("signal", "query", "topk", "output_lse", "decode")
PATHS = ("collective", "collective_eager", "symm_mem", "vllm_a2a", "sdcp", "sdcp_view")
OURS = ("sdcp", "sdcp_view")
PATH_NAMES = {"collective": "collective", "collective_eager": "collective (eager ops)", "symm_mem": "symm-mem",
              "vllm_a2a": "vLLM a2a", "sdcp": "torch_sdcp", "sdcp_view": "torch_sdcp view"}

# What each path runs: kernels and communication (printed with the tables;
# README.md says the same). The collective query and top-K paths already use
# this library's fastest local kernels (query_rope_quant, topk_select).
LEGEND = {
    "signal": [
        ("collective", "all_gather of 8 bytes per rank (NCCL; gloo on the host backend)"),
        ("torch_sdcp", "ExchangeWorkspace.all_gather: sdcp::peer_all_gather, one kernel storing tagged words "
                       "into every peer's buffer and polling its own buffer (data-as-flag, no flag or fence)"),
    ],
    "query": [
        ("collective", "sdcp::query_rope_quant (this library's fused RoPE + concat + FP8/bf16 producer kernel), "
                       "all_gather of the [T, H/N, 576] bytes (NCCL), one permute copy to [T, H, 576]"),
        ("torch_sdcp", "sdcp::query_gather: the same producer math in one kernel, data-as-flag: stores its "
                       "head shard into every peer's buffer (peer memory) and its own heads into the result, "
                       "polls its own buffer as the peers' shards land; returns a fresh tensor"),
        ("torch_sdcp view", "sdcp::query_publish + query_release: the producer stores into every rank's fixed "
                            "view (final layout) after the previous view's release; the reader uses it in "
                            "place; release re-fills it and acknowledges (two kernels per call)"),
    ],
    "topk": [
        ("collective", "pack (score, id) pairs, all_gather (NCCL), permute copies, sdcp::topk_select (this "
                       "library's stable top-K kernel) over the N x C gathered candidates"),
        ("torch_sdcp", "sdcp::topk_merge: one kernel, data-as-flag: each owner bucket-ranks its candidates, stores "
                       "its best min(C, k) keys into every peer's buffer (peer memory), and merges the peers' "
                       "sorted lists (merge path) as they land in its own buffer"),
    ],
    "output_lse": [
        ("collective", "all_gather of the LSE [T, H] fp32 (NCCL) -> sdcp::lse_correct (one fused kernel: global "
                       "LSE and w_rank * O written head-major [H, T, D]) -> reduce_scatter_tensor (sum, NCCL) on "
                       "heads; the structure of vLLM's cp_lse_ag_out_rs"),
        ("collective (eager ops)", "(--eager-collective) the same two collectives with the correction as ~20 "
                                   "eager torch ops and transpose copies (collective.lse_all_gather_reduce_scatter)"),
        ("symm-mem", "torch symmetric memory: barrier, 2N copy kernels into the peers' inboxes, barrier, "
                     "sdcp::lse_combine (fp32)"),
        ("vLLM a2a", "vLLM's direct all-to-all (PR #50484) on torch symmetric memory: device epoch, one Triton "
                     "dispatch kernel into every peer's slot epoch % 2, one barrier (signal round), one Triton "
                     "combine kernel (fp32)"),
        ("torch_sdcp", "sdcp::output_lse_combine: one kernel, data-as-flag: stores every peer's head shard and "
                       "LSE into that peer's buffer (peer memory), polls its own buffer as the peers' shards land, "
                       "reads its own shard in place, combines in fp32"),
    ],
    "decode": [
        ("collective", "query: collective path above; attention; Output/LSE: the fused collective path "
                       "(all_gather, sdcp::lse_correct, reduce_scatter); with --sparse, top-K: collective path"),
        ("torch_sdcp", "query_publish/release (zero copy), attention, output_lse_combine; with --sparse, "
                       "topk_merge"),
    ],
}


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

class Timer:
    """Per-call microseconds of `fn`, max over ranks, median over trials."""

    def __init__(self, device: torch.device, replays: int, trials: int):
        self.device, self.replays, self.trials = device, replays, trials

    def _trials_cuda(self, fn: Callable[[], object], calls: int) -> list[float]:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on the capture stream
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(self.trials):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.replays):
                graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3 / (self.replays * calls))
        return out

    def _trials_host(self, fn: Callable[[], object], calls: int) -> list[float]:
        fn()
        out = []
        for _ in range(self.trials):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(self.replays):
                for _ in range(calls):
                    fn()
            out.append((time.perf_counter() - t0) * 1e6 / (self.replays * calls))
        return out

    def per_call_us(self, fn: Callable[[], object], calls: int) -> float:
        run = self._trials_cuda if self.device.type == "cuda" else self._trials_host
        mine = run(fn, calls)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return statistics.median(max(r[i] for r in every) for i in range(len(mine)))

    def measure(self, fn: Callable[[], object], ks=(8, 1)) -> dict:
        return {f"k{k}": self.per_call_us(fn, k) for k in ks}


def guarded(timer: Timer, fn_factory: Callable[[], Callable[[], object]], ks=(8, 1)) -> dict:
    """A path that cannot run here says why instead of failing the run. Every
    rank agrees on the verdict, so no rank is left waiting in a collective."""
    try:
        fn, err = fn_factory(), None
    except Exception as e:  # noqa: BLE001
        fn, err = None, f"{type(e).__name__}: {e}".splitlines()[0][:160]
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    first = next((e for e in errs if e), None)
    if first:
        return {"error": first}
    return timer.measure(fn, ks)


# ---------------------------------------------------------------------------
# Boundaries
# ---------------------------------------------------------------------------

def bench_signal(ctx, rows_list, out: list) -> None:
    """The fixed cost of one peer round: an exchange of 8 bytes (publish + wait
    on every peer) against the collective all_gather of the same bytes."""
    import torch_sdcp

    ws = torch_sdcp.ExchangeWorkspace(None, 64, backend=ctx.backend, device=ctx.device)
    x = torch.full((2,), float(ctx.rank), device=ctx.device)
    gathered = [torch.empty_like(x) for _ in range(ctx.world)]
    row = {"rows": 1, "collective": guarded(ctx.timer, lambda: lambda: dist.all_gather(gathered, x)),
           "sdcp": guarded(ctx.timer, lambda: lambda: ws.all_gather(x))}
    out.append(row)
    ctx.progress("signal")
    ws.close()


def bench_output_lse(ctx, rows_list, out: list) -> None:
    import torch_sdcp
    from torch_sdcp import collective

    h, d, dev = ctx.heads, ctx.head_dim, ctx.device
    ws = torch_sdcp.OutputLSEWorkspace(None, max(rows_list), h, d, backend=ctx.backend, device=dev)

    def competitor(name):
        if dev.type != "cuda":
            raise RuntimeError("needs CUDA symmetric memory")
        from torch_sdcp.competitors import SymmMemOutputLSE, VllmA2AOutputLSE
        cls = {"symm_mem": SymmMemOutputLSE, "vllm_a2a": VllmA2AOutputLSE}[name]
        return cls(None, max(rows_list), h, d, torch.bfloat16, dev)

    comps: dict = {}
    for t in rows_list:
        g = torch.Generator().manual_seed(t)
        po = torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(dev)
        pl = (torch.randn(t, h, generator=g) * 3).to(dev)
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

        for name in ("symm_mem", "vllm_a2a"):
            row[name] = guarded(ctx.timer, comp_fn(name))
        row["sdcp"] = guarded(ctx.timer, lambda: lambda: ws.combine(po, pl, return_lse=True))
        out.append(row)
        ctx.progress(f"output_lse rows={t}")
    sizes = {"workspace_bytes_per_rank": ws.physical_bytes}
    sizes.update({f"{name}_bytes_per_rank": c.physical_bytes for name, c in comps.items()})
    out.append(sizes)
    ws.close()


def bench_topk(ctx, rows_list, out: list) -> None:
    import torch_sdcp
    from torch_sdcp import collective, ops

    k, dev, n, r = ctx.k, ctx.device, ctx.world, ctx.rank
    ws = torch_sdcp.TopKWorkspace(None, max(rows_list), k, candidates_per_rank=k, backend=ctx.backend, device=dev)
    for t in rows_list:
        g = torch.Generator().manual_seed(t * 31 + r)
        scores = torch.randn(t, k, generator=g).to(dev)
        ids = (torch.randperm(t * k, generator=g).view(t, k) * n + r).to(torch.int32).to(dev)
        row = {"rows": t}
        row["collective"] = guarded(ctx.timer, lambda: lambda: collective.topk_all_gather_merge(scores, ids, k))
        row["sdcp"] = guarded(ctx.timer, lambda: lambda: ws.merge(scores, ids))
        # The selection kernel alone: over the gathered N*C candidates (the
        # collective path's share), and over C (an owner's sort).
        gathered_s, gathered_i = scores.repeat(1, n), ids.repeat(1, n)
        row["kernels"] = {
            "select_gathered": guarded(ctx.timer, lambda: lambda: ops.topk_select(gathered_s, gathered_i, k), ks=(8,)),
            "select_own": guarded(ctx.timer, lambda: lambda: ops.topk_select(scores, ids, k), ks=(8,))}
        if ctx.topk_distributions:  # the owner's ordering step alone, per score distribution
            for kind in SCORE_DISTRIBUTIONS:
                ds = score_distribution(kind, t, k, g).to(dev)
                row["kernels"][f"sort_{kind}"] = guarded(
                    ctx.timer, lambda ds=ds: lambda: ops.topk_select(ds, ids, k), ks=(8,))
        out.append(row)
        ctx.progress(f"topk rows={t}")
    out.append({"workspace_bytes_per_rank": ws.physical_bytes})
    ws.close()


def bench_query(ctx, rows_list, out: list) -> None:
    import torch_sdcp
    from torch_sdcp import collective

    hl, dev, dtype = ctx.heads // ctx.world, ctx.device, ctx.query_dtype
    ws = torch_sdcp.QueryWorkspace(None, max(rows_list), hl, nope_dim=ctx.head_dim, rope_dim=ctx.rope_dim,
                                   dtype=dtype, backend=ctx.backend, device=dev)
    cache = rope_cache(4096, ctx.rope_dim).to(dev)
    scale = torch.tensor([0.05], device=dev) if dtype == torch.float8_e4m3fn else None
    for t in rows_list:
        g = torch.Generator().manual_seed(t)
        nope = torch.randn(t, hl, ctx.head_dim, generator=g).to(torch.bfloat16).to(dev)
        pe = torch.randn(t, hl, ctx.rope_dim, generator=g).to(torch.bfloat16).to(dev)
        pos = torch.randint(0, 4096, (t,), generator=g).to(dev)
        row = {"rows": t}
        row["collective"] = guarded(ctx.timer, lambda: lambda: collective.query_all_gather(
            nope, pe, pos, cache, scale, out_dtype=dtype))
        row["sdcp"] = guarded(ctx.timer, lambda: lambda: ws.gather(nope, pe, pos, cache, scale))

        def view_and_release():  # zero-copy: the reader would sit between the two
            ws.gather_view(nope, pe, pos, cache, scale)
            ws.release()

        row["sdcp_view"] = guarded(ctx.timer, lambda: view_and_release)
        out.append(row)
        ctx.progress(f"query rows={t}")
    out.append({"workspace_bytes_per_rank": ws.physical_bytes, "dtype": str(dtype).replace("torch.", "")})
    ws.close()


# ---------------------------------------------------------------------------
# Decode-step demo
# ---------------------------------------------------------------------------

class DecodeStep:
    """A synthetic MLA DCP attention block, `layers` times: query boundary ->
    attention of every head over this rank's KV shard -> output/LSE boundary.
    torch_sdcp reads the query in place (gather_view); the collective mode runs
    the collective query path and the fused collective Output/LSE path. With
    `sparse`, an indexer proposes each rank's local top-k candidates and the
    top-K boundary selects the tokens attended to. `mode` is "collective" or
    "sdcp": identical inputs, different crossings.

    Attention (absorbed MLA: q and k 576 dims, v the first 512, one KV head
    shared by every query head, LSE kept for the combine): the fastest of the
    candidates in ATTENTION that runs here, timed at set-up (max over ranks) and
    checked against the matmul form: "matmul" (q . kv and P . kv[:512] as bf16
    tensor-core matmuls with fp32 accumulation, softmax and logsumexp in fp32,
    P rounded to bf16 as flash kernels do) or, on CUDA without a mask, "sdpa"
    (PyTorch's memory-efficient SDPA kernel, which takes Ev != E and returns
    the LSE; the query heads are the rows of one KV head). Flash SDPA needs
    Ev == E and at most 256 dims, so it does not apply."""

    ATTENTION = {
        "matmul": "bf16 tensor-core matmuls (fp32 accumulation), fp32 softmax and logsumexp",
        "sdpa": "torch SDPA memory-efficient kernel (aten._scaled_dot_product_efficient_attention, Ev != E, "
                "with LSE)",
    }

    def __init__(self, ctx, requests: int, context: int, layers: int, sparse: bool, seed: int = 0):
        import torch_sdcp

        self.ctx, self.layers, self.sparse = ctx, layers, sparse
        n, r, dev = ctx.world, ctx.rank, ctx.device
        h, d, rope = ctx.heads, ctx.head_dim, ctx.rope_dim
        self.hl, self.t = h // n, requests
        local = math.ceil(context / n)  # tokens of each request on this rank (interleave 1)
        g = torch.Generator().manual_seed(seed * 1000 + r)
        # Per layer: this rank's query heads and KV shard [T, local, 576].
        self.nope = [torch.randn(requests, self.hl, d, generator=g).to(torch.bfloat16).to(dev) for _ in range(layers)]
        self.pe = [torch.randn(requests, self.hl, rope, generator=g).to(torch.bfloat16).to(dev) for _ in range(layers)]
        self.kv = [(torch.randn(requests, local, d + rope, generator=g) / math.sqrt(d + rope)).to(torch.bfloat16)
                   .to(dev) for _ in range(layers)]
        self.pos = torch.full((requests,), context - 1, dtype=torch.int64, device=dev)
        self.cache = rope_cache(context, rope).to(dev)
        self.scale = 1.0 / math.sqrt(d + rope)
        # Global token id of local token j on this rank: j * N + r.
        self.gid = (torch.arange(local, device=dev) * n + r).to(torch.int32).expand(requests, local).contiguous()
        self.k = min(ctx.k, local)
        self.query_ws = torch_sdcp.QueryWorkspace(None, requests, self.hl, nope_dim=d, rope_dim=rope,
                                                  dtype=torch.bfloat16, backend=ctx.backend, device=dev)
        self.olse_ws = torch_sdcp.OutputLSEWorkspace(None, requests, h, d, backend=ctx.backend, device=dev)
        self.topk_ws = (torch_sdcp.TopKWorkspace(None, requests, self.k, candidates_per_rank=self.k,
                                                 backend=ctx.backend, device=dev) if sparse else None)
        self.attention_name, self.attention_us = self.choose_attention()

    def choose_attention(self) -> tuple:
        """The fastest attention that runs here and agrees with the matmul form
        (every rank makes the same choice: slowest rank's times)."""
        candidates = {"matmul": self.attention_matmul}
        if self.ctx.device.type == "cuda" and not self.sparse:
            candidates["sdpa"] = self.attention_sdpa
        if len(candidates) == 1:
            return "matmul", {}
        q = torch.cat([self.nope[0], self.pe[0]], -1).repeat(1, self.ctx.world, 1)
        want_o, want_l = self.attention_matmul(q, self.kv[0], None)
        times = {}
        for name, fn in candidates.items():
            try:
                o, lse = fn(q, self.kv[0], None)
                err = ((o.float() - want_o.float()).norm() / want_o.float().norm()).item()
                if err > 2e-2 or not torch.allclose(lse, want_l, rtol=1e-3, atol=1e-3):
                    raise RuntimeError(f"disagrees with the matmul form (rel. error {err:.1e})")
                for _ in range(3):
                    fn(q, self.kv[0], None)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    fn(q, self.kv[0], None)
                end.record()
                end.synchronize()
                times[name] = start.elapsed_time(end) * 1e3 / 20
            except Exception:  # noqa: BLE001  (a candidate that cannot run here is not chosen)
                times[name] = None
        every: list = [None] * self.ctx.world
        dist.all_gather_object(every, times)
        worst = {name: (None if any(t[name] is None for t in every) else max(t[name] for t in every))
                 for name in times}
        ran = {name: us for name, us in worst.items() if us is not None}
        return (min(ran, key=ran.get) if ran else "matmul"), worst

    def close(self) -> None:
        for ws in (self.query_ws, self.olse_ws, self.topk_ws):
            if ws is not None:
                ws.close()

    def attention(self, q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor]):
        if self.attention_name == "sdpa" and mask is None:
            return self.attention_sdpa(q, kv, mask)
        return self.attention_matmul(q, kv, mask)

    def attention_sdpa(self, q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor]):
        d = self.ctx.head_dim
        # One KV head for every query head: batch T, 1 head, H query rows.
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.unsqueeze(1), kv.unsqueeze(1), kv[..., :d].unsqueeze(1), None, True, 0.0, False, scale=self.scale)[:2]
        return out[:, 0].contiguous(), lse[:, 0, : q.shape[1]].contiguous()

    def attention_matmul(self, q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor]):
        scores = torch.matmul(q, kv.transpose(1, 2)).float() * self.scale  # [T, H, L]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = torch.matmul(p.to(torch.bfloat16), kv[..., : self.ctx.head_dim])
        return out, lse

    def selected_mask(self, layer: int, mode: str) -> torch.Tensor:
        from torch_sdcp import collective

        idx = torch.einsum("thc,tjc->tj", self.pe[layer].float(), self.kv[layer][..., -self.ctx.rope_dim:].float())
        top = torch.topk(idx, self.k, dim=-1)  # this rank's local candidates
        cand_ids = torch.gather(self.gid, 1, top.indices).to(torch.int32)
        if mode == "sdcp":
            chosen = self.topk_ws.merge(top.values.contiguous(), cand_ids.contiguous())
        else:
            chosen = collective.topk_all_gather_merge(top.values.contiguous(), cand_ids.contiguous(), self.k)
        mask = torch.zeros(self.gid.shape, dtype=torch.bool, device=self.gid.device)
        mine = (chosen >= 0) & (chosen % self.ctx.world == self.ctx.rank)
        local = torch.where(mine, chosen // self.ctx.world, 0).long()
        return mask.scatter(1, local, mine)

    def step(self, mode: str, compute_only: bool = False) -> list:
        from torch_sdcp import collective

        outs = []
        for layer in range(self.layers):
            if compute_only:  # the same math without crossing the group
                q = torch.cat([self.nope[layer], self.pe[layer]], -1).repeat(1, self.ctx.world, 1)
            elif mode == "sdcp":
                q = self.query_ws.gather_view(self.nope[layer], self.pe[layer], self.pos, self.cache)
            else:
                q = collective.query_all_gather(self.nope[layer], self.pe[layer], self.pos, self.cache)
            mask = self.selected_mask(layer, mode) if self.sparse and not compute_only else None
            o, lse = self.attention(q, self.kv[layer], mask)
            if mode == "sdcp" and not compute_only:
                self.query_ws.release()  # the attention above was the inbox's last reader
            if compute_only:
                outs.append(o[:, : self.hl])
            elif mode == "sdcp":
                outs.append(self.olse_ws.combine(o, lse))
            else:
                outs.append(collective.lse_all_gather_correct_reduce_scatter(o, lse))
        return outs


def bench_decode(ctx, out: list) -> None:
    demo = DecodeStep(ctx, ctx.requests, ctx.context, ctx.layers, ctx.sparse)
    try:
        want = demo.step("collective")
        got = demo.step("sdcp")
        err = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                  for a, b in zip(got, want))
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


# ---------------------------------------------------------------------------
# Ranks, tables, plot
# ---------------------------------------------------------------------------

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


def run_rank(rank: int, world: int, args, store_path: Optional[str]) -> None:
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
        kw = dict(device_id=device) if backend == "cuda" else {}
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
                 "output_lse": bench_output_lse}[name](
                    ctx, args.rows, results[name])
        except Exception as e:  # noqa: BLE001  (reported in the table)
            results[name].append({"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
            if rank == 0:
                traceback.print_exc()
    if rank == 0:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "world_size": world, "backend": backend,
                "device": torch.cuda.get_device_name(device) if backend == "cuda" else "cpu (host backend)",
                "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}}
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def fmt_us(cell: dict, k: str) -> str:
    if "error" in cell:
        return "n/a"
    v = cell.get(k)
    return f"{v:.1f}" if isinstance(v, (int, float)) else "n/a"


def strongest_baseline(row: dict) -> Optional[tuple]:
    """(name, k8 us) of the fastest baseline path of a row, or None."""
    timed = [(row[p]["k8"], p) for p in PATHS
             if p in row and p not in OURS and isinstance(row[p].get("k8"), (int, float))]
    if not timed:
        return None
    us, p = min(timed)
    return PATH_NAMES[p], us


def legend(names) -> list:
    lines = ["\nlegend (what each path runs)"]
    for name in names:
        for path, what in LEGEND.get(name, []):
            lines.append(f"  {name} / {path}: {what}")
    return lines


def tables(data: dict) -> str:
    meta, lines = data["meta"], []
    cuda = meta["backend"] == "cuda"
    k8 = "8 calls per CUDA graph" if cuda else "8 calls back to back"
    lines.append(f"torch_sdcp bench, {meta['date']}: world size {meta['world_size']}, {meta['device']}, "
                 f"torch {meta['torch']}; us per call, k8 / k1 (k8: {k8}; k1: one call)")
    if cuda:
        lines.append("ratios: the strongest (fastest) baseline of the row over torch_sdcp, k8")
    else:
        lines.append("host backend: these figures check the protocol on shared memory; they are not "
                     "performance, and no speed-up ratio is printed")
    for name, rows in data["results"].items():
        lines.append(f"\n{name}")
        for row in rows:
            if "error" in row and len(row) == 1:
                lines.append(f"  could not run: {row['error']}")
            elif "rows" in row:
                paths = [p for p in PATHS if p in row]
                cells = [f"{PATH_NAMES[p]} {fmt_us(row[p], 'k8')} / {fmt_us(row[p], 'k1')}" for p in paths]
                best = strongest_baseline(row) if cuda else None
                for p in paths:
                    ours = row[p].get("k8") if p in OURS and "error" not in row[p] else None
                    if best and ours:
                        cells.append(f"{best[0]}/{PATH_NAMES[p]} {best[1] / ours:.2f}x")
                lines.append(f"  rows {row['rows']:>4}  " + " | ".join(cells))
                if "kernels" in row:
                    lines.append("             kernel alone (k8): " + ", ".join(
                        f"{name} {fmt_us(cell, 'k8')}" for name, cell in row["kernels"].items()))
                for p in paths:
                    if "error" in row[p]:
                        lines.append(f"           {PATH_NAMES[p]}: {row[p]['error']}")
            elif "requests" in row:
                c, s, comp = (row[m].get("k1") for m in ("collective", "sdcp", "compute_only"))
                lines.append(f"  {row['layers']} layers, {row['requests']} requests x {row['context']} tokens"
                             f"{', sparse' if row['sparse'] else ''}: outputs agree: {row['agree']} "
                             f"(max rel. error {row['max_rel_error']:.1e})")
                att = row.get("attention")
                if att:
                    timed = ", ".join(f"{k} {'n/a' if v is None else f'{v:.1f} us'}"
                                      for k, v in (row.get("attention_us") or {}).items())
                    lines.append(f"  attention: {att}: {DecodeStep.ATTENTION.get(att, att)}"
                                 + (f" (one layer, timed: {timed})" if timed else ""))
                if c and s:
                    share = lambda t: max(0.0, (t - comp) / t) if comp else float("nan")  # noqa: E731
                    step = (f"  step: collective {c:.1f} us ({share(c):.0%} crossing the group), "
                            f"torch_sdcp {s:.1f} us ({share(s):.0%})")
                    lines.append(step + (f", {1 - s / c:.0%} lower" if cuda else ""))
            else:
                lines.append(f"  {json.dumps(row)}")
    lines += legend(data["results"].keys())
    return "\n".join(lines)


def plot(data: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    boundaries = [b for b, rows in data["results"].items()
                  if b != "signal" and any("rows" in r for r in rows)]
    if not boundaries:
        return None
    fig, axes = plt.subplots(1, len(boundaries), figsize=(5 * len(boundaries), 4), squeeze=False)
    for ax, name in zip(axes[0], boundaries):
        rows = [r for r in data["results"][name] if "rows" in r]
        for p in PATHS:
            pts = [(r["rows"], r[p]["k8"]) for r in rows if p in r and "k8" in r[p]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=PATH_NAMES[p])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (decode tokens)")
        ax.set_ylabel("us per call (k8)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    meta = data["meta"]
    fig.suptitle(f"torch_sdcp, world size {meta['world_size']}, {meta['device']} ({meta['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_sdcp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count() if cuda else 2)
    p.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm-5", help="model geometry (default glm-5)")
    p.add_argument("--heads", type=int, default=0, help="total heads (overrides the preset)")
    p.add_argument("--k", type=int, default=0, help="index_topk (overrides the preset)")
    p.add_argument("--rows", default=None, help="decode rows, comma separated (default 1,8,16,32,64,128 on CUDA, "
                                                "1,8,32 on the host backend)")
    p.add_argument("--boundaries", default=",".join(BOUNDARIES))
    p.add_argument("--query-dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--requests", type=int, default=None, help="decode demo: concurrent requests (default 32; 4 on host)")
    p.add_argument("--context", type=int, default=None, help="decode demo: tokens per request (default 3072; 256 on host)")
    p.add_argument("--layers", type=int, default=None, help="decode demo: layers per step (default 8; 2 on host)")
    p.add_argument("--sparse", action="store_true", help="decode demo: add the top-K boundary")
    p.add_argument("--eager-collective", action="store_true",
                   help="Output/LSE: also time the collective path with the correction as eager torch ops")
    p.add_argument("--topk-distributions", action="store_true",
                   help="top-K: also time the owner's ordering step alone (sdcp::topk_select over one rank's C "
                        "candidates) for uniform, normal, 80-distinct-value and all-equal scores (the sort_* "
                        "entries of the kernel-alone line)")
    p.add_argument("--replays", type=int, default=None, help="per trial (default 100 on CUDA, 3 on host)")
    p.add_argument("--trials", type=int, default=None, help="default 7 on CUDA, 3 on host")
    p.add_argument("--out", default=None, help="output folder (default sdcp-bench-<date>-<time>)")
    args = p.parse_args(argv)
    host = choose_backend(args.backend, args.world_size) == "host"
    args.rows = [int(x) for x in (args.rows or ("1,8,32" if host else "1,8,16,32,64,128")).split(",") if x]
    args.boundaries = [b for b in args.boundaries.split(",") if b]
    for b in args.boundaries:
        if b not in BOUNDARIES:
            p.error(f"argument --boundaries: expected names from {BOUNDARIES}, got {b!r}")
    if args.world_size < 1 or any(r < 1 for r in args.rows):
        p.error("argument --world-size and --rows: expected positive values")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
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
    print(f"\n{note}" if note else f"\nplot: {os.path.join(args.out, 'latency.png')}")
    print(f"raw numbers: {os.path.join(args.out, 'bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
