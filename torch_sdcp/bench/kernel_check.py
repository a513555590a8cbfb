"""One-rank check of the peer kernels on CUDA against the references, short
enough to run under compute-sanitizer (memcheck):

    compute-sanitizer --tool memcheck python -m torch_sdcp.bench.kernel_check [exchange output_lse query topk]

A one-rank group (no peer) runs every call's own stores, headers and call
index, so it covers what a kernel does with its own data: the exchange
(whole words, a byte tail, an input off a word boundary), the Output/LSE
combine with and without vLLM's mask (more than 32, 1024 and 32,768
requests, so the row lookup takes its later rounds; int32 and int64
metadata, the kernel's two widths), the query gather
(interleaved and NeoX, fp8 and bf16) and its zero-copy view, and the top-K
merge. Prints one line per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

# "host" (SDCP_CHECK_BACKEND=host, on the CPU) checks this script itself where there is no GPU.
BACKEND = os.environ.get("SDCP_CHECK_BACKEND", "cuda")


def check_output_lse(dev: torch.device) -> None:
    import torch_sdcp
    from torch_sdcp import reference, semantics

    h, d = 16, 512
    ws = torch_sdcp.OutputLSEWorkspace(None, 2100, h, d, backend=BACKEND, device=dev)
    try:
        cases = ((1, 1), (7, 3), (33, 33), (64, 40), (300, 250), (2100, 2050), (64, 40000))
        for i, (rows, requests) in enumerate(cases):
            index_dtype = torch.int64 if i % 2 else torch.int32  # both of the kernel's metadata widths
            g = torch.Generator().manual_seed(rows)
            po = torch.randn(rows, h, d, generator=g).to(torch.bfloat16)
            pl = torch.randn(rows, h, generator=g) * 3
            got, got_lse = ws.combine(po.to(dev), pl.to(dev), return_lse=True)
            ref, ref_lse = reference.lse_combine_ref64(po[None], pl[None])
            torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)
            # One request per row or several, some shards empty, the tail padding.
            ends = torch.sort(torch.randint(0, rows + 1, (requests - 1,), generator=g)).values
            qsl = torch.cat([torch.zeros(1, dtype=torch.long), ends, torch.tensor([max(rows - 1, 0)])])
            qsl = torch.cummax(qsl, 0).values.to(index_dtype)
            seq_lens = torch.randint(0, 3, (requests,), generator=g).to(index_dtype)
            got, got_lse = ws.combine(po.to(dev), pl.to(dev), return_lse=True, seq_lens=seq_lens.to(dev),
                                      query_start_loc=qsl.to(dev))
            masked = semantics.mask_empty_shards(pl, seq_lens, qsl)
            ref, ref_lse = reference.lse_combine_ref64(po[None], masked[None])
            got, got_lse = got.cpu().double(), got_lse.cpu().double()
            assert torch.equal(torch.isneginf(got_lse), torch.isneginf(ref_lse)), f"empty rows differ at {rows}"
            assert torch.equal(got[torch.isneginf(got_lse)].abs().sum(), torch.tensor(0.0, dtype=torch.float64))
            torch.testing.assert_close(got_lse, ref_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
            print(f"output_lse rows {rows} requests {requests} {index_dtype}: ok", flush=True)
    finally:
        ws.close()


def check_query(dev: torch.device) -> None:
    import torch_sdcp
    from torch_sdcp import reference
    from torch_sdcp.inputs import rope_cache

    hl = 8
    cache = rope_cache(4096, 64).to(dev)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for style in ("interleaved", "neox"):
            ws = torch_sdcp.QueryWorkspace(None, 300, hl, dtype=dtype, rope_style=style, backend=BACKEND,
                                           device=dev)
            try:
                for rows in (1, 5, 300):
                    g = torch.Generator().manual_seed(rows)
                    nope = torch.randn(rows, hl, 512, generator=g).to(torch.bfloat16)
                    pe = torch.randn(rows, hl, 64, generator=g).to(torch.bfloat16)
                    pos = torch.randint(0, 4096, (rows,), generator=g)
                    scale = torch.tensor([0.05]) if dtype == torch.float8_e4m3fn else None
                    args = (nope.to(dev), pe.to(dev), pos.to(dev), cache, None if scale is None else scale.to(dev))
                    want = reference.query_rope_quant_ref(nope, pe, pos, cache.cpu(), scale,
                                                          neox=style == "neox", out_dtype=dtype)
                    got = ws.gather(*args)
                    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), \
                        f"query gather {dtype} {style} rows {rows}"
                    view = ws.gather_view(*args)
                    same = torch.equal(view.cpu().view(torch.uint8), want.view(torch.uint8))
                    ws.release()
                    assert same, f"query view {dtype} {style} rows {rows}"
                    print(f"query {str(dtype)[6:]} {style} rows {rows}: ok", flush=True)
            finally:
                ws.close()


def check_topk(dev: torch.device) -> None:
    import torch_sdcp
    from torch_sdcp import reference

    k = 2048
    # 200 rows: more than an H100's or H200's SMs, so a block loops over rows.
    ws = torch_sdcp.TopKWorkspace(None, 200, k, candidates_per_rank=k, backend=BACKEND, device=dev)
    try:
        for rows in (1, 40, 200):
            g = torch.Generator().manual_seed(rows)
            scores = torch.randn(rows, k, generator=g)
            ids = torch.randperm(rows * k, generator=g).view(rows, k).to(torch.int32)
            got = ws.merge(scores.to(dev), ids.to(dev)).cpu()
            want = reference.topk_merge_ref([(scores, ids)], k)
            assert torch.equal(torch.sort(got, -1).values, torch.sort(want, -1).values), f"top-K rows {rows}"
            print(f"topk rows {rows}: ok", flush=True)
    finally:
        ws.close()


def check_exchange(dev: torch.device) -> None:
    import torch_sdcp

    ws = torch_sdcp.ExchangeWorkspace(None, 4096, backend=BACKEND, device=dev)
    try:
        g = torch.Generator().manual_seed(3)
        raw = torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8)
        # Whole words, a tail of 1 to 3 bytes, the largest call, and an input
        # that starts off a word (byte-wise loads and stores).
        for name, x in (("8 bytes", raw[:8]), ("7 bytes", raw[:7]), ("4096 bytes", raw[:4096]),
                        ("13 bytes off a word", raw[1:14])):
            got = ws.all_gather(x.to(dev)).cpu()
            assert torch.equal(got, x[None]), f"exchange {name}"
            print(f"exchange {name}: ok", flush=True)
    finally:
        ws.close()


CHECKS = {"exchange": check_exchange, "output_lse": check_output_lse, "query": check_query, "topk": check_topk}


def main() -> int:
    import torch_sdcp  # noqa: F401

    which = sys.argv[1:] or list(CHECKS)
    unknown = [name for name in which if name not in CHECKS]
    if unknown:
        print(f"kernel_check: argument 'checks': expected names among {', '.join(CHECKS)}, got {unknown}",
              file=sys.stderr)
        return 2

    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[key] = value
    dev = torch.device("cuda", 0) if BACKEND == "cuda" else torch.device("cpu")
    if BACKEND == "cuda":
        torch.cuda.set_device(dev)
    with tempfile.TemporaryDirectory(prefix="sdcp-check-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            for name in which:
                CHECKS[name](dev)
            if BACKEND == "cuda":
                torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
    print("kernel_check: all ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
