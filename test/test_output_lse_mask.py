"""Output/LSE boundary, vLLM's empty-shard mask inside the op (seq_lens /
query_start_loc): the reference mask against vLLM's rule written as a loop,
the masked peer combine against the reference mask + reference combine (host
backend at world 2 and 3, CUDA on GPU_WORLD GPUs and 2, 4 and 8 ranks sharing one),
the collective fallback, argument errors, opcheck, torch.compile and CUDA
graphs with the metadata changed in place between replays."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import GPU_WORLD, SHARED_GPU_WORLDS, rank_workspace_args, requires_gpus

from torch_sdcp import ops, reference


def mask_loop(lse, seq_lens, qsl):
    """vLLM's rule, one row at a time: padding rows and rows of requests with a
    local seq_len of 0 get -inf; the request of row t is the number of request
    ends at or before t, clamped to the last request."""
    out = lse.clone()
    r = seq_lens.numel()
    for t in range(lse.shape[0]):
        if r == 0 or t >= int(qsl[-1]):
            out[t] = -math.inf
            continue
        request = min(sum(int(e) <= t for e in qsl[1:]), r - 1)
        if int(seq_lens[request]) == 0:
            out[t] = -math.inf
    return out


def qsl_of(lens, dtype=torch.int32):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(dtype)


# (rows, rows per request): the rows past the requests' end are padding.
MASK_CASES = [
    (4, []),               # no request at all: every row is empty
    (5, [0, 0]),           # every row padding
    (1, [1]),              # one row
    (6, [2, 2, 2]),        # MTP: several rows per request
    (9, [2, 0, 3]),        # a zero-length request in the middle, then padding
    (16, [1, 4, 0, 0, 3]), # two zero-length requests
    (7, [7]),              # one request over every row
]


def test_reference_mask_is_vllms_rule():
    g = torch.Generator().manual_seed(0)
    cases = list(MASK_CASES)
    for _ in range(200):
        r = int(torch.randint(0, 6, (1,), generator=g))
        lens = torch.randint(0, 4, (r,), generator=g).tolist()
        cases.append((sum(lens) + int(torch.randint(0, 4, (1,), generator=g)), lens))
    for rows, lens in cases:
        for dtype in (torch.int32, torch.int64):
            seq_lens = torch.randint(0, 3, (len(lens),), generator=g).to(dtype)
            lse = torch.randn(rows, 3, generator=g)
            got = reference.mask_empty_shards(lse, seq_lens, qsl_of(lens, dtype))
            assert torch.equal(got, mask_loop(lse, seq_lens, qsl_of(lens))), (rows, lens, seq_lens)
    lse = torch.randn(3, 2)
    assert reference.mask_empty_shards(lse, None, None) is lse


def test_reference_mask_rejects_bad_arguments():
    lse = torch.randn(4, 2)
    s, q = torch.ones(2, dtype=torch.int32), qsl_of([1, 1])
    with pytest.raises(ValueError, match="'query_start_loc'.*both or neither"):
        reference.mask_empty_shards(lse, s, None)
    with pytest.raises(ValueError, match="'seq_lens'.*both or neither"):
        reference.mask_empty_shards(lse, None, q)
    with pytest.raises(ValueError, match="'query_start_loc'.*3 entries.*got 2"):
        reference.mask_empty_shards(lse, s, q[:2])
    with pytest.raises(ValueError, match="'seq_lens'.*dtype int32 or int64"):
        reference.mask_empty_shards(lse, s.float(), q)
    with pytest.raises(ValueError, match="'seq_lens'.*1"):
        reference.mask_empty_shards(lse, s.view(1, 2), q)


def masked_reference(rank, world, out, lse, seq_lens, qsl, base2=False):
    """Every rank masks its own LSE with its own seq_lens, then the exact combine."""
    masked = torch.stack([reference.mask_empty_shards(lse[r], seq_lens[r], qsl) for r in range(world)])
    ref_out, ref_lse = reference.lse_combine_ref64(out, masked, base2=base2)
    return reference.output_lse_shard(ref_out, ref_lse, rank, world)


def check_masked(got_out, got_lse, ref_out, ref_lse):
    got_out, got_lse = got_out.cpu().double(), got_lse.cpu().double()
    assert not torch.isnan(got_out).any(), "NaN leaked into the output"
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(ref_lse)), "-inf (empty) rows differ"
    assert torch.equal(got_out[torch.isneginf(got_lse)].abs().sum(), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out, ref_out, rtol=2e-2, atol=2e-2)


def rank_case(world, rows, lens, h, d, seed, nasty, dtype=torch.int32):
    """Every rank's partials, every rank's own seq_lens (a request's shard is
    empty on some ranks and not on others), the shared query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(world, rows, h, d, generator=g).to(torch.bfloat16)
    lse = torch.randn(world, rows, h, generator=g) * 4
    seq_lens = torch.randint(0, 3, (world, len(lens)), generator=g).to(dtype)
    if nasty and rows > 0:
        lse[0, :, 0] = float("nan")  # NaN is an empty shard with or without the mask
        lse[world - 1, :, h - 1] = float("inf")
        out[0, :, 0] = float("nan")
        padded = len(lens) == 0 or sum(lens) < rows
        if not padded and lens[-1] > 0:
            seq_lens[:, -1] = 0  # the last request empty on every rank: its rows must be exactly 0
        if padded or lens[-1] > 0:
            out[:, rows - 1] = float("nan")  # masked on every rank: the payload is never read
    return out, lse, seq_lens, qsl_of(lens, dtype)


