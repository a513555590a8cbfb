"""The benchmark's top-K competitor "vLLM direct" (torch_sdcp.competitors.
vllm_direct_topk) where no GPU is needed: the plain-torch specification against
vLLM 0.34.0's selection semantics (ties, -0.0, -inf, NaN, padding, the fp32
id round trip, 16 score bits), the score the pack stores against that
specification through torch_sdcp's topk_select, and the pack, push and
publish-and-wait Triton kernels under the Triton interpreter with simulated
ranks whose "peer memory" is ordinary CPU tensors, over several calls so that
both slots are used."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import run_workers

import torch_sdcp  # noqa: F401  (registers the sdcp:: ops)
from torch_sdcp import competitors, reference
from torch_sdcp.competitors import _symm
from torch_sdcp.competitors import vllm_direct_topk as vd

INF, NAN = float("inf"), float("nan")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")


def vllm_brute_force(scores: torch.Tensor, ids: torch.Tensor, k: int, score_bits: int = 32) -> list[set]:
    """vLLM's selector as it states it, per row: the k largest 64-bit keys
    (score key << 32 | ~id) among the candidates with an id >= 0; a set, as
    vLLM writes the ids in no defined order."""
    out = []
    for s_row, i_row in zip(scores.tolist(), ids.tolist(), strict=True):
        s = torch.tensor(s_row, dtype=torch.float32)
        key = vd.vllm_score_key(s, score_bits).tolist()
        fid = torch.tensor(i_row, dtype=torch.int32).float().to(torch.int32).tolist()
        keyed = [(key[j] << 32 | (~fid[j] & 0xFFFFFFFF), fid[j]) for j in range(len(fid)) if fid[j] >= 0]
        out.append({i for _, i in sorted(keyed, reverse=True)[:k]})
    return out


def check_spec(scores, ids, k, score_bits=32) -> torch.Tensor:
    got = vd.direct_topk_spec(scores, ids, k, score_bits)
    want = vllm_brute_force(scores, ids, k, score_bits)
    for row, w in zip(got.tolist(), want, strict=True):
        assert set(row) - {-1} == w and row.count(-1) == k - len(w), (row, w)
        assert row[len(w):] == [-1] * (k - len(w))
    return got


def test_module_imports_without_cuda():
    assert competitors.VllmDirectTopK is vd.VllmDirectTopK


def test_direct_rows_bound_is_vllms_workspace_bound():
    assert vd.direct_max_rows() == 4096  # H100/H200 defaults, three MTP draft tokens
    assert vd.direct_max_rows(tokens_per_request=1) == 1024  # no draft tokens
    assert vd.direct_max_rows(max_num_seqs=256, tokens_per_request=1, max_num_batched_tokens=2048) == 512
    assert vd.direct_max_rows(max_num_seqs=4096, tokens_per_request=4) == 8192  # max_num_batched_tokens caps


def test_spec_ranks_as_vllm_states_it():
    # ties to the lower id; -0.0 below +0.0; +NaN above +inf; -NaN below -inf; invalid never.
    scores = torch.tensor([[1.0, 1.0, 2.0, 0.5],
                           [-0.0, 0.0, -1.0, -0.0],
                           [INF, NAN, 3.0, -INF],
                           [-NAN, -INF, -1e30, 5.0]])
    ids = torch.tensor([[9, 4, 7, -1], [1, 8, 2, 0], [3, 6, 5, 2], [0, 7, 2, -3]], dtype=torch.int32)
    got = check_spec(scores, ids, 3)
    assert got.tolist() == [[7, 4, 9], [8, 0, 1], [6, 3, 5], [2, 7, 0]]


def test_spec_pads_and_keeps_neg_inf():
    scores = torch.tensor([[-INF, 2.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    ids = torch.tensor([[5, -1, 4, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    assert check_spec(scores, ids, 3).tolist() == [[4, 5, -1], [-1, -1, -1]]
    assert check_spec(scores, ids, 1).tolist() == [[4], [-1]]  # k = 1


def test_spec_ids_round_trip_through_fp32_and_score_bits():
    # vLLM carries ids as fp32 values: exact below 2^24, rounded above.
    scores = torch.tensor([[1.0, 2.0]])
    ids = torch.tensor([[2**24 + 1, 2**24 + 3]], dtype=torch.int32)
    assert check_spec(scores, ids, 2).tolist() == [[2**24 + 4, 2**24]]
    # 16 score bits: scores equal in their high half tie, the lower id first.
    a = torch.tensor([1.0], dtype=torch.float32).view(torch.int32)
    s = torch.cat([a, a | 0x1234, a - 0x10000]).view(torch.float32).view(1, 3)
    i = torch.tensor([[7, 3, 1]], dtype=torch.int32)
    assert check_spec(s, i, 2, 16).tolist() == [[3, 7]]
    assert check_spec(s, i, 2, 32).tolist() == [[3, 7]]
    assert check_spec(-s, i, 3, 16).tolist() == [[1, 3, 7]]
    with pytest.raises(ValueError, match="score_bits"):
        vd.direct_topk_spec(s, i, 2, 24)


def random_candidates(rows: int, m: int, seed: int, specials: bool = True):
    """Scores with many exact ties, +-0.0, -inf, -FLT_MAX, the smallest
    subnormals, (positive) NaN and invalid ids; no +inf or negative NaN,
    where the reproduction ties what vLLM orders
    (``test_select_score_ties_inf_with_nan``)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-6, 6, (rows, m), generator=g).float() / 4
    ids = torch.randperm(rows * m * 3, generator=g)[: rows * m].view(rows, m).to(torch.int32)
    if specials:
        pick = torch.rand(rows, m, generator=g)
        scores = torch.where(pick < 0.05, -0.0, scores)
        scores = torch.where((pick >= 0.05) & (pick < 0.1), -INF, scores)
        scores = torch.where((pick >= 0.1) & (pick < 0.13), NAN, scores)
        scores = torch.where((pick >= 0.13) & (pick < 0.15), -3.4028234663852886e38, scores)
        scores = torch.where((pick >= 0.15) & (pick < 0.17), 1e-45, scores)
        scores = torch.where((pick >= 0.17) & (pick < 0.19), -1e-45, scores)
        ids = torch.where((pick >= 0.19) & (pick < 0.25), -1, ids)
    return scores, ids


