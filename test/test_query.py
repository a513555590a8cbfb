"""Query boundary: the fused RoPE/FP8 producer, the peer gather (host backend
at world sizes 1-4, CUDA on 2 GPUs, and 2, 4 and 8 ranks sharing one GPU),
opcheck, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from torch_sdcp import ops, reference
from torch_sdcp.workspaces import WorkspaceKind

from _dist import in_turn, run_workers
from _helpers import GPU_WORLD, SHARED_GPU_WORLDS, devices, make_query, rank_workspace_args, requires_gpus


def as_bytes(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.view(torch.int16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
@pytest.mark.parametrize("out_dtype,scale", [(torch.bfloat16, None), (torch.float8_e4m3fn, None),
                                             (torch.float8_e4m3fn, 0.01)])
@pytest.mark.parametrize("t,h", [(1, 8), (17, 16), (64, 32)])
def test_local_producer_bit_exact(device, rope_style, out_dtype, scale, t, h):
    ql_nope, q_pe, pos, cache = make_query(t, h, seed=t + h, device=device)
    q_scale = None if scale is None else torch.tensor([scale], device=device)
    got = ops.query_rope_quant(ql_nope, q_pe, pos, cache, q_scale, rope_style=rope_style, out_dtype=out_dtype)
    want = reference.query_rope_quant_ref(ql_nope.cpu(), q_pe.cpu(), pos.cpu(), cache.cpu(),
                                          None if q_scale is None else q_scale.cpu(),
                                          neox=rope_style == "neox", out_dtype=out_dtype)
    assert torch.equal(as_bytes(got.cpu()), as_bytes(want))
    if scale is not None:  # the scale saturates some values
        assert (got.float().abs() == 448).any()


@pytest.mark.parametrize("device", devices())
def test_local_producer_rejects_bad_input(device):
    ql_nope, q_pe, pos, cache = make_query(4, 8, device=device)
    with pytest.raises(ValueError, match="'q_pe'.*dtype"):
        ops.query_rope_quant(ql_nope, q_pe.float(), pos, cache)
    with pytest.raises(ValueError, match="'positions'.*size 4"):
        ops.query_rope_quant(ql_nope, q_pe, pos[:3], cache)
    with pytest.raises(ValueError, match="'q_scale'.*None for a bfloat16"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="'rope_style'"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache, rope_style="gptj")
    with pytest.raises(ValueError, match="'ql_nope'.*unit stride"):
        ops.query_rope_quant(ql_nope.transpose(1, 2).contiguous().transpose(1, 2), q_pe, pos, cache)


def test_local_producer_rejects_positions_out_of_range():
    ql_nope, q_pe, pos, cache = make_query(4, 8)
    pos[2] = cache.shape[0]
    with pytest.raises(ValueError, match="'positions'.*at row 2"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache)


@pytest.mark.parametrize("device", devices())
def test_local_producer_opcheck(device):
    for t, h, dtype, scale in [(1, 2, torch.bfloat16, None), (3, 4, torch.float8_e4m3fn, 0.5)]:
        ql_nope, q_pe, pos, cache = make_query(t, h, nope=64, rope=16, max_pos=32, device=device)
        s = None if scale is None else torch.tensor([scale], device=device)
        torch.library.opcheck(torch.ops.sdcp.query_rope_quant.default, (ql_nope, q_pe, pos, cache, s, False, dtype))


def test_local_producer_compiles_fullgraph():
    ql_nope, q_pe, pos, cache = make_query(4, 8)
    scale = torch.tensor([0.1])
    f = torch.compile(lambda *a: ops.query_rope_quant(*a, rope_style="neox", out_dtype=torch.float8_e4m3fn),
                      fullgraph=True)
    want = ops.query_rope_quant(ql_nope, q_pe, pos, cache, scale, rope_style="neox", out_dtype=torch.float8_e4m3fn)
    assert torch.equal(as_bytes(f(ql_nope, q_pe, pos, cache, scale)), as_bytes(want))


# ---------------------------------------------------------------------------
# Peer gather: the inbox equals, byte for byte, producing on every rank and
# all_gathering on heads. Head-order sentinels: each rank's heads are marked.
# ---------------------------------------------------------------------------


def _global_query(world, t, h, seed):
    per_rank = [make_query(t, h, seed=seed * 10 + r) for r in range(world)]
    pos, cache = per_rank[0][2], per_rank[0][3]  # positions and cache are shared by the group
    for r, q in enumerate(per_rank):
        q[0][:, :, 0] = float(r * h) + torch.arange(h, dtype=torch.float32)  # sentinel: the global head index
    return [(q[0], q[1], pos, cache) for q in per_rank]


def _expected(inputs, scale, rope_style, dtype):
    return torch.cat([reference.query_rope_quant_ref(*x, scale, neox=rope_style == "neox", out_dtype=dtype)
                      for x in inputs], dim=1)


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
                inputs = _global_query(world, t, h, seed=t + h + i)
                q_scale = None if scale is None else torch.tensor([scale])
                got = ws.gather(*[x.to(device) for x in inputs[rank]],
                                None if q_scale is None else q_scale.to(device)).cpu()
                want = _expected(inputs, q_scale, style, dtype)
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


# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only): the
# fused producer's gather (rows 1 and max_rows, both dtypes and RoPE styles),
# all_gather_heads with sentinel words and NaNs in every dtype, the view read
# late, NaN queries through the producer, gather and view.
SHARED_GPU_WORLD_CASES = [(1, 8, torch.float8_e4m3fn, "interleaved", 0.02), (17, 16, torch.bfloat16, "neox", None),
                          (32, 8, torch.float8_e4m3fn, "neox", None)]


@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
def test_peer_gather_heads_and_view_cuda_shared_gpu(world):
    rows = [1, 32]
    steps = ((_peer_gather_worker, ("cuda", SHARED_GPU_WORLD_CASES, 32, True)),
             (_heads_worker, ("cuda", rows, 32, True)), (_view_worker, ("cuda_shared", 6, world - 1)),
             (_nan_producer_worker, ("cuda_shared",)))
    assert run_workers(in_turn, world, args=steps, timeout=240) == \
        [[len(SHARED_GPU_WORLD_CASES), len(rows) * len(GATHER_DTYPES), 6, True]] * world


def _graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, h = 32, 32
    with torch_sdcp.QueryWorkspace(None, 128, h, device=device) as ws:
        inputs = _global_query(world, t, h, seed=0)
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
                inputs = _global_query(world, t, h, seed=r + 1)
                for dst, src in zip(static, inputs[rank]):
                    dst.copy_(src)
            graph.replay()
            if check:
                want = _expected(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)
                assert torch.equal(as_bytes(res.cpu()), as_bytes(want)), f"replay {r}"
        f = torch.compile(ws.gather, fullgraph=True)
        inputs = _global_query(world, t, h, seed=77)
        got = f(*[x.to(device) for x in inputs[rank]], scale)
        assert torch.equal(as_bytes(got.cpu()), as_bytes(_expected(inputs, scale.cpu(), "interleaved",
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


# ---------------------------------------------------------------------------
# Zero-copy view: the inbox is read in place until release(); a late reader
# never sees the next call's query, a missing release is reported.
# ---------------------------------------------------------------------------


def _view_worker(rank, world, mode, rounds, late_rank):
    import time

    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    t, h = 9, 8
    with torch_sdcp.QueryWorkspace(None, 16, h, dtype=torch.float8_e4m3fn, **args) as ws:
        scale = torch.tensor([0.02])
        for i in range(rounds):
            inputs = _global_query(world, t, h, seed=100 + i)
            want = _expected(inputs, scale, "interleaved", torch.float8_e4m3fn)
            view = ws.gather_view(*[x.to(device) for x in inputs[rank]], scale.to(device))
            assert view.shape == (t, world * h, 576) and view.dtype == torch.float8_e4m3fn
            if rank == late_rank:  # reads after other work: the others must not overwrite the inbox meanwhile
                if mode != "host":
                    torch.cuda._sleep(50_000_000)
                else:
                    time.sleep(0.05)
            assert torch.equal(as_bytes(view.cpu()), as_bytes(want)), f"rank {rank} round {i}"
            ws.release()
            if i % 3 == 2:  # the functional form interleaves with views
                got = ws.gather(*[x.to(device) for x in inputs[rank]], scale.to(device))
                assert torch.equal(as_bytes(got.cpu()), as_bytes(want))
    return rounds


@pytest.mark.parametrize("world", [2, 3])
def test_view_late_reader_host(world):
    assert run_workers(_view_worker, world, args=("host", 12, world - 1), timeout=240) == [12] * world


@requires_gpus(GPU_WORLD)
def test_view_late_reader_cuda():
    assert run_workers(_view_worker, GPU_WORLD, args=("cuda", 50, 0), timeout=400) == [50] * GPU_WORLD


def _missing_release_worker(rank, world):
    import time

    import torch.distributed as dist

    import torch_sdcp

    dist.barrier()  # creation is bounded by timeout_s too: start it together

    h = 4
    with torch_sdcp.QueryWorkspace(None, 4, h, nope_dim=64, rope_dim=16, backend="host", timeout_s=1.0) as ws:
        q = make_query(2, h, nope=64, rope=16, max_pos=8, seed=rank)
        ws.gather_view(*q, torch.ones(1))
        if rank == 0:  # never releases: rank 1's next call waits for it and reports it
            time.sleep(3.0)
            return "held"
        ws.release()
        with pytest.raises(RuntimeError, match="timeout: rank 1 .* for peer 0 to release the previous view call "
                                               r"\(query workspace \d+, view buffer, view call 1\)"):
            ws.gather_view(*q, torch.ones(1))
        return "reported"


def test_view_missing_release_is_reported_host():
    assert run_workers(_missing_release_worker, 2, timeout=120) == ["held", "reported"]


def test_view_misuse_is_an_error(world1):
    import torch_sdcp

    with torch_sdcp.QueryWorkspace(world1, 8, 4, nope_dim=64, rope_dim=16, backend="host") as ws:
        q = make_query(3, 4, nope=64, rope=16, max_pos=32)
        scale = torch.ones(1)
        with pytest.raises(RuntimeError, match="no view is open"):
            ws.release()
        view = ws.gather_view(*q, scale)
        with pytest.raises(RuntimeError, match="still open"):
            ws.gather_view(*q, scale)
        with pytest.raises(RuntimeError, match="still open"):
            ws.gather(*q, scale)
        with pytest.raises(ValueError, match="'inbox'.*gather_view"):
            ops.query_release(view.clone(), ws.handle)
        ws.release()
        with pytest.raises(RuntimeError, match="no view is open"):
            ws.release()
        want = reference.query_rope_quant_ref(*q, scale, out_dtype=torch.float8_e4m3fn)
        assert torch.equal(as_bytes(ws.gather_view(*q, scale)), as_bytes(want))
        ws.release()
        with pytest.raises(RuntimeError, match="not traceable"):
            torch.compile(ws.gather_view, fullgraph=True)(*q, scale)
        # Above max_rows: the collective path, still paired with release().
        big = make_query(9, 4, nope=64, rope=16, max_pos=32)
        assert torch.equal(as_bytes(ws.gather_view(*big, scale)),
                           as_bytes(reference.query_rope_quant_ref(*big, scale, out_dtype=torch.float8_e4m3fn)))
        ws.release()


def test_workspace_fits_the_target_at_128_rows():
    # DCP2, 32 local FP8 heads of 576 bytes, 128 rows: the view (128 x 64 x
    # 576 = 4.5 MiB) and two buffers of peer entries only (2 x 128 x 32 x 576
    # = 4.5 MiB), 4 KiB of control and the 64 KiB tail: 9.07 MiB, 10 MiB
    # after rounding to a 2 MiB granularity (the target: 16 MiB).
    # The call headers: [buffer 0, buffer 1, view][peer][16 bytes], 256-byte aligned.
    nbytes = torch.ops.sdcp.workspace_nbytes(int(WorkspaceKind.QUERY), [128, 32, 576, 1], 2)
    assert nbytes == 128 * 64 * 576 + 2 * 128 * 32 * 576 + 256 + 4096 + 64 * 1024
    assert -(-nbytes // 2**21) * 2**21 <= 10 * 2**20 <= 16 * 2**20


def _view_graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, h = 32, 32
    with torch_sdcp.QueryWorkspace(None, 128, h, device=device) as ws:
        inputs = _global_query(world, t, h, seed=0)
        static = [x.to(device) for x in inputs[rank]]
        scale = torch.tensor([0.02], device=device)
        copy = torch.empty(t, world * h, 576, dtype=torch.float8_e4m3fn, device=device)

        def step():  # the reader (here a copy) runs after the producer, then releases
            view = ws.gather_view(*static, scale)
            copy.copy_(view)
            ws.release()

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for r in range(replays):
            check = r % 100 == 0 or r == replays - 1
            if check:
                inputs = _global_query(world, t, h, seed=r + 1)
                for dst, src in zip(static, inputs[rank]):
                    dst.copy_(src)
            graph.replay()
            if check:
                want = _expected(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)
                assert torch.equal(as_bytes(copy.cpu()), as_bytes(want)), f"replay {r}"
    return replays


@requires_gpus(GPU_WORLD)
def test_view_cuda_graph_replay():
    assert run_workers(_view_graph_worker, GPU_WORLD, args=(1000,), timeout=400) == [1000] * GPU_WORLD


# ---------------------------------------------------------------------------
# Data-as-flag (docs/PROTOCOL.md, version 4): sentinel patterns as real
# inputs, a rank that stops mid-stream, and many calls with random delays.
# ---------------------------------------------------------------------------

GATHER_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]
SENTINEL, CANONICAL_FP8, CANONICAL_PAIR = -1, 0x7F7F7F7F, 0x7FC07FC0  # 32-bit words (csrc/dataflag.h)


def _poisoned_queries(world, t, h, w, dtype, seed):
    """Per-rank q [t, h, w] of `dtype` with sentinel words (all-ones bytes),
    the canonical words themselves, lone 0xFF bytes and NaNs of every kind
    among random values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        q = (torch.randn(t, h, w, generator=g) * 4).to(dtype)
        words = q.view(torch.uint8).view(-1).view(torch.int32)
        u = torch.rand(words.shape, generator=g)
        words[u < 0.15] = SENTINEL
        words[(u >= 0.15) & (u < 0.2)] = CANONICAL_FP8
        words[(u >= 0.2) & (u < 0.25)] = CANONICAL_PAIR
        b = q.view(torch.uint8).view(-1)
        b[torch.rand(b.shape, generator=g) < 0.05] = 0xFF  # lone all-ones bytes: NaN, kept as they are
        out.append(q)
    return out


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
                qs = _poisoned_queries(world, t, 4, 576, dtype, seed=1000 * i + t)
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
    qs = _poisoned_queries(2, 3, 2, 16, torch.float8_e4m3fn, seed=1)
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


