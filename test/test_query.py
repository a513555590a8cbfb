"""Query boundary: the fused RoPE/FP8 producer, the peer gather (host backend
at world sizes 1-4, CUDA on 2 GPUs), opcheck, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from torch_sdcp import ops, reference

from conftest import devices


def make_query(t, h, *, nope=512, rope=64, max_pos=4096, seed=0, cache_dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ql_nope = (torch.randn(t, h, nope, generator=g) * 3).to(torch.bfloat16)
    q_pe = (torch.randn(t, h, rope, generator=g) * 3).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(cache_dtype)
    return [x.to(device) for x in (ql_nope, q_pe, positions, cache)]


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

from _dist import run_workers  # noqa: E402
from conftest import GPU_WORLD, requires_gpus  # noqa: E402


def _global_query(world, t, h, seed):
    per_rank = [make_query(t, h, seed=seed * 10 + r) for r in range(world)]
    pos, cache = per_rank[0][2], per_rank[0][3]  # positions and cache are shared by the group
    for r, q in enumerate(per_rank):
        q[0][:, :, 0] = float(r * h) + torch.arange(h, dtype=torch.float32)  # sentinel: the global head index
    return [(q[0], q[1], pos, cache) for q in per_rank]


def _expected(inputs, scale, rope_style, dtype):
    return torch.cat([reference.query_rope_quant_ref(*x, scale, neox=rope_style == "neox", out_dtype=dtype)
                      for x in inputs], dim=1)


def _peer_gather_worker(rank, world, backend, cases, max_rows):
    import torch_sdcp

    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    done = 0
    for h, dtype, style in sorted({(h, d, s) for _, h, d, s, _ in cases}, key=str):
        with torch_sdcp.QueryWorkspace(None, max_rows, h, dtype=dtype, rope_style=style, backend=backend,
                                       device=device) as ws:
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


def _view_worker(rank, world, backend, rounds, late_rank):
    import time

    import torch_sdcp

    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    t, h = 9, 8
    with torch_sdcp.QueryWorkspace(None, 16, h, dtype=torch.float8_e4m3fn, backend=backend, device=device) as ws:
        scale = torch.tensor([0.02])
        for i in range(rounds):
            inputs = _global_query(world, t, h, seed=100 + i)
            want = _expected(inputs, scale, "interleaved", torch.float8_e4m3fn)
            view = ws.gather_view(*[x.to(device) for x in inputs[rank]], scale.to(device))
            assert view.shape == (t, world * h, 576) and view.dtype == torch.float8_e4m3fn
            if rank == late_rank:  # reads after other work: the others must not overwrite the inbox meanwhile
                if backend == "cuda":
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
        with pytest.raises(RuntimeError, match="timeout: rank 1 .* for peer 0 to finish reading"):
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


def test_inbox_fits_the_target_at_128_rows():
    # One slot of 128 rows x 64 FP8 heads x 576 bytes, plus control: 6 MiB
    # after rounding to a 2 MiB granularity.
    nbytes = torch.ops.sdcp.workspace_nbytes(3, [128, 32, 576, 1], 2)
    assert 128 * 64 * 576 < nbytes <= 6 * 2**20 - 2**20


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
