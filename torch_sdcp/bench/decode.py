"""The synthetic MLA decode step of the benchmark (DecodeStep)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torch_sdcp.inputs import rope_cache


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
            except Exception:
                times[name] = None
        every: list = [None] * self.ctx.world
        dist.all_gather_object(every, times)
        worst = {name: (None if any(t[name] is None for t in every) else max(t[name] for t in every))
                 for name in times}
        ran = {name: us for name, us in worst.items() if us is not None}
        return (min(ran, key=lambda name: ran[name]) if ran else "matmul"), worst

    def close(self) -> None:
        for ws in (self.query_ws, self.olse_ws, self.topk_ws):
            if ws is not None:
                ws.close()

    def attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None):
        if self.attention_name == "sdpa" and mask is None:
            return self.attention_sdpa(q, kv, mask)
        return self.attention_matmul(q, kv, mask)

    def attention_sdpa(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None):
        d = self.ctx.head_dim
        # One KV head for every query head: batch T, 1 head, H query rows.
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.unsqueeze(1), kv.unsqueeze(1), kv[..., :d].unsqueeze(1), None, True, 0.0, False, scale=self.scale)[:2]
        return out[:, 0].contiguous(), lse[:, 0, : q.shape[1]].contiguous()

    def attention_matmul(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None):
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
            assert self.topk_ws is not None  # made with the sparse step
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
