"""Query family, the gather: the peer gather of the produced query (host
backend at world sizes 2-4, CUDA on 2 GPUs, two ranks on one GPU), the
gather of a query produced elsewhere (all_gather_heads, with sentinel and
canonical words as real inputs), many calls with random delays, CUDA graphs,
opcheck and torch.compile, and the workspace's size at the target."""

from __future__ import annotations

import pytest
import torch
from _dist import run_workers
from _helpers import GPU_WORLD, devices, make_query, requires_gpus
from _query import (
    CANONICAL_FP8,
    CANONICAL_PAIR,
    GATHER_DTYPES,
    SENTINEL,
    as_bytes,
    expected_gather,
    global_query,
    poisoned_queries,
)

from torch_sdcp import ops, reference
from torch_sdcp.workspaces import WorkspaceKind

# ---------------------------------------------------------------------------
# Peer gather: the inbox equals, byte for byte, producing on every rank and
# all_gathering on heads. Head-order sentinels: each rank's heads are marked.
# ---------------------------------------------------------------------------


def _peer_gather_worker(rank, world, backend, cases, max_rows, shared=False):
    import torch_sdcp

    device = torch.device("cuda", 0 if shared else rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    done = 0
    for h, dtype, style in sorted({(h, d, s) for _, h, d, s, _ in cases}, key=str):
        with torch_sdcp.QueryWorkspace(None, max_rows, h, dtype=dtype, rope_style=style, backend=backend,
                                       device=device, allow_shared_device=shared) as ws:
            for i, (t, hh, dd, ss, scale) in enumerate(cases):
                if (hh, dd, ss) != (h, dtype, style):
                    continue
                inputs = global_query(world, t, h, seed=t + h + i)
                q_scale = None if scale is None else torch.tensor([scale])
                got = ws.gather(*[x.to(device) for x in inputs[rank]],
                                None if q_scale is None else q_scale.to(device)).cpu()
                want = expected_gather(inputs, q_scale, style, dtype)
                assert torch.equal(as_bytes(got), as_bytes(want)), f"rank {rank} case {(t, h, dtype, style)}"
                done += 1
    return done


HOST_CASES = [(1, 8, torch.float8_e4m3fn, "interleaved", 0.02), (17, 16, torch.bfloat16, "neox", None),
              (8, 8, torch.float8_e4m3fn, "neox", None), (64, 8, torch.bfloat16, "interleaved", None)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_peer_gather_host(world):
    assert run_workers(_peer_gather_worker, world, args=("host", HOST_CASES, 64), timeout=240) == \
        [len(HOST_CASES)] * world


GPU_CASES = [(t, h, d, s, sc) for t in (1, 8, 17, 64, 128) for h in (8, 16, 32)
             for d, sc in ((torch.float8_e4m3fn, 0.02), (torch.bfloat16, None)) for s in ("interleaved", "neox")]


@requires_gpus(GPU_WORLD)
def test_peer_gather_cuda():
    assert run_workers(_peer_gather_worker, GPU_WORLD, args=("cuda", GPU_CASES, 128), timeout=400) == \
        [len(GPU_CASES)] * GPU_WORLD


# Two ranks time-slicing one GPU (correctness only): the CUDA peer path of
# the gather and the heads gather on a one-GPU machine.
@requires_gpus(1)
def test_peer_gather_and_heads_cuda_two_ranks_on_one_gpu():
    cases = [(1, 8, torch.float8_e4m3fn, "interleaved", 0.02), (17, 16, torch.bfloat16, "neox", None),
             (64, 32, torch.float8_e4m3fn, "neox", None)]
    assert run_workers(_peer_gather_worker, 2, args=("cuda", cases, 64, True), timeout=300) == [len(cases)] * 2
    rows = [1, 7, 32]
    assert run_workers(_heads_worker, 2, args=("cuda", rows, 32, True), timeout=300) == \
        [len(rows) * len(GATHER_DTYPES)] * 2


def _graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, h = 32, 32
    with torch_sdcp.QueryWorkspace(None, 128, h, device=device) as ws:
        inputs = global_query(world, t, h, seed=0)
        static = [x.to(device) for x in inputs[rank]]
        scale = torch.tensor([0.02], device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            res = ws.gather(*static, scale)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = ws.gather(*static, scale)
        for r in range(replays):
            check = r % 100 == 0 or r == replays - 1
            if check:
                inputs = global_query(world, t, h, seed=r + 1)
                for dst, src in zip(static, inputs[rank], strict=False):
                    dst.copy_(src)
            graph.replay()
            if check:
                want = expected_gather(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)
                assert torch.equal(as_bytes(res.cpu()), as_bytes(want)), f"replay {r}"
        f = torch.compile(ws.gather, fullgraph=True)
        inputs = global_query(world, t, h, seed=77)
        got = f(*[x.to(device) for x in inputs[rank]], scale)
        assert torch.equal(as_bytes(got.cpu()), as_bytes(expected_gather(inputs, scale.cpu(), "interleaved",
                                                                    torch.float8_e4m3fn)))
    return replays


@requires_gpus(GPU_WORLD)
def test_peer_gather_cuda_graph_replay_and_compile():
    assert run_workers(_graph_worker, GPU_WORLD, args=(1000,), timeout=400) == [1000] * GPU_WORLD


def test_peer_gather_opcheck_and_compile_world1(world1):
    import torch_sdcp

    for device in devices():
        with torch_sdcp.QueryWorkspace(world1, 8, 4, nope_dim=64, rope_dim=16, device=torch.device(device),
                                       backend="cuda" if device == "cuda" else "host") as ws:
            ql_nope, q_pe, pos, cache = make_query(3, 4, nope=64, rope=16, max_pos=32, device=device)
            scale = torch.tensor([0.5], device=device)
            torch.library.opcheck(torch.ops.sdcp.query_gather.default,
                                  (ql_nope, q_pe, pos, cache, scale, ws.handle, False, torch.float8_e4m3fn))
            f = torch.compile(ws.gather, fullgraph=True)
            want = reference.query_rope_quant_ref(ql_nope.cpu(), q_pe.cpu(), pos.cpu(), cache.cpu(), scale.cpu(),
                                                  out_dtype=torch.float8_e4m3fn)
            assert torch.equal(as_bytes(f(ql_nope, q_pe, pos, cache, scale).cpu()), as_bytes(want))
            with pytest.raises(ValueError, match="'ql_nope'.*local_heads = 4"):
                ws.gather(ql_nope[:, :2], q_pe[:, :2], pos, cache, scale)


def test_workspace_fits_the_target_at_128_rows():
    # DCP2, 32 local FP8 heads of 576 bytes, 128 rows: the view (128 x 64 x
    # 576 = 4.5 MiB) and two buffers of peer entries only (2 x 128 x 32 x 576
    # = 4.5 MiB), 4 KiB of control and the 64 KiB tail: 9.07 MiB, 10 MiB
    # after rounding to a 2 MiB granularity (the target: 16 MiB).
    # The call headers: [buffer 0, buffer 1, view][peer][16 bytes], 256-byte aligned.
    nbytes = torch.ops.sdcp.workspace_nbytes(int(WorkspaceKind.QUERY), [128, 32, 576, 1], 2)
    assert nbytes == 128 * 64 * 576 + 2 * 128 * 32 * 576 + 256 + 4096 + 64 * 1024
    assert -(-nbytes // 2**21) * 2**21 <= 10 * 2**20 <= 16 * 2**20


def _heads_worker(rank, world, backend, cases, max_rows, shared=False):
    import torch_sdcp

    device = torch.device("cuda", 0 if shared else rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    done = 0
    for dtype in GATHER_DTYPES:
        with torch_sdcp.QueryWorkspace(None, max_rows, 4, nope_dim=576, rope_dim=0, dtype=dtype, backend=backend,
                                       device=device, allow_shared_device=shared) as ws:
            for i, t in enumerate(cases):
                qs = poisoned_queries(world, t, 4, 576, dtype, seed=1000 * i + t)
                want = reference.query_all_gather_heads_ref(qs)
                got = ws.all_gather_heads(qs[rank].to(device)).cpu()
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"rank {rank} {dtype} t={t}"
                # Into caller-owned storage with more heads per row (vLLM's padded query heads).
                size = t * world * 4 * 576
                flat = torch.full((2 * size * want.element_size(),), 3, dtype=torch.uint8, device=device)
                out = flat.view(dtype)[:size].view(t, world * 4, 576)
                assert ws.all_gather_heads(qs[rank].to(device), out=out) is out
                assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))
                assert (flat[size * want.element_size():] == 3).all()
                done += 1
    return done


def test_canonical_words_keep_every_value():
    # Each rewrite keeps NaN NaN in its dtypes, and only the all-ones word is rewritten.
    fp8 = torch.tensor([CANONICAL_FP8], dtype=torch.int32).view(torch.uint8)
    assert torch.isnan(fp8.view(torch.float8_e4m3fn).float()).all()
    assert torch.isnan(fp8.view(torch.float8_e5m2).float()).all()
    pair = torch.tensor([CANONICAL_PAIR], dtype=torch.int32).view(torch.uint8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.isnan(pair.view(dtype).float()).all()
        assert torch.isnan(torch.tensor([SENTINEL], dtype=torch.int32).view(dtype).float()).all()
    qs = poisoned_queries(2, 3, 2, 16, torch.float8_e4m3fn, seed=1)
    got = reference.query_all_gather_heads_ref(qs).view(torch.uint8).view(-1).view(torch.int32)
    raw = torch.cat(qs, dim=1).view(torch.uint8).view(-1).view(torch.int32)
    assert torch.equal(got[raw != SENTINEL], raw[raw != SENTINEL]) and (got[raw == SENTINEL] == CANONICAL_FP8).all()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_heads_sentinel_inputs_host(world):
    cases = [1, 5, 16]
    assert run_workers(_heads_worker, world, args=("host", cases, 16), timeout=240) == \
        [len(cases) * len(GATHER_DTYPES)] * world


@requires_gpus(GPU_WORLD)
def test_all_gather_heads_sentinel_inputs_cuda():
    cases = [1, 7, 32, 128]
    assert run_workers(_heads_worker, GPU_WORLD, args=("cuda", cases, 128), timeout=400) == \
        [len(cases) * len(GATHER_DTYPES)] * GPU_WORLD


def _stress_worker(rank, world, backend, calls, seed):
    """Random calls on one workspace (every rank draws the same sequence):
    all_gather_heads with sentinel words, the producer's gather, and views
    read late, with random per-rank delays; every result against the
    references."""
    import random
    import time

    import torch_sdcp

    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    shared = random.Random(seed)  # the call sequence, identical on every rank
    mine = random.Random(seed * 100 + rank)  # this rank's delays
    h, nope, rope, max_rows = 2, 12, 4, 6
    if backend == "cuda":
        nope = 28  # 32 fp8 bytes: whole 16-byte vectors
    counts = {"heads": 0, "gather": 0, "view": 0}
    scale = torch.tensor([0.05])
    with torch_sdcp.QueryWorkspace(None, max_rows, h, nope_dim=nope, rope_dim=rope, backend=backend,
                                   device=device) as ws:
        for i in range(calls):
            kind = shared.choices(["heads", "gather", "view"], weights=[8, 1, 1])[0]
            t = shared.randint(0, max_rows)
            if mine.random() < 0.05:  # this rank runs late
                if backend == "cuda":
                    torch.cuda._sleep(mine.randint(1_000, 2_000_000))
                else:
                    time.sleep(mine.random() * 1e-3)
            if kind == "heads":
                qs = poisoned_queries(world, t, h, nope + rope, torch.float8_e4m3fn, seed=seed + i)
                got = ws.all_gather_heads(qs[rank].to(device))
                want = reference.query_all_gather_heads_ref(qs)
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"call {i} rank {rank}"
            else:
                inputs = [[x for x in make_query(t, h, nope=nope, rope=rope, max_pos=16, seed=seed + i * 8 + r)]
                          for r in range(world)]
                for q in inputs[1:]:
                    q[2], q[3] = inputs[0][2], inputs[0][3]
                want = expected_gather(inputs, scale, "interleaved", torch.float8_e4m3fn)
                args = [x.to(device) for x in inputs[rank]] + [scale.to(device)]
                if kind == "gather":
                    got = ws.gather(*args).cpu()
                else:
                    view = ws.gather_view(*args)
                    if mine.random() < 0.2:  # the reader runs late: no peer may overwrite the view meanwhile
                        if backend == "cuda":
                            torch.cuda._sleep(mine.randint(1_000, 2_000_000))
                        else:
                            time.sleep(mine.random() * 1e-3)
                    got = view.clone().cpu()  # read while the view is open: release() re-fills it
                    ws.release()
                assert torch.equal(as_bytes(got), as_bytes(want)), f"call {i} ({kind}, {t} rows) rank {rank}"
            counts[kind] += 1
    return counts


def test_many_calls_random_delays_host():
    results = run_workers(_stress_worker, 2, args=("host", 10_000, 7), timeout=600)
    assert results[0] == results[1] and sum(results[0].values()) == 10_000 and min(results[0].values()) > 500


def test_many_calls_random_delays_host_world3():
    results = run_workers(_stress_worker, 3, args=("host", 1_500, 8), timeout=300)
    assert all(r == results[0] for r in results) and sum(results[0].values()) == 1_500


@requires_gpus(GPU_WORLD)
def test_many_calls_random_delays_cuda():
    results = run_workers(_stress_worker, GPU_WORLD, args=("cuda", 3_000, 9), timeout=600)
    assert all(r == results[0] for r in results) and sum(results[0].values()) == 3_000


def test_all_gather_heads_opcheck_compile_and_misuse_world1(world1):
    import torch_sdcp

    for device in devices():
        with torch_sdcp.QueryWorkspace(world1, 8, 4, nope_dim=64, rope_dim=0, dtype=torch.bfloat16,
                                       device=torch.device(device),
                                       backend="cuda" if device == "cuda" else "host") as ws:
            (q,) = poisoned_queries(1, 3, 4, 64, torch.bfloat16, seed=2)
            q = q.to(device)
            out = torch.empty(3, 4, 64, dtype=torch.bfloat16, device=device)
            clean = torch.randn(3, 4, 64).to(torch.bfloat16).to(device)  # opcheck compares with NaN != NaN
            torch.library.opcheck(torch.ops.sdcp.query_all_gather_heads.default, (clean, ws.handle))
            torch.library.opcheck(torch.ops.sdcp.query_all_gather_heads_out.default, (clean, ws.handle, out))
            want = reference.query_all_gather_heads_ref([q.cpu()])
            f = torch.compile(ws.all_gather_heads, fullgraph=True)
            assert torch.equal(f(q).cpu().view(torch.int16), want.view(torch.int16))
            assert torch.equal(ops.query_all_gather_heads(q[:0], ws.handle).cpu(), want[:0])  # 0 rows: a call
            with pytest.raises(ValueError, match="'q'.*NaN of all-ones bytes"):  # the op alone: nothing poisons
                ops.query_all_gather_heads(q.view(torch.int16), ws.handle)
            # Above max_rows: the collective path, same result.
            (big,) = poisoned_queries(1, 9, 4, 64, torch.bfloat16, seed=3)
            assert torch.equal(ws.all_gather_heads(big.to(device)).cpu().view(torch.int16), big.view(torch.int16))
        # An argument error found before this rank published anything, by the
        # Python checks or by the op, is a void call, which leaves the
        # workspace usable; one without a tensor that tells the rows has no
        # placeholder and poisons the workspace.
        for bad, match, void in ((lambda ws: ws.all_gather_heads(q.half()), "'q'.*dtype torch.bfloat16", True),
                                 (lambda ws: ws.all_gather_heads(q[:, :2]), "'q'.*size 4 at dim 1", True),
                                 (lambda ws: ws.all_gather_heads(q, out=out[:2]), "'out'.*shape", True),
                                 (lambda ws: ws.all_gather_heads(q.tolist()), "'q'.*a Tensor", False)):
            with torch_sdcp.QueryWorkspace(world1, 8, 4, nope_dim=64, rope_dim=0, dtype=torch.bfloat16,
                                           device=torch.device(device),
                                           backend="cuda" if device == "cuda" else "host") as ws:
                with pytest.raises(ValueError, match=match):
                    bad(ws)
                assert ws.poisoned != void
                if void:
                    assert torch.equal(ws.all_gather_heads(q).cpu().view(torch.int16), want.view(torch.int16))
                    continue
                with pytest.raises(RuntimeError, match="is poisoned"):
                    ws.all_gather_heads(q)
    with pytest.raises(ValueError, match="'dtype'"):
        torch_sdcp.QueryWorkspace(world1, 8, 4, dtype=torch.uint8, backend="host")
    with pytest.raises(ValueError, match="'rope_dim'.*even"):
        torch_sdcp.QueryWorkspace(world1, 8, 4, rope_dim=3, backend="host")
    with pytest.raises(ValueError, match="'head_dim'.*multiple of 4 bytes"):
        torch_sdcp.QueryWorkspace(world1, 8, 4, nope_dim=6, rope_dim=0, backend="host")