def _nan_producer_worker(rank, world, mode):
    # NaN inputs: the producer writes its canonical NaNs (float8 0x7F, bf16
    # 0x7FC0), the rewrites themselves; gather and view keep them exact.
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    for dtype, scale in ((torch.float8_e4m3fn, torch.tensor([0.02])), (torch.bfloat16, None)):
        with torch_sdcp.QueryWorkspace(None, 8, 4, dtype=dtype, **args) as ws:
            inputs = _global_query(world, 6, 4, seed=3)
            for q in inputs:
                q[0][1] = float("nan")
                q[0][3, :, 100:200] = float("nan")
                q[1][4] = float("nan")
                # Negative bf16 NaNs (0xFFC0, set as bits: a float NaN assigned to bf16 loses its sign),
                # whole float8 output words of them: the sentinel, were their sign kept.
                q[0].view(torch.int16)[2, :, 8:40] = -64
            # The local producer of this backend (the CPU and CUDA producers, and
            # the reference, may encode a bf16 NaN differently; the gather keeps the
            # producer's bytes).
            sc = None if scale is None else scale.to(device)
            want = torch.cat([ops.query_rope_quant(*[t.to(device) for t in x], sc, out_dtype=dtype).cpu()
                              for x in inputs], dim=1)
            if dtype == torch.float8_e4m3fn:  # every float8 NaN is 0x7F, as the reference says
                assert torch.equal(as_bytes(want), as_bytes(_expected(inputs, scale, "interleaved", dtype)))
                assert (as_bytes(want)[2, :4, 8:40] == 0x7F).all()  # row 2 of rank 0's heads
            mine = [x.to(device) for x in inputs[rank]]
            assert torch.equal(as_bytes(ws.gather(*mine, sc).cpu()), as_bytes(want))
            assert torch.equal(as_bytes(ws.gather_view(*mine, sc).cpu()), as_bytes(want))
            ws.release()
    return True


