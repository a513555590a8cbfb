"""Query family, the zero-copy view: gather_view's inbox read in place
until release() (a late reader never sees the next call's query), a missing
release reported, misuse refused, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from _dist import run_workers
from _helpers import GPU_WORLD, make_query, rank_workspace_args, requires_gpus
from _query import as_bytes, expected_gather, global_query

from torch_sdcp import ops, reference

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
            inputs = global_query(world, t, h, seed=100 + i)
            want = expected_gather(inputs, scale, "interleaved", torch.float8_e4m3fn)
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
        with pytest.raises(ValueError, match="'inbox'.*gather_view"):
            ops.query_release(view.clone(), ws.handle)
        ws.release()
        with pytest.raises(RuntimeError, match="no view is open"):  # changes nothing: not poisoned
            ws.release()
        assert not ws.poisoned
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
        # A view call while the view is open would leave this rank a call
        # behind its peers: it poisons (and aborts on every rank).
        ws.gather_view(*q, scale)
        with pytest.raises(RuntimeError, match="still open.*aborted on every rank"):
            ws.gather(*q, scale)
        assert ws.poisoned
        with pytest.raises(RuntimeError, match="is poisoned: gather_view"):
            ws.gather_view(*q, scale)


def _view_graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, h = 32, 32
    with torch_sdcp.QueryWorkspace(None, 128, h, device=device) as ws:
        inputs = global_query(world, t, h, seed=0)
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
                inputs = global_query(world, t, h, seed=r + 1)
                for dst, src in zip(static, inputs[rank], strict=False):
                    dst.copy_(src)
            graph.replay()
            if check:
                want = expected_gather(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)
                assert torch.equal(as_bytes(copy.cpu()), as_bytes(want)), f"replay {r}"
    return replays


@requires_gpus(GPU_WORLD)
def test_view_cuda_graph_replay():
    assert run_workers(_view_graph_worker, GPU_WORLD, args=(1000,), timeout=400) == [1000] * GPU_WORLD
