"""Top-K boundary: the local stable selection, the peer merge (host backend at
world sizes 1-4, CUDA on 2 GPUs or SDCP_GPU_WORLD, and 2, 4 and 8 ranks sharing
one GPU), opcheck, torch.compile,
CUDA graphs, many calls with random per-rank delays, and the failures of a
call: call headers that disagree, poisoning and aborts."""

from __future__ import annotations

import random
import re
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
    rank_candidates,
    rank_workspace_args,
    requires_gpus,
)

from torch_sdcp import ops, reference
from torch_sdcp.workspaces import WorkspaceKind


def make_candidates(t, c, *, seed=0, id_base=0, stride=1, nasty=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, c, generator=g)
    ids = (torch.randperm(t * c, generator=g)[: t * c].view(t, c) * stride + id_base).to(torch.int32)
    if nasty:
        scores = torch.round(scores * 2) / 2  # many ties
        scores[:, ::7] = float("nan")
        scores[:, 1::11] = float("inf")
        scores[:, 2::13] = -float("inf")
        scores[:, 3::17] = -0.0
        scores[:, 4::17] = 0.0
        ids[:, 5::19] = -1
    return scores, ids


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("t,m,k", [(1, 8, 4), (17, 100, 64), (16, 1024, 512), (4, 300, 512), (2, 4096, 2048),
                                   (3, 2049, 7), (2, 5000, 3000), (2, 16384, 2048), (1, 65, 100)])
@pytest.mark.parametrize("nasty", [False, True])
def test_local_select_matches_reference(device, t, m, k, nasty):
    scores, ids = make_candidates(t, m, seed=t * 7 + m, nasty=nasty)
    want = reference.topk_select_ref(scores, ids, k)
    got = ops.topk_select(scores.to(device), ids.to(device), k).cpu()
    assert torch.equal(got, want)


DISTRIBUTIONS = ("uniform", "normal", "tied80", "tied20", "tied5", "equal", "equal_nonfinite", "outlier",
                 "ids_spread")