def test_nan_queries_host():
    assert run_workers(_nan_producer_worker, 2, args=("host",), timeout=120) == [True, True]


@requires_gpus(GPU_WORLD)
def test_nan_queries_cuda():
    assert run_workers(_nan_producer_worker, GPU_WORLD, args=("cuda",), timeout=300) == [True] * GPU_WORLD


def _stop_worker(rank, world, mode, stop_after):
    import time

    import torch.distributed as dist

    import torch_sdcp

    dist.barrier()  # creation is bounded by timeout_s too: start it together
    timeout = 1.0
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=12, rope_dim=4, backend="host", timeout_s=timeout) as ws:
        scale = torch.tensor([0.5])
        for i in range(stop_after + 1):
            if rank == world - 1 and i == stop_after:
                time.sleep(3 * timeout)  # stops mid-stream: every peer's next call names this rank
                return "stopped"
            q = make_query(3, 2, nope=12, rope=4, max_pos=8, seed=10 * i + rank)
            start = time.monotonic()
            try:
                if mode == "gather":
                    ws.gather(*q, scale)
                elif mode == "heads":
                    ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))
                else:
                    ws.gather_view(*q, scale)
                    ws.release()
            except RuntimeError as e:
                assert i == stop_after, f"call {i}: {e}"
                assert time.monotonic() - start < timeout + 1.0
                return str(e)
    raise AssertionError(f"rank {rank}: the call after the peer stopped returned")


