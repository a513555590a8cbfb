"""torch.ops.sdcp.topk_select alone on one GPU, per score distribution: an
owner's ordering step (2048 keys) and the collective path's selection over
2 x 2048 gathered keys, k8 CUDA graphs, median of 7. Checks the first rows
against a Python reference first. Run after the build step of
tools/gpu_suite.sh: python3 tools/sort_lab/select_bench.py"""
import os
import statistics

import torch

import torch_sdcp
from torch_sdcp import ops
from torch_sdcp.inputs import SCORE_DISTRIBUTIONS, score_distribution


def time_k8(fn, replays=100, trials=7):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(8):
            fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000 / (8 * replays))
    return statistics.median(out)


k = 2048
# A one-rank group: topk_merge with no peer (the sort, the call index, the
# ids out) against topk_select over the same row.
store = torch.distributed.FileStore(f"/tmp/sdcp-select-bench-{os.getpid()}", 1)
torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
ws = torch_sdcp.TopKWorkspace(torch.distributed.group.WORLD, 128, k, candidates_per_rank=k,
                              device=torch.device("cuda"))
print(f"{'rows':>5} {'kind':>8} {'own C=2048':>11} {'gathered 2x2048':>16} {'merge N=1':>10}")
for t in (1, 32, 64, 128):
    g = torch.Generator().manual_seed(t)
    ids = (torch.randperm(t * k, generator=g).view(t, k) * 2).to(torch.int32).cuda()
    for kind in ("randn",) + SCORE_DISTRIBUTIONS:
        s = (torch.randn(t, k, generator=g) if kind == "randn" else score_distribution(kind, t, k, g)).cuda()
        ref = torch.sort(s, dim=1, descending=True, stable=True)
        got = ops.topk_select(s, ids, k)
        # ids sorted by (score desc, id asc): check against a CPU reference
        key = [sorted(range(k), key=lambda j: (-s[r, j].item(), ids[r, j].item())) for r in range(min(t, 2))]
        for r in range(min(t, 2)):
            want = ids[r, key[r]].cpu()
            assert torch.equal(got[r].cpu(), want), (t, kind, r)
        own = time_k8(lambda: ops.topk_select(s, ids, k))
        s2, i2 = s.repeat(1, 2), torch.cat([ids, ids + 1], 1)
        gathered = time_k8(lambda: ops.topk_select(s2, i2, k))
        assert torch.equal(ws.merge(s, ids), got)
        merged = time_k8(lambda: ws.merge(s, ids))
        print(f"{t:>5} {kind:>8} {own:>11.2f} {gathered:>16.2f} {merged:>10.2f}", flush=True)
ws.close()
torch.distributed.destroy_process_group()