def distribution(kind, t, c, *, seed=0):
    """Scores and ids [t, c] of one shape of score distribution: the four the
    bench times (uniform, normal, 80 distinct values, all equal), one far
    outlier that squeezes every other score into one bucket of the float
    range, and equal scores whose ids differ by powers of two (the ranks
    separate on the id bits only). 20 and 5 distinct values leave about 100
    and 400 keys per score at 2048 candidates (ranked by counting, and split
    on the id bits); equal_nonfinite mixes one finite score with NaN, +-inf
    and invalid ids (the sort buckets such a row on the id)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(t * c, generator=g).view(t, c).to(torch.int32)
    if kind == "uniform":
        scores = torch.rand(t, c, generator=g)
    elif kind == "normal":
        scores = torch.randn(t, c, generator=g)
    elif kind == "tied80":
        scores = torch.randint(0, 80, (t, c), generator=g).float() * 0.37 - 5.0
    elif kind == "tied20":
        scores = torch.randint(0, 20, (t, c), generator=g).float() - 10.0
    elif kind == "tied5":
        scores = torch.randint(0, 5, (t, c), generator=g).float() * 1e-3
    elif kind == "equal":
        scores = torch.full((t, c), 1.5)
    elif kind == "equal_nonfinite":
        scores = torch.full((t, c), -2.25)
        scores[:, 3::11] = float("nan")
        scores[:, 5::13] = float("inf")
        scores[:, 7::17] = -float("inf")
        ids[:, 2::19] = -1
        ids[:, 0] = 2**31 - 1
    elif kind == "outlier":
        scores = torch.randn(t, c, generator=g)
        scores[:, c // 2] = 3e38
        scores[:, c // 3] = -3e38
    elif kind == "ids_spread":
        scores = torch.zeros(t, c)
        j = torch.arange(c)
        ids = torch.where(j < 31, (2 ** j.clamp(max=30)) - 1, 2**31 - 1 - j).to(torch.int32).repeat(t, 1)
    else:
        raise ValueError(kind)
    return scores.contiguous(), ids.contiguous()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("t,m,k", [(3, 2048, 2048), (2, 4096, 2048), (2, 2048, 100), (1, 16384, 2048),
                                   (2, 33, 33), (1, 5000, 3000)])
def test_local_select_distributions(device, kind, t, m, k):
    scores, ids = distribution(kind, t, m, seed=m + k)
    want = reference.topk_select_ref(scores, ids, k)
    got = ops.topk_select(scores.to(device), ids.to(device), k).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", devices())
def test_local_select_all_invalid_nan_and_inf(device):
    t, m, k = 4, 2048, 2048
    scores, ids = distribution("normal", t, m, seed=3)
    scores[0] = float("nan")                     # every score NaN: ordered by id
    scores[1] = -float("inf")                    # every score -inf
    scores[2, ::2] = float("inf")                # half +inf, half -inf
    scores[2, 1::2] = -float("inf")
    ids[3] = -1                                  # no valid candidate
    ids[3, 7] = 2**31 - 1
    ids[3, 9] = -2**31                           # any negative id is invalid
    want = reference.topk_select_ref(scores, ids, k)
    got = ops.topk_select(scores.to(device), ids.to(device), k).cpu()
    assert torch.equal(got, want)
    assert got[3, 0] == 2**31 - 1 and (got[3, 1:] == -1).all()


@pytest.mark.parametrize("device", devices())
def test_local_select_ties_and_ids_near_int_max(device):
    t, m, k = 3, 64, 16
    scores = torch.zeros(t, m)
    ids = (2**31 - 1 - torch.arange(m, dtype=torch.int64)).to(torch.int32).repeat(t, 1)
    got = ops.topk_select(scores.to(device), ids.to(device), k).cpu()
    want = torch.sort(ids[:, :].long(), dim=1).values[:, :k].to(torch.int32)  # all tied: lowest ids first
    assert torch.equal(got, want)
    ids[:] = -1  # an owner with no valid candidates
    assert (ops.topk_select(scores.to(device), ids.to(device), k) == -1).all()


@pytest.mark.parametrize("device", devices())
def test_local_select_rejects_bad_input(device):
    scores, ids = make_candidates(2, 16)
    scores, ids = scores.to(device), ids.to(device)
    with pytest.raises(ValueError, match="'ids'.*dtype"):
        ops.topk_select(scores, ids.long(), 4)
    with pytest.raises(ValueError, match="'k'.*k >= 1"):
        ops.topk_select(scores, ids, 0)
    with pytest.raises(ValueError, match="'scores'.*unit stride"):
        ops.topk_select(scores.t(), ids.t(), 1)


@pytest.mark.parametrize("device", devices())
def test_local_select_opcheck(device):
    for t, m, k in [(1, 8, 4), (5, 33, 40), (3, 64, 8)]:
        scores, ids = make_candidates(t, m, nasty=True)
        torch.library.opcheck(torch.ops.sdcp.topk_select.default, (scores.to(device), ids.to(device), k))


def test_local_select_compiles_fullgraph():
    scores, ids = make_candidates(4, 64, nasty=True)
    f = torch.compile(lambda s, i: ops.topk_select(s, i, 16), fullgraph=True)
    assert torch.equal(f(scores, ids), ops.topk_select(scores, ids, 16))


# ---------------------------------------------------------------------------
# Peer merge: each owner publishes its shard in place; every consumer selects
# over all shards. The set (and order) must be identical on every rank.
# ---------------------------------------------------------------------------


def _global_candidates(world, t, c, seed, nasty, kind=None):
    shards = []
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(world * t * c, generator=g).view(world, t, c)
    for r in range(world):
        if kind is None:
            scores, _ = make_candidates(t, c, seed=seed * 31 + r, nasty=nasty)
        else:
            scores, _ = distribution(kind, t, c, seed=seed * 31 + r)
        ids = perm[r].to(torch.int32)
        if nasty:
            ids[:, 5::19] = -1
            if r == world - 1:
                ids[:] = -1  # an owner with no valid candidates
            elif r == 1 and c > 8:
                ids[:, 8:] = -1  # an owner with fewer than k valid candidates
            ids[:, 0] = 2**31 - 1 - r  # ids near 2^31
            scores[:, 0] = 1.0
        shards.append((scores, ids))
    return shards


def _peer_merge_worker(rank, world, backend, cases, max_rows, shared=False):
    import torch_sdcp

    device = torch.device("cuda", 0 if shared else rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    picked = []
    cases = [case if len(case) == 5 else (*case, None) for case in cases]
    for k, c in sorted({(k, c) for _, k, c, _, _ in cases}):
        if k > world * c:
            continue
        with torch_sdcp.TopKWorkspace(None, max_rows, k, candidates_per_rank=c, backend=backend,
                                      device=device, allow_shared_device=shared) as ws:
            for i, (t, kk, cc, nasty, kind) in enumerate(cases):
                if (kk, cc) != (k, c):
                    continue
                shards = _global_candidates(world, t, c, seed=t + k + i, nasty=nasty, kind=kind)
                got = ws.merge(shards[rank][0].to(device), shards[rank][1].to(device)).cpu()
                assert torch.equal(got, reference.topk_merge_ref(shards, k)), f"rank {rank} t={t} k={k}"
                picked.append(got)
    return picked


HOST_CASES = [(1, 512, 512, True), (16, 512, 1024, False), (17, 1024, 1024, True), (64, 512, 512, True),
              (3, 2048, 2048, True), (4, 20, 16, True), (0, 512, 512, False), (5, 7, 3, True),
              (3, 33, 9, True)] + [(2, 2048, 2048, False, kind) for kind in DISTRIBUTIONS]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_peer_merge_host_identical_on_every_rank(world):
    picked = run_workers(_peer_merge_worker, world, args=("host", HOST_CASES, 64), timeout=240)
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[r], strict=False))


GPU_CASES = [(t, k, k, nasty) for t in (1, 16, 17, 64, 96, 128) for k in (512, 1024, 2048)
             for nasty in (t % 2 == 1,)] + [
    (9, 2048, 4096, True),  # an owner sorts two chunks
    (5, 100, 300, False),   # C > k, k not a power of two
    (3, 77, 77, True),      # odd shard rows (no 16-byte vectors)
    (4, 20, 16, True),      # C < k
    (0, 2048, 2048, False),  # no rows: one warp stores and checks the call headers
    (200, 512, 512, True),  # more rows than SMs: a block handles several rows
] + [(t, 2048, 2048, False, kind) for t in (1, 64) for kind in DISTRIBUTIONS]


# Two ranks time-slicing one GPU (correctness only: every wait lasts until the
# other process's kernel gets the GPU): the CUDA peer path on a one-GPU machine.
SHARED_GPU_CASES = [(1, 2048, 2048, False), (17, 1024, 1024, True), (3, 77, 77, True), (2, 2048, 4096, True),
                    (0, 2048, 2048, False), (2, 2048, 2048, False, "tied80"), (2, 2048, 2048, False, "equal")]


# SDCP_TOPK_TREE: "1" merges the peers' lists in a tree (csrc/topk_cuda.cu, tree_merge), "0" one after the
# other; the ranks' processes read it at their first launch.
TREE = pytest.mark.parametrize("tree", ["0", "1"])


@requires_gpus(1)
@TREE
def test_peer_merge_cuda_two_ranks_on_one_gpu(tree, monkeypatch):
    monkeypatch.setenv("SDCP_TOPK_TREE", tree)
    picked = run_workers(_peer_merge_worker, 2, args=("cuda", SHARED_GPU_CASES, 32, True), timeout=300)
    assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[1], strict=False))
    assert len(picked[0]) == len(SHARED_GPU_CASES)


# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only): rows
# 0, 1 and max_rows, ties, NaN / +-inf scores, invalid ids, owners with fewer
# than k or no valid candidates, odd shard rows. k = 4,096: with the tree on,
# the tree at DCP4 (k-key slots) and the one-list-at-a-time merge at DCP8,
# whose tree would not fit in shared memory.
SHARED_GPU_WORLD_CASES = [(1, 512, 512, True), (32, 1024, 1024, True), (0, 512, 512, False), (3, 77, 77, True),
                          (2, 2048, 2048, False, "tied80"), (2, 2048, 2048, False, "equal_nonfinite"),
                          (2, 4096, 4096, True)]


@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
@TREE
def test_peer_merge_cuda_shared_gpu(world, tree, monkeypatch):
    monkeypatch.setenv("SDCP_TOPK_TREE", tree)
    picked = run_workers(_peer_merge_worker, world, args=("cuda", SHARED_GPU_WORLD_CASES, 32, True), timeout=240)
    assert len(picked[0]) == len(SHARED_GPU_WORLD_CASES)
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[r], strict=False))


# World sizes that are not a power of two: with the tree on, its last lists
# are empty (3: one level merges a list with nothing; 6: two).
ODD_WORLD_CASES = [(1, 2048, 2048, True), (3, 77, 77, True), (5, 512, 1024, False), (2, 2048, 2048, False, "tied80")]


@requires_gpus(1)
@pytest.mark.parametrize("world", [3, 6])
@TREE
def test_peer_merge_cuda_shared_gpu_worlds_not_a_power_of_two(world, tree, monkeypatch):
    monkeypatch.setenv("SDCP_TOPK_TREE", tree)
    picked = run_workers(_peer_merge_worker, world, args=("cuda", ODD_WORLD_CASES, 8, True), timeout=240)
    assert len(picked[0]) == len(ODD_WORLD_CASES)
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[r], strict=False))


@requires_gpus(GPU_WORLD)
@TREE
def test_peer_merge_cuda(tree, monkeypatch):
    monkeypatch.setenv("SDCP_TOPK_TREE", tree)
    picked = run_workers(_peer_merge_worker, GPU_WORLD, args=("cuda", GPU_CASES, 256), timeout=400)
    for r in range(1, GPU_WORLD):
        assert all(torch.equal(a, b) for a, b in zip(picked[0], picked[r], strict=False))


def _graph_worker(rank, world, replays):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    t, k = 64, 2048
    with torch_sdcp.TopKWorkspace(None, 128, k, device=device) as ws:
        shards = _global_candidates(world, t, k, seed=0, nasty=False)
        s_in, i_in = shards[rank][0].to(device), shards[rank][1].to(device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            res = ws.merge(s_in, i_in)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = ws.merge(s_in, i_in)
        for r in range(replays):
            check = r % 100 == 0 or r == replays - 1
            if check:
                shards = _global_candidates(world, t, k, seed=r + 1, nasty=r % 200 == 0)
                s_in.copy_(shards[rank][0])
                i_in.copy_(shards[rank][1])
            graph.replay()
            if check:
                assert torch.equal(res.cpu(), reference.topk_merge_ref(shards, k)), f"replay {r}"
        f = torch.compile(ws.merge, fullgraph=True)
        shards = _global_candidates(world, t, k, seed=99, nasty=True)
        assert torch.equal(f(shards[rank][0].to(device), shards[rank][1].to(device)).cpu(),
                           reference.topk_merge_ref(shards, k))
    return replays


@requires_gpus(GPU_WORLD)
def test_peer_merge_cuda_graph_replay_and_compile():
    assert run_workers(_graph_worker, GPU_WORLD, args=(1000,), timeout=400) == [1000] * GPU_WORLD


def test_peer_merge_opcheck_and_compile_world1(world1):
    import torch_sdcp

    for device in devices():
        with torch_sdcp.TopKWorkspace(world1, 8, 16, candidates_per_rank=32, device=torch.device(device),
                                      backend="cuda" if device == "cuda" else "host") as ws:
            scores, ids = make_candidates(5, 32, nasty=True)
            scores, ids = scores.to(device), ids.to(device)
            torch.library.opcheck(torch.ops.sdcp.topk_merge.default, (scores, ids, ws.handle, 16))
            f = torch.compile(ws.merge, fullgraph=True)
            assert torch.equal(f(scores, ids).cpu(), reference.topk_select_ref(scores.cpu(), ids.cpu(), 16))
            with pytest.raises(ValueError, match="'scores'.*candidates_per_rank = 32"):
                ws.merge(scores[:, :16].contiguous(), ids[:, :16].contiguous())


# World 1 on one GPU: up to one row per SM the merge kernel runs without a
# row loop (grid = rows), past it a block loops over rows; either side of the
# SM count, plain and nasty, against the reference.
@requires_gpus(1)
def test_peer_merge_cuda_world1_either_side_of_the_sm_count(world1):
    import torch_sdcp

    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    k = 512
    with torch_sdcp.TopKWorkspace(world1, sms + 200, k, candidates_per_rank=k, backend="cuda",
                                  device=device) as ws:
        for rows in (1, sms, sms + 1, sms + 200):
            for nasty in (False, True):
                scores, ids = make_candidates(rows, k, seed=rows, nasty=nasty)
                got = ws.merge(scores.to(device), ids.to(device)).cpu()
                assert torch.equal(got, reference.topk_merge_ref([(scores, ids)], k)), (rows, nasty)


def _many_calls_worker(rank, world, calls, backend):
    import torch_sdcp

    device = torch.device("cuda", rank) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    rng = random.Random(rank)  # delays differ per rank; shapes agree (seeded by the call)
    k, c = 24, 16
    with torch_sdcp.TopKWorkspace(None, 6, k, candidates_per_rank=c, backend=backend, device=device,
                                  timeout_s=60) as ws:
        for e in range(calls):
            if rng.random() < 0.01:  # random per-rank delays
                time.sleep(rng.random() * 0.003)
            t = e % 7  # the row count changes every call (0 included)
            shards = _global_candidates(world, t, c, seed=e, nasty=e % 3 == 0,
                                        kind=None if e % 4 else DISTRIBUTIONS[e // 4 % len(DISTRIBUTIONS)])
            got = ws.merge(shards[rank][0].to(device), shards[rank][1].to(device)).cpu()
            if not torch.equal(got, reference.topk_merge_ref(shards, k)):
                raise AssertionError(f"rank {rank} call {e}: wrong ids")
    return calls


@pytest.mark.parametrize("world,calls", [(2, 2000), (3, 600), (4, 400)])
def test_peer_merge_host_many_calls_random_delays(world, calls):
    assert run_workers(_many_calls_worker, world, args=(calls, "host"), timeout=300) == [calls] * world


@requires_gpus(GPU_WORLD)
def test_peer_merge_cuda_many_calls_random_delays():
    assert run_workers(_many_calls_worker, GPU_WORLD, args=(10000, "cuda"), timeout=600) == [10000] * GPU_WORLD


# ---------------------------------------------------------------------------
# Call headers, poisoning and aborts (host backend; then CUDA, 2 GPUs and both
# ranks on one GPU)
# ---------------------------------------------------------------------------


TOPK_K, TOPK_C = 16, 32


def _topk_every(rows, seed, world):
    return [rank_candidates(rows, TOPK_C, seed=seed * 97 + r) for r in range(world)]


def _topk_mismatch_worker(rank, world, device):
    import torch_sdcp
    from torch_sdcp import reference

    dev = rank_workspace_args(rank, device)
    cases = [  # (what differs, rank 0's rows, rank 1's rows, expected text)
        ("rows", 4, 8, "rank 0 called with 4 rows, rank 1 with 8 rows"),
        ("rows0", 0, 3, "rank 0 called with 0 rows, rank 1 with 3 rows"),
        ("rows0-last", 5, 0, "rank 0 called with 5 rows, rank 1 with 0 rows"),
    ]
    for _name, *rows, text in cases:
        with torch_sdcp.TopKWorkspace(None, 8, TOPK_K, candidates_per_rank=TOPK_C, timeout_s=60, **dev) as ws:
            every = _topk_every(2, 1, world)
            got = ws.merge(*(x.to(ws.device) for x in every[rank])).cpu()  # a good call first: the workspace works
            assert torch.equal(got, reference.topk_merge_ref(every, TOPK_K))
            s, i = (x.to(ws.device) for x in rank_candidates(rows[min(rank, 1)], TOPK_C, seed=rank))
            match = f"call mismatch \\(topk workspace .*\\): {re.escape(text)}"
            if world > 2:  # rank 0 against all the others: the pair a rank finds first varies, or an abort tells it
                pair = re.escape(text).replace(re.escape("rank 1 "), r"rank \d+ ")
                match = (f"call mismatch \\(topk workspace .*\\): {pair}"
                         r"|peer \d+ aborted: its call differs from a peer's \(call mismatch\)")
            # The kernels end at once: neither rank waits for rows that never come.
            expect_failure(ws, device, lambda: ws.merge(s, i), match)
            expect_poisoned(ws, lambda: ws.merge(s, i))
    # A re-created workspace works, calls without rows included (they carry headers too).
    with torch_sdcp.TopKWorkspace(None, 8, TOPK_K, candidates_per_rank=TOPK_C, timeout_s=60, **dev) as ws:
        for e, rows in enumerate((3, 0, 2, 0, 0, 8, 1)):
            every = _topk_every(rows, 10 + e, world)
            got = ws.merge(*(x.to(ws.device) for x in every[rank])).cpu()
            assert torch.equal(got, reference.topk_merge_ref(every, TOPK_K)), (e, rows)
        if device != "host":
            torch.cuda.synchronize()
        ws.check()
    if device != "host":
        assert torch.ones(4, device="cuda").sum().item() == 4.0  # the context is alive
    return True


@pytest.mark.parametrize("world", [2, 4])  # 4: rank 0 against three ranks, as on one GPU at DCP4
def test_topk_mismatched_rows_raise_on_every_rank_naming_both_sides(world):
    assert run_workers(_topk_mismatch_worker, world, args=("host",), timeout=180) == [True] * world


def _topk_carry_on_worker(rank, world, device):
    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp import reference

    dev = rank_workspace_args(rank, device)
    control = dist.new_group(list(range(world)))  # orders the ranks' steps, apart from the workspace
    every = _topk_every(2, 3, world)
    s, i = (x.to(dev.get("device", "cpu")) for x in every[rank])
    big_s, big_i = (x.to(dev.get("device", "cpu")) for x in rank_candidates(6, TOPK_C, seed=rank))
    ws = torch_sdcp.TopKWorkspace(None, 4, TOPK_K, candidates_per_rank=TOPK_C, timeout_s=120, **dev)
    assert torch.equal(ws.merge(s, i).cpu(), reference.topk_merge_ref(every, TOPK_K))
    dist.barrier(group=control)
    if rank == 0:
        time.sleep(1.0)  # rank 1 is waiting in its call by now
        try:  # no tensor tells the rows: no void placeholder, so the call poisons
            ws.merge(s.tolist(), i.tolist())
        except ValueError as e:
            assert "argument 'scores': expected a Tensor" in str(e), e
        # ... and carries on: every later call raises, the collective path included
        expect_poisoned(ws, lambda: ws.merge(s, i))
        expect_poisoned(ws, lambda: ws.merge(big_s, big_i))
    else:
        # At once, not after the 120 s timeout (on CUDA the kernel finds rank 0's abort word in its first slow poll).
        expect_failure(ws, device, lambda: ws.merge(s, i), "peer 0 aborted: a call raised an error on that rank",
                       within=20)
        expect_poisoned(ws, lambda: ws.merge(s, i))
    expect_poisoned(ws, ws.check)
    dist.barrier(group=control)
    ws.resize(4)  # re-creation (collective) clears the poison
    assert not ws.poisoned
    assert torch.equal(ws.merge(s, i).cpu(), reference.topk_merge_ref(every, TOPK_K))
    if device != "host":
        torch.cuda.synchronize()
    ws.check()
    ws.close()
    return True


def test_topk_error_inside_a_call_poisons_and_aborts_the_peer():
    assert run_workers(_topk_carry_on_worker, 2, args=("host",), timeout=180) == [True, True]


def _topk_geometry_worker(rank, world):
    import torch_sdcp
    from torch_sdcp.peer.plan import RankMismatchError

    # k and C swapped: min(C, k) and so the region size agree, the calls would not.
    k, c = (16, 32) if rank == 0 else (32, 16)
    with pytest.raises(RankMismatchError, match=r"expected the same value on every rank.*'candidates_per_rank' "
                                                r"\(rank 0: 32, rank 1: 16\); argument 'k' \(rank 0: 16, rank 1: 32\)"):
        torch_sdcp.TopKWorkspace(None, 8, k, candidates_per_rank=c, **HOST)
    with pytest.raises(RankMismatchError, match=r"'max_rows' \(rank 0: 8, rank 1: 4\)"):
        torch_sdcp.TopKWorkspace(None, 8 - 4 * rank, 16, candidates_per_rank=32, **HOST)
    with torch_sdcp.TopKWorkspace(None, 8, 16, candidates_per_rank=32, **HOST) as ws:  # the ranks are still in step
        ws.merge(*rank_candidates(2, 32, seed=rank))
        ws.check()
    return True


def test_topk_geometry_mismatch_is_refused_at_creation():
    assert run_workers(_topk_geometry_worker, 2, timeout=120) == [True, True]


@requires_gpus(2)
def test_cuda_topk_mismatched_rows_raise_on_every_rank():
    assert run_workers(_topk_mismatch_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
def test_cuda_topk_error_inside_a_call_aborts_the_waiting_peer():
    assert run_workers(_topk_carry_on_worker, 2, args=("cuda",), timeout=300) == [True, True]


# Both ranks on one GPU (time-sliced): the CUDA failure paths where one GPU is
# all there is.
@requires_gpus(1)
@pytest.mark.parametrize("worker", [_topk_mismatch_worker, _topk_carry_on_worker], ids=lambda w: w.__name__.strip("_"))
def test_cuda_two_ranks_on_one_gpu(worker):
    assert run_workers(worker, 2, args=("cuda_shared",), timeout=300) == [True, True]


# Four ranks on one GPU, in one spawn: rank 0 against the three others is a
# mismatch on every rank; rank 0's error inside a call reaches the three ranks
# waiting in it.
@requires_gpus(1)
def test_cuda_four_ranks_shared_gpu():
    steps = ((_topk_mismatch_worker, ("cuda_shared",)), (_topk_carry_on_worker, ("cuda_shared",)))
    assert run_workers(in_turn, 4, args=steps, timeout=180) == [[True, True]] * 4


def test_workspace_fits_the_target_at_128_rows():
    # Two buffers of one peer entry of 128 rows x 2048 sorted 8-byte keys, plus
    # control and tail: 6 MiB after rounding to a 2 MiB granularity at DCP2.
    mib = 2**20

    def rounded(world):
        nbytes = torch.ops.sdcp.workspace_nbytes(int(WorkspaceKind.TOPK), [128, 2048, 2048], world)
        assert nbytes > 2 * (world - 1) * 128 * 2048 * 8
        return -(-nbytes // (2 * mib)) * 2 * mib

    assert rounded(2) == 6 * mib
    assert rounded(4) == 14 * mib and rounded(8) == 30 * mib
    with pytest.raises(ValueError, match="'k'.*at most world_size \\* candidates_per_rank = 64"):
        torch.ops.sdcp.workspace_nbytes(int(WorkspaceKind.TOPK), [8, 32, 65], 2)