@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_rank_that_stops_is_named_host(mode):
    world, stop_after = 3, 4
    results = run_workers(_stop_worker, world, args=(mode, stop_after), timeout=120)
    assert results[-1] == "stopped"
    for rank, msg in enumerate(results[:-1]):
        # Its own timeout, or another waiting rank's timeout relayed by the abort word.
        own = f"timeout: rank {rank} waited 1 s for peer {world - 1}" in msg
        relayed = "aborted: it timed out" in msg and f"rank {rank} waited for peer {world - 1}" in msg
        assert own or relayed, msg
        # The call header of the call it never made (or, relayed, a peer's data wait).
        assert "'s call header (query workspace" in msg or "'s data (query workspace" in msg, msg
        if mode == "view":
            assert f"view buffer, view call {stop_after}" in msg, msg
        else:  # the copying calls
            assert f"buffer {stop_after % 2}, call {stop_after})" in msg, msg


def _stop_cuda_worker(rank, world):
    import ctypes
    import os
    import time

    import torch.distributed as dist

    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.barrier()
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=56, rope_dim=8, backend="cuda", device=device,
                                   timeout_s=2.0) as ws:
        q = [x.to(device) for x in make_query(3, 2, nope=56, rope=8, max_pos=8, seed=rank)]
        ws.gather(*q)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == world - 1:
            time.sleep(6.0)
            return "stopped"
        start = time.monotonic()
        try:
            # The kernel records the timeout and returns (no trap); the host
            # raises at the next check or call.
            ws.gather(*q)
            torch.cuda.synchronize()
            ws.check()
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            ctypes.CDLL(None).fflush(None)  # the kernel's printf went to C stdout, this rank's log
            log = open(os.readlink("/proc/self/fd/1")).read()
            assert f"timeout: rank {rank} block" in log, log[-2000:]
            # Whichever wait ran out first: the peer's call header or its data.
            assert f"for peer {world - 1}'s data" in log or f"for peer {world - 1}'s call header" in log, log[-2000:]
            assert "buffer 1, call 1)" in log, log[-2000:]
            assert "poisoned" in str(e), str(e)
            assert elapsed < 5.0, elapsed
            torch.ones(4, device=device).sum().item()  # the context survived the timeout
            os._exit(0)  # the peer is gone: no teardown
        raise AssertionError("the call after the peer stopped returned and check() passed")


