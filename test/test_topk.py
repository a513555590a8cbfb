"""Top-K boundary: the local stable selection, the peer merge (host backend at
world sizes 1-4, CUDA on 2 GPUs), opcheck, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from torch_sdcp import ops, reference

from conftest import devices


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
@pytest.mark.parametrize("t,m,k", [(1, 8, 4), (17, 100, 64), (16, 1024, 512), (4, 300, 512), (2, 4096, 2048)])
@pytest.mark.parametrize("nasty", [False, True])
def test_local_select_matches_reference(device, t, m, k, nasty):
    scores, ids = make_candidates(t, m, seed=t * 7 + m, nasty=nasty)
    want = reference.topk_select_ref(scores, ids, k)
    got = ops.topk_select(scores.to(device), ids.to(device), k).cpu()
    assert torch.equal(got, want)


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
