"""The signalling primitive (peer_all_gather through an ExchangeWorkspace):
thousands of calls in a row (the payload's size changing every call, the two
buffers in turn, tagged words: nothing is re-filled), bounded waits, a rank
that stops or is killed, CUDA graphs and arbitrary bytes, on the host backend
at world sizes 2-4 and on CUDA (2 GPUs, 4 ranks on 2 GPUs, and 4 and 8 ranks
on one GPU). A test's "epochs" are its calls."""

from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import GPU_WORLD, SHARED_GPU_WORLDS, rank_workspace_args, requires_gpus


def _epochs_worker(rank, world, epochs, mode, allow_shared=False):
    """mode "cuda": rank r on GPU r modulo the GPU count (sharing one when
    allow_shared); "host" and "cuda_shared" as in rank_workspace_args."""
    import torch_sdcp

    if mode == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        args = {"backend": "cuda", "device": device, "allow_shared_device": allow_shared}
    else:
        args = rank_workspace_args(rank, mode)
        device = args.get("device", torch.device("cpu"))
    rng = random.Random(rank)
    with torch_sdcp.ExchangeWorkspace(None, 4096, timeout_s=30, **args) as ws:
        for e in range(epochs):
            if rng.random() < 0.01:  # random per-rank delays
                time.sleep(rng.random() * 0.003)
            n = 1 + (e * 7) % 1000  # the size changes every epoch
            x = torch.arange(n, dtype=torch.int32, device=device) * world + rank + e * 1000003
            got = ws.all_gather(x)
            want = torch.stack([torch.arange(n, dtype=torch.int32, device=device) * world + r + e * 1000003
                                for r in range(world)])
            if not torch.equal(got, want):
                raise AssertionError(f"rank {rank} epoch {e}: wrong data")
    return epochs


@pytest.mark.parametrize("world,epochs", [(2, 10000), (3, 3000), (4, 2000)])
def test_host_publish_wait_many_epochs(world, epochs):
    assert run_workers(_epochs_worker, world, args=(epochs, "host", False), timeout=300) == [epochs] * world


def _stall_worker(rank, world, mode="host", timeout_s=1.0):
    import torch.distributed as dist

    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    dist.barrier()  # creation is bounded by timeout_s too: start it together

    with torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=timeout_s, **args) as ws:
        x = torch.ones(4, device=args.get("device", "cpu"))
        for _ in range(3):
            ws.all_gather(x)
        if rank == world - 1:  # stops participating, without dying
            time.sleep(4 * timeout_s)
            return "stalled"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            ws.all_gather(x)
            if mode != "host":  # the kernel records the timeout and returns: the host raises at check()
                torch.cuda.synchronize()
                ws.check()
        elapsed = time.monotonic() - t0
        msg = str(info.value)
        # Its own timeout, or a peer's relayed by the abort word: either names this rank's wait (and on CUDA
        # the block) and the rank that stopped.
        assert re.search(f"rank {rank}( block \\d+)? waited", msg) and f"peer {world - 1}" in msg, msg
        assert "buffer 1" in msg and "call 3" in msg, msg
        assert elapsed < 3 * timeout_s, elapsed
        return "reported"


def test_host_timeout_reports_rank_peer_buffer_call():
    assert run_workers(_stall_worker, 3, timeout=120) == ["reported", "reported", "stalled"]


def _killed_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    dist.barrier()  # creation is bounded by timeout_s too: start it together

    ws = torch_sdcp.ExchangeWorkspace(None, 64, backend="host", timeout_s=1.5)
    x = torch.ones(4)
    ws.all_gather(x)
    if rank == 1:
        os._exit(17)  # killed mid-protocol
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="peer 1"):
        for _ in range(10):
            ws.all_gather(x)
    assert time.monotonic() - t0 < 5
    ws.close()  # a dead peer must not make teardown hang
    return "survived"


def test_host_killed_rank_survivors_fail_within_timeout():
    out = run_workers(_killed_worker, 3, timeout=120, may_die=(1,))
    assert out[0] == out[2] == "survived" and out[1] is None


@requires_gpus(GPU_WORLD)
def test_cuda_publish_wait_many_epochs():
    assert run_workers(_epochs_worker, GPU_WORLD, args=(10000, "cuda", False), timeout=300) == [10000] * GPU_WORLD


# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only):
# sizes from 1 word to the workspace's capacity, all-ones words, odd byte
# counts; then, at world 4, a rank that stops is named by the others' timeouts.
@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
def test_cuda_publish_wait_and_tagged_words_shared_gpu(world):
    steps = ((_epochs_worker, (20, "cuda_shared")), (_tagged_bytes_worker, ("cuda_shared",)))
    assert run_workers(in_turn, world, args=steps, timeout=240) == [[20, True]] * world