@requires_gpus(GPU_WORLD)
def test_rank_that_stops_is_named_cuda():
    results = run_workers(_stop_cuda_worker, GPU_WORLD, timeout=120, may_die=tuple(range(GPU_WORLD - 1)))
    assert results[-1] == "stopped"


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
                qs = _poisoned_queries(world, t, h, nope + rope, torch.float8_e4m3fn, seed=seed + i)
                got = ws.all_gather_heads(qs[rank].to(device))
                want = reference.query_all_gather_heads_ref(qs)
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"call {i} rank {rank}"
            else:
                inputs = [[x for x in make_query(t, h, nope=nope, rope=rope, max_pos=16, seed=seed + i * 8 + r)]
                          for r in range(world)]
                for q in inputs[1:]:
                    q[2], q[3] = inputs[0][2], inputs[0][3]
                want = _expected(inputs, scale, "interleaved", torch.float8_e4m3fn)
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
            (q,) = _poisoned_queries(1, 3, 4, 64, torch.bfloat16, seed=2)
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
            (big,) = _poisoned_queries(1, 9, 4, 64, torch.bfloat16, seed=3)
            assert torch.equal(ws.all_gather_heads(big.to(device)).cpu().view(torch.int16), big.view(torch.int16))
        # An argument error found by the op poisons the workspace (a peer may
        # already wait in the call); one found by the Python checks before the
        # op is a void call, which leaves the workspace usable.
        for bad, match, void in ((lambda ws: ws.all_gather_heads(q.half()), "'q'.*dtype torch.bfloat16", True),
                                 (lambda ws: ws.all_gather_heads(q[:, :2]), "'q'.*size 4 at dim 1", False),
                                 (lambda ws: ws.all_gather_heads(q, out=out[:2]), "'out'.*shape", False)):
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