@pytest.mark.parametrize("score_bits", [32, 16])
@pytest.mark.parametrize("rows,m,k", [(1, 16, 4), (5, 64, 16), (7, 40, 64), (3, 32, 1)])
def test_select_score_through_topk_select_is_the_spec(score_bits, rows, m, k):
    scores, ids = random_candidates(rows, m, seed=rows * m + k + score_bits)
    want = vd.direct_topk_spec(scores, ids, k, score_bits)
    fid = ids.float().to(torch.int32)
    shown = vd.select_score(scores, score_bits)
    assert torch.equal(torch.ops.sdcp.topk_select(shown, fid, k), want)
    assert torch.equal(reference.topk_select_ref(shown, fid, k), want)
    # torch_sdcp's own order differs from vLLM's where NaN or -0.0 decide.
    if rows == 5 and score_bits == 32:
        assert not torch.equal(reference.topk_select_ref(scores, fid, k), want)


def test_select_score_ties_inf_with_nan():
    """The one place the reproduction differs from vLLM: +inf and a positive
    NaN tie (vLLM ranks the NaN above), and so do -inf and a negative NaN."""
    scores = torch.tensor([[INF, NAN, 1.0], [-INF, -NAN, -1.0]])
    ids = torch.tensor([[1, 2, 3], [1, 0, 3]], dtype=torch.int32)
    assert vd.direct_topk_spec(scores, ids, 1).tolist() == [[2], [3]]
    shown = vd.select_score(scores)
    assert torch.ops.sdcp.topk_select(shown, ids, 1).tolist() == [[1], [3]]
    assert vd.direct_topk_spec(scores, ids, 2).tolist() == [[2, 1], [3, 1]]
    assert torch.ops.sdcp.topk_select(shown, ids, 2).tolist() == [[1, 2], [3, 0]]


def _signals(n: int):
    sig = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    return sig, [_symm.element_offsets(sig, sig[r], "cpu") for r in range(n)]


def _publish_each(sig, offs, status, call):
    """Every rank's publish-and-wait, one after another, each with its peers'
    epochs pre-set to this call's (they published) and its own at the last."""
    for r in range(len(sig)):
        for p in range(len(sig)):
            sig[p][0] = call if p != r else call - 1
        vd.publish_and_wait(sig[r][:1], offs[r], status, max_spins=10)
        assert int(sig[r][0]) == call and int(status[0]) == 0