@requires_gpus(1)
def test_cuda_timeout_names_the_rank_that_stops_shared_gpu():
    # 2 s: time-sliced with other tests' ranks, the calls before the stop must not time out.
    assert run_workers(_stall_worker, 4, args=("cuda_shared", 2.0), timeout=120) == ["reported"] * 3 + ["stalled"]


@requires_gpus(2)
def test_cuda_four_ranks_on_two_gpus():
    # Two ranks per GPU time-slice (docs/DESIGN.md section 6): correctness only, few epochs.
    assert run_workers(_epochs_worker, 4, args=(20, "cuda", True), timeout=300) == [20] * 4


def _graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    with torch_sdcp.ExchangeWorkspace(None, 1 << 16, device=device) as ws:
        x = torch.zeros(1000, dtype=torch.int64, device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ws.all_gather(x)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a = ws.all_gather(x)
            b = ws.all_gather(x + 1)  # two calls per replay: both buffers in use
        base = torch.arange(1000, device=device)
        for r in range(replays):
            x.copy_(base * 7 + r * 100 + rank)
            graph.replay()
            if r % 50 == 0 or r == replays - 1:
                torch.cuda.synchronize()
                want = torch.stack([base * 7 + r * 100 + q for q in range(world)])
                assert torch.equal(a, want) and torch.equal(b, want + 1), f"replay {r}"
    return replays


@requires_gpus(GPU_WORLD)
def test_cuda_graph_replay_advances_epochs():
    assert run_workers(_graph_worker, GPU_WORLD, args=(1000,), timeout=300) == [1000] * GPU_WORLD


def _tagged_bytes_worker(rank, world, mode):
    """Arbitrary bytes arrive bit-exact: all-ones words, odd byte counts and
    unaligned views (the exchange reserves no value)."""
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    with torch_sdcp.ExchangeWorkspace(None, 1024, timeout_s=30, **args) as ws:
        for _i, nbytes in enumerate((1, 3, 4, 13, 64, 1000, 1024)):
            data = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(world)]
            for r in range(world):
                data[r][: (nbytes // 2)] = 0xFF  # all-ones words, the sentinel of other paths
            got = ws.all_gather(data[rank].to(device))
            assert torch.equal(got.cpu(), torch.stack(data)), f"rank {rank}: {nbytes} bytes differ"
            full = torch.full((max(1, nbytes // 4),), -1, dtype=torch.int32, device=device)
            assert torch.equal(ws.all_gather(full).cpu(), torch.full((world, full.numel()), -1, dtype=torch.int32))
            odd = torch.arange(2 * nbytes + 1, dtype=torch.uint8, device=device)[1:].view(-1)[:nbytes]  # unaligned
            want = torch.stack([odd.cpu()] * world)
            assert torch.equal(ws.all_gather(odd.contiguous()).cpu(), want)
    return True


def _large_worker(rank, world, mode):
    """More words than a grid of threads on CUDA (the kernel's loop over a
    thread's words: a grid holds at most 384 blocks of 256 threads), aligned
    and not, bit-exact."""
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    nbytes = 4 * 384 * 256 * 3 + 5  # three and a bit words per thread of the largest grid
    with torch_sdcp.ExchangeWorkspace(None, nbytes + 1, timeout_s=30, **args) as ws:
        data = [torch.randint(0, 256, (nbytes + 1,), dtype=torch.uint8, generator=g) for _ in range(world)]
        for n, offset in ((nbytes - 5, 0), (nbytes, 1)):  # whole words; odd bytes off a word
            x = data[rank].to(device)[offset:offset + n]
            got = ws.all_gather(x)
            want = torch.stack([d[offset:offset + n] for d in data])
            assert torch.equal(got.cpu(), want), f"rank {rank}: {n} bytes at offset {offset} differ"
    return True


def test_host_large_exchange_is_bit_exact():
    assert run_workers(_large_worker, 2, args=("host",), timeout=120) == [True] * 2


@requires_gpus(1)
def test_cuda_large_exchange_is_bit_exact_shared_gpu():
    assert run_workers(_large_worker, 2, args=("cuda_shared",), timeout=120) == [True] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_host_tagged_words_are_bit_exact(world):
    assert run_workers(_tagged_bytes_worker, world, args=("host",), timeout=120) == [True] * world


@requires_gpus(GPU_WORLD)
def test_cuda_tagged_words_are_bit_exact():
    assert run_workers(_tagged_bytes_worker, GPU_WORLD, args=("cuda",), timeout=120) == [True] * GPU_WORLD