# ---------------------------------------------------------------------------
# Per-call agreement, poisoning and aborts: every query call carries a call
# header (rows, dtype, op, geometry); a mismatch raises on every rank naming
# both sides, an error inside a call poisons the workspace and aborts the
# peers. On CUDA the kernels record and return: the host raises at check().
# ---------------------------------------------------------------------------


def _rel_setup(rank, device):
    """Workspace arguments and tensor device of a test rank (_helpers.rank_workspace_args)."""
    dev = rank_workspace_args(rank, device)
    return dev, dev.get("device", torch.device("cpu"))


def _rel_query(t, seed, where, h=2, nope=28, rope=4):  # 32 fp8 bytes per head: whole 16-byte vectors
    return [x.to(where) for x in make_query(t, h, nope=nope, rope=rope, max_pos=16, seed=seed)]


def _expect_failure(ws, device, call, match):
    """The call fails on this rank with `match`: at once on the host backend,
    at the next check() on CUDA (the kernel records and returns)."""
    import time

    t0 = time.monotonic()
    if device != "host":
        call()
        torch.cuda.synchronize()  # the kernels end at once: nobody waits out the timeout
        with pytest.raises(RuntimeError, match=match):
            ws.check()
    else:
        with pytest.raises(RuntimeError, match=match):
            call()
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match=f"on rank {ws.rank} is poisoned: .*re-create the workspace"):
        ws.check()
    assert ws.poisoned


def _query_mismatch_worker(rank, world, device):
    import re

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    rows = (2, 3)[rank]

    def gather(ws):
        return ws.gather(*_rel_query(rows, rank, where), scale)

    def heads(ws):
        return ws.all_gather_heads(ops.query_rope_quant(*_rel_query(rows, rank, where), scale,
                                                        out_dtype=torch.float8_e4m3fn))

    def view(ws):
        return ws.gather_view(*_rel_query(rows, rank, where), scale)

    both = "rank 0 called with 2 rows, rank 1 with 3 rows"
    cases = [  # (rank 0's call, rank 1's call, expected text)
        (gather, gather, r"call mismatch \(query workspace \d+, buffer 1, call 1\): " + re.escape(both)),
        (heads, heads, r"call mismatch \(query workspace \d+, buffer 1, call 1\): " + re.escape(both)),
        (view, view, r"call mismatch \(query workspace \d+, view buffer, view call 1\): " + re.escape(both)),
    ]
    for call0, call1, match in cases:
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            good = _rel_query(2, 10 + rank, where)
            if call0 is view:  # a good call first: the workspace works
                ws.gather_view(*good, scale)
                ws.release()
            else:
                ws.gather(*good, scale)
            _expect_failure(ws, device, lambda: (call0, call1)[rank](ws), match)
    # Different ops on the two ranks, same rows.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
        q = _rel_query(2, rank, where)
        op = ((lambda: ws.gather(*q, scale)) if rank == 0 else
              (lambda: ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))))
        _expect_failure(ws, device, op, "call mismatch .*rank 0 called with query_gather \\(interleaved RoPE, with "
                        "q_scale\\), rank 1 with query_all_gather_heads")
    # A copying call against a view call (their headers and buffers differ):
    # named on both ranks, whichever kind each rank made, not a timeout.
    for kinds in (("gather", "view"), ("view", "heads")):
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            q = _rel_query(2, rank, where)
            op = {"gather": lambda: ws.gather(*q, scale), "view": lambda: ws.gather_view(*q, scale),
                  "heads": lambda: ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))}
            named = {"gather": "query_gather \\(interleaved RoPE, with q_scale\\)", "heads": "query_all_gather_heads",
                     "view": "query_publish \\(interleaved RoPE, with q_scale\\)"}
            _expect_failure(ws, device, op[kinds[rank]],
                            f"call mismatch .*rank 0 called with {named[kinds[0]]}, rank 1 with {named[kinds[1]]}")
    # The dtype: the op checks element sizes only, the header carries the dtype.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=32, rope_dim=0, dtype=torch.bfloat16, timeout_s=60,
                                   **dev) as ws:
        q = torch.ones(2, 2, 32, dtype=(torch.bfloat16, torch.float16)[rank], device=where)
        _expect_failure(ws, device, lambda: ops.query_all_gather_heads(q, ws.handle),
                        "call mismatch .*rank 0 called with dtype BFloat16, rank 1 with dtype Half")
    # Re-created workspaces work.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
        inputs = [_rel_query(2, 20 + r, "cpu") for r in range(world)]
        for x in inputs[1:]:
            x[2], x[3] = inputs[0][2], inputs[0][3]
        got = ws.gather(*[x.to(where) for x in inputs[rank]], scale).cpu()
        assert torch.equal(as_bytes(got), as_bytes(_expected(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)))
        ws.check()
    if device != "host":
        assert torch.ones(4, device=where).sum().item() == 4.0  # the context is alive
    return True