def _interpreted_direct(rank, world, n, c, k, max_rows, calls):
    # Runs with TRITON_INTERPRET=1: the kernels execute on CPU tensors.
    inbox = [torch.zeros(2, 2, max_rows, n, c) for _ in range(n)]
    offs = [_symm.element_offsets(inbox, inbox[r], "cpu") for r in range(n)]
    sig, sig_offs = _signals(n)
    status = torch.zeros(1, dtype=torch.int32)
    packed = [torch.empty(2 * max_rows * c) for _ in range(n)]
    for call in range(calls):
        rows = (max_rows, 1, 3)[call % 3]
        slot = call & 1
        shards = [random_candidates(rows, c, seed=100 * call + r) for r in range(n)]
        before = [x[1 - slot].view(torch.int32).clone() for x in inbox]
        for r in range(n):  # every rank pushes before any selects (the publish round)
            vd.pack_candidates(*shards[r], packed[r], 32)
            torch.testing.assert_close(packed[r][: rows * c].view(rows, c), vd.select_score(shards[r][0]),
                                       equal_nan=True, rtol=0, atol=0)
            vd.push_candidates(packed[r], inbox[r], offs[r], slot, r, rows)
        _publish_each(sig, sig_offs, status, call + 1)
        union = (torch.cat([s for s, _ in shards], dim=1), torch.cat([i for _, i in shards], dim=1))
        want = vd.direct_topk_spec(*union, k)
        for r in range(n):
            got = vd.select_from_inbox(inbox[r], slot, rows, k)
            assert torch.equal(got, want), (call, r)
            assert torch.equal(inbox[r][1 - slot].view(torch.int32), before[r]), (call, r)  # other slot as it was
    return calls


@needs_triton
def test_direct_kernels_under_the_triton_interpreter():
    res = run_workers(_interpreted_direct, 1, args=(3, 32, 16, 4, 5), env={"TRITON_INTERPRET": "1"}, timeout=240)
    assert res == [5]


def _interpreted_publish(rank, world):
    sig, offs = _signals(1)
    status = torch.zeros(1, dtype=torch.int32)
    for call in range(1, 4):  # world 1: its own epoch is all it waits for
        vd.publish_and_wait(sig[0][:1], offs[0], status, max_spins=0)
        assert int(sig[0][0]) == call
    sig, offs = _signals(3)
    sig[1][0] = 1  # rank 2 never publishes: rank 0 gives up after max_spins
    with pytest.raises(RuntimeError, match="did not publish within 5 spins"):
        vd.publish_and_wait(sig[0][:1], offs[0], status, max_spins=5)
    assert int(sig[0][0]) == 1
    # The pack with 16 score bits stores select_score's bits too.
    scores, ids = random_candidates(3, 40, seed=7)
    packed = torch.empty(2 * 3 * 40)
    vd.pack_candidates(scores, ids, packed, 16)
    assert torch.equal(packed[:120].view(3, 40).view(torch.int32), vd.select_score(scores, 16).view(torch.int32))
    assert torch.equal(packed[120:].view(3, 40).view(torch.int32), ids.float().to(torch.int32))
    return 1


@needs_triton
def test_publish_and_wait_is_bounded_under_the_triton_interpreter():
    assert run_workers(_interpreted_publish, 1, env={"TRITON_INTERPRET": "1"}, timeout=240) == [1]


def test_bench_cell_skips_over_the_bound_and_needs_cuda(world1):
    """The bench's "vllm_direct" cell: rows over vLLM's direct bound are
    skipped with the reason (no rank enters a collective); on the host backend
    the path says it needs CUDA; the legend names what it reproduces."""
    import types

    from torch_sdcp.bench import boundaries, report

    ctx = types.SimpleNamespace(device=torch.device("cpu"), k=4, timer=None)
    over = vd.direct_max_rows() + 1
    comps: dict = {}
    cell = boundaries.vllm_direct(ctx, comps, over, torch.zeros(over, 4), torch.zeros(over, 4, dtype=torch.int32))
    assert cell["error"].startswith(f"skipped: {over} rows are over vLLM 0.34.0's direct bound, 4096 rows")
    cell = boundaries.vllm_direct(ctx, comps, 8, torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.int32))
    assert cell == {"error": "RuntimeError: needs CUDA symmetric memory"} and not comps
    legend = "\n".join(report.legend(["topk"]))
    assert "topk / vLLM direct: a reproduction of vLLM 0.34.0's DirectDCPTopKWorkspace" in legend
    assert "sdcp::topk_select" in legend and report.PATH_NAMES["vllm_direct"] == "vLLM direct"
