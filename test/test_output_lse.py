"""Output/LSE boundary: the local combine, the peer combine (host backend at
world sizes 1-4, CUDA on 2 GPUs, and 2, 4 and 8 ranks sharing one GPU), opcheck, torch.compile, CUDA graphs,
and the failures of a call: timeouts, aborts, poisoning, a killed peer, ranks on different paths."""

from __future__ import annotations

import time

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import (
    GPU_WORLD,
    HOST,
    SHARED_GPU_WORLDS,
    devices,
    expect_failure,
    expect_poisoned,
    rank_partials,
    rank_workspace_args,
    requires_gpus,
)

from torch_sdcp import ops, reference


def make_partials(n, t, h, d, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, t, h, d, generator=g).to(dtype).to(device)
    lse = (torch.randn(n, t, h, generator=g) * 4).to(device)
    return out, lse


def poison_lse(out, lse, g):
    """NaN/+inf/-inf LSE columns, all-empty rows, NaN payloads under zero weight."""
    n, t, h = lse.shape
    lse[0, :, 0] = float("nan")
    lse[min(1, n - 1), :, 1 % h] = float("inf")
    lse[:, 0, :] = -float("inf")  # row 0: every shard empty
    if h > 2:
        lse[0, :, 2] = -float("inf")
        out[0, :, 2] = float("nan")  # zero weight: must not leak
    out[0, :, 0] = float("nan")  # NaN LSE is empty: payload must not leak
    return out, lse


def check_close(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any(), "NaN leaked into the output"
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5, equal_nan=False)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n,t,h,d", [(1, 1, 4, 128), (2, 17, 32, 128), (3, 8, 6, 256), (4, 64, 8, 512)])
def test_local_combine_matches_reference(device, base2, n, t, h, d):
    out, lse = make_partials(n, t, h, d, device=device, seed=n * 100 + t)
    out, lse = poison_lse(out, lse, None)
    got_out, got_lse = ops.lse_combine(out, lse, lse_base="2" if base2 else "e")
    ref_out, ref_lse = reference.lse_combine_ref64(out.cpu(), lse.cpu(), base2=base2)
    check_close(got_out.cpu(), got_lse.cpu(), ref_out, ref_lse)
    assert torch.equal(got_out[0].cpu(), torch.zeros_like(got_out[0].cpu())), "all-empty row must be exactly 0"
    assert torch.isneginf(got_lse[0]).all(), "all-empty row must have LSE -inf"


@pytest.mark.parametrize("device", devices())
def test_local_combine_rejects_bad_input(device):
    out, lse = make_partials(2, 4, 4, 128, device=device)
    with pytest.raises(ValueError, match="partial_lse.*dtype"):
        ops.lse_combine(out, lse.double())
    with pytest.raises(ValueError, match="partial_out.*contiguous"):
        ops.lse_combine(out.transpose(1, 2), lse.transpose(1, 2))
    with pytest.raises(ValueError, match="partial_lse.*size 4 at dim 1"):
        ops.lse_combine(out, lse[:, :3].contiguous())
    with pytest.raises(ValueError, match="lse_base"):
        ops.lse_combine(out, lse, lse_base="10")


@pytest.mark.parametrize("device", devices())
def test_local_combine_opcheck(device):
    for n, t, h, d, dtype in [(1, 1, 2, 128, torch.bfloat16), (2, 5, 4, 128, torch.float32),
                              (3, 2, 3, 256, torch.float16)]:
        out, lse = make_partials(n, t, h, d, dtype=dtype, device=device)
        torch.library.opcheck(torch.ops.sdcp.lse_combine.default, (out, lse, False))
        torch.library.opcheck(torch.ops.sdcp.lse_combine.default, (out, lse, True))


def test_local_combine_compiles_fullgraph():
    out, lse = make_partials(2, 4, 4, 128)
    f = torch.compile(lambda o, l: ops.lse_combine(o, l, lse_base="2"), fullgraph=True, backend="inductor")
    got = f(out, lse)
    want = ops.lse_combine(out, lse, lse_base="2")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------
# Peer path: every rank combines its own heads; compared with the fp64
# reference over the global inputs (identically seeded on every rank).
# ---------------------------------------------------------------------------


def _global_partials(world, t, h, d, seed, nasty):
    out, lse = make_partials(world, t, h, d, seed=seed)
    if nasty:
        out, lse = poison_lse(out, lse, None)
    return out, lse