def test_query_mismatched_calls_raise_on_every_rank_naming_both_sides():
    assert run_workers(_query_mismatch_worker, 2, args=("host",), timeout=240) == [True, True]


def _query_zero_rows_worker(rank, world, device):
    """A call of 0 rows is a call on every op: made by every rank between
    others, it pairs (the results before and after it are right); made by one
    rank while another has rows, it is a rows mismatch named on both ranks."""
    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5])
    fp8 = torch.float8_e4m3fn

    def inputs(t, seed):
        per_rank = [_rel_query(t, seed * 10 + r, "cpu") for r in range(world)]
        for x in per_rank[1:]:
            x[2], x[3] = per_rank[0][2], per_rank[0][3]  # positions and cache are the group's
        return per_rank

    calls = {  # op -> (make the call on this rank's inputs, its result)
        "gather": lambda ws, x: ws.gather(*x, scale.to(where)),
        "heads": lambda ws, x: ws.all_gather_heads(ops.query_rope_quant(*x, scale.to(where), out_dtype=fp8)),
        "view": lambda ws, x: ws.gather_view(*x, scale.to(where)),
    }
    for name, call in calls.items():
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            for i, t in enumerate((2, 0, 0, 3, 0, 1)):
                x = inputs(t, 30 + i)
                got = call(ws, [y.to(where) for y in x[rank]])
                assert got.shape == (t, 2 * world, 32), (name, i, got.shape)
                want = _expected(x, scale, "interleaved", fp8)
                assert torch.equal(as_bytes(got.cpu()), as_bytes(want)), f"rank {rank} {name} call {i} ({t} rows)"
                if name == "view":
                    ws.release()
            ws.check()
            rows = (0, 3)[rank]
            _expect_failure(ws, device, lambda: call(ws, [y.to(where) for y in inputs(rows, 40)[rank]]),
                            "call mismatch .*rank 0 called with 0 rows, rank 1 with 3 rows")
    return True


@pytest.mark.parametrize("device", ["host", pytest.param("cuda_shared", marks=requires_gpus(1))])
def test_query_zero_row_calls_pair_and_mismatch(device):
    assert run_workers(_query_zero_rows_worker, 2, args=(device,), timeout=240) == [True, True]


def _query_caught_error_worker(rank, world, device, mode):
    """Rank 0 makes a call that raises after it was entered (bad input),
    catches it and carries on: its next call raises "poisoned"; rank 1, waiting
    in that call, raises at once naming rank 0's abort."""
    import time

    import torch.distributed as dist

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=120, **dev)
    q = _rel_query(2, rank, where)

    def call(args):
        if mode == "view":
            ws.gather_view(*args, scale)
            ws.release()
        elif mode == "heads":
            ws.all_gather_heads(ops.query_rope_quant(*args[:4], scale, out_dtype=torch.float8_e4m3fn)
                                if args[1].dtype == torch.bfloat16 else args[0])
        else:
            ws.gather(*args, scale)

    call(q)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)  # rank 1 is waiting in its call by now
        # Found by the op, after the call's argument checks (a Python-found
        # error would be a void call instead): q_pe of the wrong dtype; for
        # all_gather_heads, a query of 3 heads, not the workspace's 2.
        bad = [q[0], q[1].float(), q[2], q[3]]
        if mode == "heads":
            bad[0] = torch.zeros(2, 3, 32, dtype=torch.float8_e4m3fn, device=where)
        with pytest.raises((ValueError, RuntimeError), match="'q_pe'|'q'"):
            call(bad)
        with pytest.raises(RuntimeError, match="on rank 0 is poisoned"):
            call(q)  # carries on: refused
    else:
        t0 = time.monotonic()
        match = "peer 0 aborted: a call raised an error on that rank"
        if device != "host":
            call(q)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match=match):
                ws.check()
        else:
            with pytest.raises(RuntimeError, match=match):
                call(q)
        assert time.monotonic() - t0 < 30  # at once, not after the 120 s timeout
    assert ws.poisoned
    with pytest.raises(RuntimeError, match="is poisoned"):
        ws.check()
    ws.close()
    return True


@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_query_caught_error_poisons_and_aborts_the_peer(mode):
    assert run_workers(_query_caught_error_worker, 2, args=("host", mode), timeout=180) == [True, True]