def host_cases(max_rows):
    cases = [(rows, lens, False) for rows, lens in MASK_CASES]
    cases += [(rows, lens, True) for rows, lens in MASK_CASES if rows > 1]
    cases.append((max_rows, [3] * (max_rows // 3), True))           # max rows, MTP, padding
    cases.append((max_rows, [1] * max_rows, False))                  # max rows, one row each
    return cases


def _masked_combine_worker(rank, world, mode, max_rows, h=None, d=128):
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    h = h or 4 * world
    done = 0
    with torch_sdcp.OutputLSEWorkspace(None, max_rows, h, d, **args) as ws:
        for i, (rows, lens, nasty) in enumerate(host_cases(max_rows)):
            for dtype in (torch.int32, torch.int64):
                out, lse, seq_lens, qsl = rank_case(world, rows, lens, h, d, seed=10 * i + world, nasty=nasty,
                                                    dtype=dtype)
                base2 = i % 2 == 1
                kw = {"lse_base": "2" if base2 else "e", "seq_lens": seq_lens[rank].to(device),
                      "query_start_loc": qsl.to(device)}
                got, got_lse = ws.combine(out[rank].to(device), lse[rank].to(device), return_lse=True, **kw)
                check_masked(got, got_lse, *masked_reference(rank, world, out, lse, seq_lens, qsl, base2))
                o = torch.full_like(got, float("nan"))
                ol = torch.full_like(got_lse, float("nan"))
                ws.combine_out(out[rank].to(device), lse[rank].to(device), o, ol, **kw)
                assert torch.equal(o, got) and torch.equal(ol, got_lse), "combine_out differs from combine"
                done += 1
        # The unmasked call right after a masked one is unmasked.
        out, lse, _, _ = rank_case(world, 5, [5], h, d, seed=99, nasty=False)
        got, got_lse = ws.combine(out[rank].to(device), lse[rank].to(device), return_lse=True)
        ref_out, ref_lse = reference.output_lse_shard(*reference.lse_combine_ref64(out, lse), rank, world)
        check_masked(got, got_lse, ref_out, ref_lse)
    return done


N_MASKED = 2 * len(host_cases(24))


@pytest.mark.parametrize("world", [2, 3])
def test_masked_peer_combine_host(world):
    assert run_workers(_masked_combine_worker, world, args=("host", 24), timeout=240) == [N_MASKED] * world


def _masked_fallback_worker(rank, world):
    """Rows above max_rows take the collective path, masked the same way."""
    import torch_sdcp

    with torch_sdcp.OutputLSEWorkspace(None, 4, 8, 128, backend="host") as ws:
        out, lse, seq_lens, qsl = rank_case(world, 9, [2, 0, 3], 8, 128, seed=7, nasty=True)
        kw = {"seq_lens": seq_lens[rank], "query_start_loc": qsl}
        got, got_lse = ws.combine(out[rank], lse[rank], return_lse=True, **kw)
        check_masked(got, got_lse, *masked_reference(rank, world, out, lse, seq_lens, qsl))
        o, ol = torch.empty(got.shape, dtype=got.dtype), torch.empty(got_lse.shape)
        ws.combine_out(out[rank], lse[rank], o, ol, **kw)
        assert torch.equal(o, got) and torch.equal(ol, got_lse)
        with pytest.raises(ValueError, match="'query_start_loc'.*both or neither"):
            ws.combine(out[rank], lse[rank], seq_lens=seq_lens[rank])  # refused before either path
    return True


def test_masked_fallback_host():
    assert run_workers(_masked_fallback_worker, 2, timeout=120) == [True, True]


def test_masked_op_rejects_bad_arguments(world1):
    """Each refusal names the argument; bad input inside a call poisons the
    workspace by design (docs/PROTOCOL.md), so every case gets a fresh one."""
    import torch_sdcp

    out, lse = torch.randn(5, 4, 128).to(torch.bfloat16), torch.randn(5, 4)
    s, q = torch.ones(2, dtype=torch.int32), qsl_of([2, 3])
    bad = [((s, None), "'query_start_loc'.*both or neither"), ((None, q), "'seq_lens'.*both or neither"),
           ((s.view(1, 2), q), "'seq_lens'"), ((s, q.view(3, 1)), "'query_start_loc'"),
           ((s, q[:2]), "'query_start_loc'.*3 entries.*got 2"),
           ((s.float(), q), "'seq_lens'.*dtype int32 or int64"),
           ((s, q.to(torch.int16)), "'query_start_loc'.*dtype int32 or int64"),
           ((torch.ones(4, dtype=torch.int32)[::2], q), "'seq_lens'.*contiguous"),
           # the CUDA lookup's 32-bit request indices (expanded: no memory behind them)
           ((torch.ones(1, dtype=torch.int32).expand(2**30), torch.zeros(1, dtype=torch.int32).expand(2**30 + 1)),
            r"'seq_lens'.*fewer than 2\*\*30 requests.*got 1073741824")]
    for (seq_lens, qsl), message in bad:
        with torch_sdcp.OutputLSEWorkspace(world1, 8, 4, 128, backend="host") as ws, \
                pytest.raises(ValueError, match=message):
            torch.ops.sdcp.output_lse_combine(out, lse, ws.handle, False, seq_lens, qsl)
        # the same words from the workspace, before either path
        with torch_sdcp.OutputLSEWorkspace(world1, 8, 4, 128, backend="host") as ws, \
                pytest.raises(ValueError, match=message):
            ws.combine(out, lse, seq_lens=seq_lens, query_start_loc=qsl)
    with torch_sdcp.OutputLSEWorkspace(world1, 8, 4, 128, backend="host") as ws:
        got = ws.combine(out, lse, seq_lens=s, query_start_loc=q)
        assert torch.equal(got, ops.output_lse_combine(out, lse, ws.handle, seq_lens=s, query_start_loc=q)[0])


def test_masked_op_opcheck_and_compile_world1(world1):
    import torch_sdcp

    with torch_sdcp.OutputLSEWorkspace(world1, 8, 4, 128, backend="host") as ws:
        g = torch.Generator().manual_seed(4)
        out, lse = torch.randn(6, 4, 128, generator=g).to(torch.bfloat16), torch.randn(6, 4, generator=g)
        s, q = torch.tensor([3, 0], dtype=torch.int32), qsl_of([2, 2])  # rows 2, 3 empty; 4, 5 padding
        torch.library.opcheck(torch.ops.sdcp.output_lse_combine.default, (out, lse, ws.handle, False, s, q))
        o, ol = torch.empty(6, 4, 128, dtype=out.dtype), torch.empty(6, 4)
        torch.library.opcheck(torch.ops.sdcp.output_lse_combine_out.default,
                              (out, lse, ws.handle, True, o, ol, s, q))
        f = torch.compile(lambda a, b, c, e: ws.combine(a, b, return_lse=True, seq_lens=c, query_start_loc=e),
                          fullgraph=True)
        got, got_lse = f(out, lse, s, q)
        check_masked(got, got_lse, *masked_reference(0, 1, out[None], lse[None], s[None], q))
        assert torch.isneginf(got_lse[2:]).all() and not got[2:].any() and torch.isfinite(got_lse[:2]).all()


# ---------------------------------------------------------------------------
# CUDA (the lead runs these on a GPU machine): the kernel's mask at GPU_WORLD
# GPUs and with two ranks sharing one GPU, and inside a CUDA graph whose
# seq_lens / query_start_loc change in place between replays.
# ---------------------------------------------------------------------------


@requires_gpus(GPU_WORLD)
def test_masked_peer_combine_cuda():
    done = run_workers(_masked_combine_worker, GPU_WORLD, args=("cuda", 128, 8 * GPU_WORLD, 512), timeout=400)
    assert done == [2 * len(host_cases(128))] * GPU_WORLD


@requires_gpus(1)
def test_masked_peer_combine_cuda_two_ranks_on_one_gpu():
    assert run_workers(_masked_combine_worker, 2, args=("cuda_shared", 24), timeout=400) == [N_MASKED] * 2


# Up to 1,100 requests: the row lookup's second round (over 32 requests) and
# third (over 1,024), each with int32 and int64 metadata, on one GPU.
@requires_gpus(1)
def test_masked_peer_combine_cuda_many_requests_two_ranks_on_one_gpu():
    done = run_workers(_masked_combine_worker, 2, args=("cuda_shared", 1100), timeout=400)
    assert done == [2 * len(host_cases(1100))] * 2


def window_cases(rows):
    """(rows per request, [(seq_lens dtype, query_start_loc dtype)]): layouts
    whose lookups run through a warp's kept window of 32 requests (few heads
    and many rows, so each warp walks many rows): one row per request (R =
    rows: three rounds), MTP with a padding tail, zero-length requests
    (repeated ends) over 1,024 requests, and an int64 end past int32 (clamped
    in the kernel's 32-bit compare). Every pair of widths: both int32 is the
    kernel with the widths fixed, the other three read them at run time."""
    random_lens = torch.randint(0, 4, (1500,), generator=torch.Generator().manual_seed(7)).tolist()
    i32, i64 = torch.int32, torch.int64
    pairs = [(i32, i32), (i64, i64), (i64, i32), (i32, i64)]
    return [([1] * rows, pairs), ([3] * (rows // 3 - 5), pairs), (random_lens, pairs),
            ([1] * 100 + [2**40], [(i64, i64), (i32, i64)])]


def _masked_window_worker(rank, world, mode, rows):
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args["device"]
    h, d = 8 * world, 128
    done = 0
    with torch_sdcp.OutputLSEWorkspace(None, rows, h, d, **args) as ws:
        for i, (lens, pairs) in enumerate(window_cases(rows)):
            for seq_dtype, qsl_dtype in pairs:
                out, lse, seq_lens, qsl = rank_case(world, rows, lens, h, d, seed=i, nasty=False, dtype=qsl_dtype)
                seq_lens = seq_lens.to(seq_dtype)
                got, got_lse = ws.combine(out[rank].to(device), lse[rank].to(device), return_lse=True,
                                          seq_lens=seq_lens[rank].to(device), query_start_loc=qsl.to(device))
                check_masked(got, got_lse, *masked_reference(rank, world, out, lse, seq_lens, qsl))
                done += 1
    return done


# A warp's kept lookup window (many rows per warp), every pair of metadata widths, on one GPU.
@requires_gpus(1)
def test_masked_peer_combine_cuda_row_windows_two_ranks_on_one_gpu():
    assert run_workers(_masked_window_worker, 2, args=("cuda_shared", 4096), timeout=400) == [14] * 2


def _masked_graph_worker(rank, world, mode, replays):
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args["device"]
    rows, h, d, requests = 32, 8 * world, 512, 8
    with torch_sdcp.OutputLSEWorkspace(None, 64, h, d, **args) as ws:
        out, lse, seq_lens, qsl = rank_case(world, rows, [4] * requests, h, d, seed=1, nasty=False)
        static = [out[rank].to(device), lse[rank].to(device), seq_lens[rank].to(device), qsl.to(device)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on the capture stream
            ws.combine(static[0], static[1], seq_lens=static[2], query_start_loc=static[3])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = ws.combine(static[0], static[1], return_lse=True, seq_lens=static[2], query_start_loc=static[3])
        for r in range(replays):
            # New rows per request (zero-length ones included), new padding, new empty shards.
            lens = torch.randint(0, 5, (requests,), generator=torch.Generator().manual_seed(r)).tolist()
            out, lse, seq_lens, qsl = rank_case(world, rows, lens, h, d, seed=100 + r, nasty=r % 2 == 1)
            for t, v in zip(static, (out[rank], lse[rank], seq_lens[rank], qsl), strict=False):
                t.copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            check_masked(result[0], result[1], *masked_reference(rank, world, out, lse, seq_lens, qsl))
    return replays


@requires_gpus(GPU_WORLD)
def test_masked_peer_combine_cuda_graph_replay():
    assert run_workers(_masked_graph_worker, GPU_WORLD, args=("cuda", 50), timeout=400) == [50] * GPU_WORLD


@requires_gpus(1)
def test_masked_peer_combine_cuda_graph_two_ranks_on_one_gpu():
    assert run_workers(_masked_graph_worker, 2, args=("cuda_shared", 20), timeout=400) == [20] * 2


# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only): every
# mask case (rows 1 and max_rows, zero-length requests, padding, NaN / +inf LSE),
# then a few replays of the graph with the metadata changed in place.
@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
def test_masked_peer_combine_cuda_shared_gpu(world):
    steps = ((_masked_combine_worker, ("cuda_shared", 24)), (_masked_graph_worker, ("cuda_shared", 4)))
    assert run_workers(in_turn, world, args=steps, timeout=240) == [[N_MASKED, 4]] * world