def _check_rank(rank, world, got_out, got_lse, out, lse, base2):
    ref_out, ref_lse = reference.lse_combine_ref64(out, lse, base2=base2)
    ref_out, ref_lse = reference.output_lse_shard(ref_out, ref_lse, rank, world)
    check_close(got_out.cpu(), got_lse.cpu(), ref_out, ref_lse)


def _peer_combine_worker(rank, world, backend, cases, max_rows, shared=False):
    import torch_sdcp

    device = torch.device("cuda", 0 if shared else rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    done = 0
    by_geometry = {}
    for t, h, d, base2, nasty in cases:
        by_geometry.setdefault((h, d), []).append((t, base2, nasty))
    for (h, d), items in by_geometry.items():
        with torch_sdcp.OutputLSEWorkspace(None, max_rows, h, d, backend=backend, device=device,
                                           allow_shared_device=shared) as ws:
            assert ws.peer
            for i, (t, base2, nasty) in enumerate(items):
                out, lse = _global_partials(world, t, h, d, seed=1000 * t + h + d + i, nasty=nasty)
                base = "2" if base2 else "e"
                got, got_lse = ws.combine(out[rank].to(device), lse[rank].to(device), lse_base=base,
                                          return_lse=True)
                _check_rank(rank, world, got, got_lse, out, lse, base2)
                o = torch.full_like(got, float("nan"))
                ol = torch.full_like(got_lse, float("nan"))
                ws.combine_out(out[rank].to(device), lse[rank].to(device), o, ol, lse_base=base)
                assert torch.equal(o, got) and torch.equal(ol, got_lse), "combine_out differs from combine"
                done += 1
    return done


def _sentinel_worker(rank, world, mode):
    """The data-as-flag sentinel (all-ones words) as real input: payload words
    of a weighted shard become NaN exactly where the reference has NaN; under
    zero weight they contribute exactly 0; an all-ones LSE (a NaN) is an
    empty shard; the results stay identical call after call."""
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    t, h, d = 9, 4 * world, 128
    with torch_sdcp.OutputLSEWorkspace(None, 16, h, d, **args) as ws:
        for call in range(6):
            out, lse = make_partials(world, t, h, d, seed=call)
            words = out.view(torch.int32)  # bf16 pairs
            words[world - 1, 1, :, : d // 4] = -1          # weighted: NaN where the reference has NaN
            lse[0, 2, :] = -float("inf")
            words[0, 2, :, :] = -1                         # zero weight: no leak
            lse.view(torch.int32)[min(1, world - 1), 3, :] = -1  # an all-ones LSE is a NaN: empty shard
            words[min(1, world - 1), 3, :, :] = -1
            got, got_lse = ws.combine(out[rank].to(device), lse[rank].to(device), return_lse=True)
            ref_out, ref_lse = reference.lse_combine_ref64(out, lse)
            ref_out, ref_lse = reference.output_lse_shard(ref_out, ref_lse, rank, world)
            got = got.cpu().double()
            assert torch.equal(torch.isnan(got), torch.isnan(ref_out)), f"call {call}: NaN pattern differs"
            assert torch.isnan(got[1]).any()  # row 1 carries weighted all-ones words
            torch.testing.assert_close(got_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, ref_out, rtol=2e-2, atol=2e-2, equal_nan=True)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_peer_combine_host_sentinel_inputs(world):
    assert run_workers(_sentinel_worker, world, args=("host",), timeout=120) == [True] * world


HOST_CASES = [(1, 32, 128, False, True), (17, 32, 256, True, True), (8, 64, 512, False, False),
              (32, 64, 128, True, False), (96, 32, 128, False, True), (128, 64, 128, True, True)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_peer_combine_host(world):
    cases = [(t, h - h % world if h % world else h, d, b, n) for t, h, d, b, n in HOST_CASES]
    cases = [(t, (h // world) * world, d, b, n) for t, h, d, b, n in cases]
    done = run_workers(_peer_combine_worker, world, args=("host", cases, 128), timeout=240)
    assert done == [len(cases)] * world


def _fallback_worker(rank, world):
    import torch_sdcp

    with torch_sdcp.OutputLSEWorkspace(None, 4, 8, 128, backend="host") as ws:
        out, lse = _global_partials(world, 6, 8, 128, seed=5, nasty=True)  # 6 rows > max_rows = 4
        got, got_lse = ws.combine(out[rank], lse[rank], return_lse=True)
        _check_rank(rank, world, got, got_lse, out, lse, False)
        # Both ranks make the bad call; a peer's failure may reach this rank
        # first (its abort, or its exit seen by the liveness watcher): the
        # arguments are checked first, so each rank names its own.
        with pytest.raises(ValueError, match="'partial_out'.*size 8 at dim 1"):
            ws.combine(out[rank][:4, :4].contiguous(), lse[rank][:4, :4].contiguous())
    ws.close()  # idempotent
    with pytest.raises(ValueError, match="'workspace'.*live output_lse workspace"):
        ops.output_lse_combine(out[rank], lse[rank], ws_handle_of(ws))
    return True


def ws_handle_of(ws):
    return 10**9  # a closed workspace has no handle; any unknown handle must be refused


def test_peer_combine_fallback_and_errors():
    assert run_workers(_fallback_worker, 2, timeout=120) == [True, True]


# ---------------------------------------------------------------------------
# CUDA: 2 GPUs, the full shape matrix, CUDA graphs and torch.compile.
# ---------------------------------------------------------------------------


GPU_CASES = [(t, h, d, b, n) for t in (1, 8, 17, 32, 64, 96, 128) for h in (32, 64, 128) for d in (128, 256, 512)
             for b, n in ((t % 2 == 0, t % 3 == 0),)]


@requires_gpus(GPU_WORLD)
def test_peer_combine_cuda_sentinel_inputs():
    assert run_workers(_sentinel_worker, GPU_WORLD, args=("cuda",), timeout=120) == [True] * GPU_WORLD


@requires_gpus(1)
def test_peer_combine_cuda_two_ranks_on_one_gpu():
    # Two ranks time-slicing one GPU (correctness only): the peer path where one GPU is all there is.
    cases = [(1, 64, 512, False, True), (17, 32, 256, True, True), (64, 64, 512, False, False)]
    assert run_workers(_peer_combine_worker, 2, args=("cuda", cases, 64, True), timeout=300) == [len(cases)] * 2


# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only): rows
# 1 and max_rows, NaN / +-inf LSE, every shard of a row empty, the sentinel words.
SHARED_GPU_CASES = [(1, 32, 128, False, True), (17, 32, 256, True, False), (64, 64, 512, True, True)]


@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
@pytest.mark.parametrize("all_peers", ["0", "1"])  # SDCP_OLSE_ALL_PEERS: every peer's vectors loaded at once
def test_peer_combine_cuda_shared_gpu(world, all_peers, monkeypatch):
    monkeypatch.setenv("SDCP_OLSE_ALL_PEERS", all_peers)  # read by the ranks' processes at their first launch
    steps = ((_peer_combine_worker, ("cuda", SHARED_GPU_CASES, 64, True)), (_sentinel_worker, ("cuda_shared",)))
    assert run_workers(in_turn, world, args=steps, timeout=240) == [[len(SHARED_GPU_CASES), True]] * world


@requires_gpus(GPU_WORLD)
def test_peer_combine_cuda_matrix():
    done = run_workers(_peer_combine_worker, GPU_WORLD, args=("cuda", GPU_CASES, 128), timeout=400)
    assert done == [len(GPU_CASES)] * GPU_WORLD


def _graph_worker(rank, world, layers, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, h, d = 32, 64, 512
    with torch_sdcp.OutputLSEWorkspace(None, 64, h, d, device=device) as ws:
        out, lse = _global_partials(world, t, h, d, seed=1, nasty=False)
        static_out = [out[rank].clone().to(device) for _ in range(2 * layers)]
        static_lse = [lse[rank].clone().to(device) for _ in range(2 * layers)]
        results = [None] * (2 * layers)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on the capture stream
            for i in range(2 * layers):
                results[i] = ws.combine(static_out[i], static_lse[i], return_lse=True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(2 * layers):  # 2 * L calls: every buffer reused L times per replay
                results[i] = ws.combine(static_out[i], static_lse[i], return_lse=True)
        for r in range(replays):
            check = r % max(1, replays // 10) == 0 or r == replays - 1
            if check:  # new inputs, changed in place
                out, lse = _global_partials(world, t, h, d, seed=100 + r, nasty=r % 2 == 1)
                for i in range(2 * layers):
                    static_out[i].copy_(out[rank] * (i + 1))
                    static_lse[i].copy_(lse[rank])
            graph.replay()
            if check:
                torch.cuda.synchronize()
                for i in range(2 * layers):
                    _check_rank(rank, world, results[i][0], results[i][1], out * (i + 1), lse, False)
        # torch.compile, full graph, default and reduce-overhead.
        for mode in (None, "reduce-overhead"):
            f = torch.compile(lambda o, l: ws.combine(o, l, lse_base="2", return_lse=True), fullgraph=True,
                              mode=mode)
            for i in range(3):
                out, lse = _global_partials(world, t, h, d, seed=7 + i, nasty=True)
                got = f(out[rank].to(device), lse[rank].to(device))
                _check_rank(rank, world, got[0], got[1], out, lse, True)
    return replays


@requires_gpus(GPU_WORLD)
def test_peer_combine_cuda_graph_replay_and_compile():
    assert run_workers(_graph_worker, GPU_WORLD, args=(4, 1000), timeout=400) == [1000] * GPU_WORLD


def test_peer_combine_opcheck_and_compile_world1(world1):
    import torch_sdcp

    for device in devices():
        with torch_sdcp.OutputLSEWorkspace(world1, 8, 4, 128, device=torch.device(device),
                                           backend="cuda" if device == "cuda" else "host") as ws:
            out, lse = make_partials(1, 5, 4, 128, device=device)
            torch.library.opcheck(torch.ops.sdcp.output_lse_combine.default, (out[0], lse[0], ws.handle, False))
            o, ol = torch.empty(5, 4, 128, dtype=out.dtype, device=device), torch.empty(5, 4, device=device)
            torch.library.opcheck(torch.ops.sdcp.output_lse_combine_out.default,
                                  (out[0], lse[0], ws.handle, True, o, ol))
            f = torch.compile(lambda a, b: ws.combine(a, b, return_lse=True), fullgraph=True)
            got = f(out[0], lse[0])
            ref = reference.lse_combine_ref64(out.cpu(), lse.cpu())
            check_close(got[0].cpu(), got[1].cpu(), *ref)


# ---------------------------------------------------------------------------
# Failures of a call, host backend: a skipped call times out, bad input on one
# rank aborts the waiting peer, a killed peer poisons the survivor, ranks that
# take different paths are told; then on CUDA, 2 GPUs and both ranks on one
# GPU. (Mismatched calls: test_reliability.py, beside the exchange's.)
# ---------------------------------------------------------------------------


def _skip_worker(rank, world, device):
    import torch.distributed as dist

    import torch_sdcp

    dev = rank_workspace_args(rank, device)
    control = dist.new_group([0, 1])
    po, pl = rank_partials(2, seed=rank)
    po, pl = po.to(dev.get("device", "cpu")), pl.to(dev.get("device", "cpu"))
    dist.barrier(group=control)
    ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=1.5, **dev)
    dist.barrier(group=control)  # the first call entered together, as after the re-creation below
    ws.combine(po, pl)
    ws.check()
    if rank == 0:  # rank 1 skips this call
        t0 = time.monotonic()
        match = r"timeout: rank 0 .*waited 1.5 s for peer 1's (call header|data) .*buffer 1, call 1"
        if device != "host":
            ws.combine(po, pl)
            torch.cuda.synchronize()  # the kernel returns after the timeout: the context survives
            with pytest.raises(RuntimeError, match=match):
                ws.check()
        else:
            with pytest.raises(RuntimeError, match=match):
                ws.combine(po, pl)
        assert time.monotonic() - t0 < 10
        dist.barrier(group=control)
    else:
        dist.barrier(group=control)  # rank 0 timed out and aborted the workspace everywhere
        match = r"peer 0 aborted: it timed out waiting for a peer"
        if device != "host":
            t0 = time.monotonic()
            ws.combine(po, pl)  # the kernel finds rank 0's abort word in its first slow poll
            torch.cuda.synchronize()
            assert time.monotonic() - t0 < 1.4
            with pytest.raises(RuntimeError, match=match):
                ws.check()
        else:
            with pytest.raises(RuntimeError, match=match):
                ws.combine(po, pl)
    assert ws.poisoned
    expect_poisoned(ws, lambda: ws.combine(po, pl))
    expect_poisoned(ws, ws.check)
    with pytest.raises(ValueError, match="'max_rows'"):
        ws.resize(0)
    ws.resize(4)  # re-creation (collective) clears the poison
    assert not ws.poisoned
    # A rank can leave the re-creation later than its peer (on a loaded machine
    # by more than this workspace's 1.5 s timeout): enter the next call together.
    dist.barrier(group=control)
    ws.combine(po, pl)
    ws.close()
    with torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=30, **dev) as fresh:
        fresh.combine(po, pl)
        fresh.check()
    if device != "host":
        assert torch.ones(4, device="cuda").sum().item() == 4.0
    return True


def test_skipped_call_times_out_poisons_and_aborts_the_peer():
    assert run_workers(_skip_worker, 2, args=("host",), timeout=180) == [True, True]


def _bad_input_worker(rank, world, device):
    import torch.distributed as dist

    import torch_sdcp

    dev = rank_workspace_args(rank, device)
    po, pl = rank_partials(2, seed=rank)
    po, pl = po.to(dev.get("device", "cpu")), pl.to(dev.get("device", "cpu"))
    ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=120, **dev)
    ws.combine(po, pl)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)  # rank 1 is waiting in its call by now
        # No tensor tells the rows: no void placeholder, so the call poisons
        # (an argument error with one is a void call instead).
        with pytest.raises(ValueError, match="argument 'partial_out': expected a Tensor"):
            ws.combine(po.tolist(), pl.tolist())
        expect_poisoned(ws, lambda: ws.combine(po, pl))
    else:
        expect_failure(ws, device, lambda: ws.combine(po, pl), "peer 0 aborted: a call raised an error on that rank",
                       within=20)  # at once, not after the 120 s timeout
    expect_poisoned(ws, ws.check)
    ws.close()
    return True


def test_bad_input_on_one_rank_aborts_the_waiting_peer_at_once():
    assert run_workers(_bad_input_worker, 2, args=("host",), timeout=120) == [True, True]


def _killed_peer_worker(rank, world):
    import os

    import torch.distributed as dist

    import torch_sdcp

    control = dist.new_group([0, 1])
    po, pl = rank_partials(2, seed=rank)
    ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=1.5, **HOST)
    # A rank can leave the creation later than its peer (on a loaded machine by
    # more than this workspace's 1.5 s timeout): enter the first call together.
    dist.barrier(group=control)
    ws.combine(po, pl)
    if rank == 1:
        os._exit(17)  # killed between calls
    with pytest.raises(RuntimeError, match=r"peer 1 \(pid \d+\) exited"):  # found by the liveness watcher
        ws.combine(po, pl)
    expect_poisoned(ws, lambda: ws.combine(po, pl))
    expect_poisoned(ws, ws.check)
    t0 = time.monotonic()
    ws.close()  # local: no barrier with a dead peer
    assert time.monotonic() - t0 < 1.0
    return "survived"


def test_killed_rank_poisons_the_survivor():
    assert run_workers(_killed_peer_worker, 2, timeout=120, may_die=(1,)) == ["survived", None]


def _rows_fallback_disagreement_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    control = dist.new_group([0, 1])
    ws = torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, timeout_s=1.5, **HOST)
    po, pl = rank_partials(2, seed=rank)
    dist.barrier(group=control)  # the first call entered together (a short timeout)
    ws.combine(po, pl)
    dist.barrier(group=control)  # and the timed one: rank 1 waits for rank 0's placeholder
    t0 = time.monotonic()
    if rank == 0:  # 3 rows > max_rows: the collective path, while rank 1 takes the peer path: a void call
        big, big_lse = rank_partials(3, seed=rank)
        with pytest.raises(ValueError, match=r"argument 'partial_out': expected 2 rows \(rank 1 with 2 rows, the peer "
                                             r"path\), got 3 rows \(over max_rows = 2 on this rank only\)"):
            ws.combine(big, big_lse)  # it never enters gloo
    else:  # rank 0's placeholder (2 rows, void) pairs with this call
        with pytest.raises(torch_sdcp.VoidedCallError, match=r"rank 0 voided call .*got 3 rows"):
            ws.combine(po, pl)
    assert time.monotonic() - t0 < 1.0  # not timeout_s = 1.5 s
    assert not ws.poisoned
    assert ws.combine(po, pl).shape == (2, 4, 64)  # the next call pairs
    ws.close()
    return True


def test_rows_fallback_disagreement_is_reported():
    assert run_workers(_rows_fallback_disagreement_worker, 2, timeout=120) == [True, True]


@requires_gpus(2)
def test_cuda_timeout_is_reported_not_trapped():
    assert run_workers(_skip_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
def test_cuda_bad_input_aborts_the_waiting_peer():
    assert run_workers(_bad_input_worker, 2, args=("cuda",), timeout=300) == [True, True]


# Both ranks on one GPU (time-sliced): the CUDA failure paths where one GPU is
# all there is.
@requires_gpus(1)
@pytest.mark.parametrize("worker", [_skip_worker, _bad_input_worker], ids=lambda w: w.__name__.strip("_"))
def test_cuda_two_ranks_on_one_gpu(worker):
    assert run_workers(worker, 2, args=("cuda_shared",), timeout=300) == [True, True]


# Four ranks on one GPU: rank 0's bad input reaches the three ranks waiting in the call.
@requires_gpus(1)
def test_cuda_bad_input_aborts_every_waiting_peer_shared_gpu():
    assert run_workers(_bad_input_worker, 4, args=("cuda_shared",), timeout=180) == [True] * 4