def _query_bad_position_worker(rank, world, device):
    """A position outside cos_sin_cache on rank 0: the host backend raises at
    once (ValueError, naming the row); CUDA records it in the kernel (no trap)
    and raises at the next check(). Either way rank 1 learns rank 0's abort."""
    import torch.distributed as dist

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=120, **dev)
    q = _rel_query(2, rank, where)
    ws.gather(*q, scale)
    if rank == 0:
        q[2] = torch.tensor([3, 99], dtype=q[2].dtype, device=where)
        if device != "host":
            ws.gather(*q, scale)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match=r"bad input on rank 0 block 0 \(query workspace \d+, buffer 1, "
                                                   r"call 1\): argument 'positions': expected values in \[0, 16\) "
                                                   r".*got 99 at row 1"):
                ws.check()
        else:
            with pytest.raises(ValueError, match=r"'positions'.*99 at row 1"):
                ws.gather(*q, scale)
    else:
        match = "peer 0 aborted: a (kernel on that rank met bad input|call raised an error on that rank)"
        if device != "host":
            ws.gather(*q, scale)
            torch.cuda.synchronize()
            ws.gather(*q, scale)  # learns a peer's abort at the latest in its next kernel
            torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=match):
            ws.check() if device != "host" else ws.gather(*q, scale)
    dist.barrier()
    assert ws.poisoned
    ws.close()
    if device != "host":
        assert torch.ones(4, device=where).sum().item() == 4.0  # no trap: the context is alive
    return True


def test_query_bad_position_poisons_and_aborts_the_peer():
    assert run_workers(_query_bad_position_worker, 2, args=("host",), timeout=180) == [True, True]


def _query_creation_agreement_worker(rank, world, device):
    import torch_sdcp
    from torch_sdcp.peer.plan import RankMismatchError

    dev, where = _rel_setup(rank, device)
    cases = [
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2 + 2 * rank, **dev), r"'local_heads' \(rank 0: 2, rank 1: 4\)"),
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, rope_style=("interleaved", "neox")[rank], **dev),
         r"'rope_style' \(rank 0: 'interleaved', rank 1: 'neox'\)"),
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, dtype=(torch.float8_e4m3fn, torch.bfloat16)[rank], **dev),
         r"'dtype' \(rank 0: 'torch.float8_e4m3fn', rank 1: 'torch.bfloat16'\)"),
    ]
    for make, match in cases:
        with pytest.raises(RankMismatchError, match=f"expected the same value on every rank.*{match}"):
            make()
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, **dev) as ws:  # still in step
        ws.gather(*_rel_query(2, rank, where), torch.tensor([0.5]).to(where))
        ws.check()
        assert not ws.poisoned
    return True


def test_query_creation_compares_the_geometry_across_ranks():
    assert run_workers(_query_creation_agreement_worker, 2, args=("host",), timeout=120) == [True, True]


@requires_gpus(2)
def test_query_cuda_mismatched_calls_raise_on_every_rank():
    assert run_workers(_query_mismatch_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_query_cuda_caught_error_poisons_and_aborts_the_peer(mode):
    assert run_workers(_query_caught_error_worker, 2, args=("cuda", mode), timeout=300) == [True, True]


@requires_gpus(2)
def test_query_cuda_bad_position_is_reported_not_trapped():
    assert run_workers(_query_bad_position_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
def test_query_cuda_creation_compares_the_geometry_across_ranks():
    assert run_workers(_query_creation_agreement_worker, 2, args=("cuda",), timeout=300) == [True, True]


# Both ranks on one GPU (time-sliced): the CUDA failure paths where one GPU is
# all there is.
@requires_gpus(1)
@pytest.mark.parametrize("worker,args", [(_query_mismatch_worker, ()), (_query_caught_error_worker, ("gather",)),
                                         (_query_caught_error_worker, ("heads",)),
                                         (_query_caught_error_worker, ("view",)),
                                         (_query_bad_position_worker, ())],
                         ids=["mismatch", "caught_gather", "caught_heads", "caught_view", "bad_position"])
def test_query_cuda_two_ranks_on_one_gpu(worker, args):
    assert run_workers(worker, 2, args=("cuda_shared", *args), timeout=300) == [True, True]


# Four ranks on one GPU, in one spawn: rank 0's error inside a gather, then its
# position outside the cache (met by the kernel), reach the three ranks waiting.
@requires_gpus(1)
def test_query_cuda_four_ranks_shared_gpu():
    steps = ((_query_caught_error_worker, ("cuda_shared", "gather")), (_query_bad_position_worker, ("cuda_shared",)))
    assert run_workers(in_turn, 4, args=steps, timeout=180) == [[True, True]] * 4
