"""World-1 calls of each boundary for Nsight Compute, which times every
launch alone: the Output/LSE combine at OLSE_ROWS rows (default 1,32;
unmasked, then with the bench's vLLM mask), the top-K merge and topk_select
at TOPK_ROWS rows (default 1), the 8-byte exchange, and the query gather at
DIAG_ROWS rows (default 4096).
For example:

    ncu --clock-control none -k 'regex:output_lse_kernel|topk_merge_kernel|topk_select_kernel' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum --csv \
        python3 tools/ncu_calls.py olse topk signal

Run from the repository root with the extension built in place (PYTHONPATH=.).
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import torch_sdcp
from torch_sdcp import ops

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
which = sys.argv[1:] or ["olse", "topk", "signal"]
g = torch.Generator().manual_seed(1)
if "olse" in which:
    olse_rows = [int(r) for r in os.environ.get("OLSE_ROWS", "1,32").split(",")]
    ws = torch_sdcp.OutputLSEWorkspace(None, max(olse_rows), 64, 512, backend="cuda", device=dev)
    for rows in olse_rows:
        po = torch.randn(rows, 64, 512, generator=g).to(torch.bfloat16).to(dev)
        pl = (torch.randn(rows, 64, generator=g) * 3).to(dev)
        seq_lens = torch.where(torch.arange(rows) % 8 == 7, 0, 100 + torch.arange(rows)).to(torch.int32).to(dev)
        qsl = torch.arange(rows + 1, dtype=torch.int32).clamp_max(max(rows - 1, 1)).to(dev)
        for _ in range(5):
            ws.combine(po, pl, return_lse=True)
        torch.cuda.synchronize()
        for _ in range(5):
            ws.combine(po, pl, return_lse=True, seq_lens=seq_lens, query_start_loc=qsl)
        torch.cuda.synchronize()
    ws.close()
if "topk" in which:
    k, rows = 2048, int(os.environ.get("TOPK_ROWS", "1"))
    ws = torch_sdcp.TopKWorkspace(None, max(rows, 4), k, backend="cuda", device=dev)
    scores = torch.randn(rows, k, generator=g).to(dev)
    ids = torch.randperm(rows * k, generator=g).view(rows, k).to(torch.int32).to(dev)
    for _ in range(5):
        ws.merge(scores, ids)
    torch.cuda.synchronize()
    for _ in range(5):
        ops.topk_select(scores, ids, k)
    torch.cuda.synchronize()
    ws.close()
if "signal" in which:
    ws = torch_sdcp.ExchangeWorkspace(None, 64, backend="cuda", device=dev)
    x = torch.zeros(2, device=dev)
    for _ in range(5):
        ws.all_gather(x)
    torch.cuda.synchronize()
    ws.close()
if "query" in which:
    from torch_sdcp.inputs import rope_cache
    rows = int(os.environ.get("DIAG_ROWS", "4096"))
    ws = torch_sdcp.QueryWorkspace(None, rows, 64, dtype=torch.float8_e4m3fn, backend="cuda", device=dev)
    nope = torch.randn(rows, 64, 512, generator=g).to(torch.bfloat16).to(dev)
    pe = torch.randn(rows, 64, 64, generator=g).to(torch.bfloat16).to(dev)
    pos = torch.randint(0, 4096, (rows,), generator=g).to(dev)
    cache = rope_cache(4096, 64).to(dev)
    scale = torch.tensor([0.05], device=dev)
    for _ in range(3):
        ws.gather(nope, pe, pos, cache, scale)
    torch.cuda.synchronize()
    ws.close()
dist.destroy_process_group()
print("calls done:", " ".join(which))
