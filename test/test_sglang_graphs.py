"""The SGLang plugin's three seams captured in one CUDA graph and replayed with
changing inputs, equal to SGLang's own functions (the plain-torch reference of
_sglang_stand_in.py, run on the host over gloo). Two ranks share one GPU
(``allow_shared_device``: correct, not fast); on a GPU machine:

    python -m pytest -q -ra test/test_sglang_graphs.py
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import requires_gpus
from _sglang_stand_in import (
    BOUND,
    H_LOC,
    Coordinator,
    D,
    R,
    ref_all_gather_q_for_mla_decode,
    ref_cp_lse_ag_out_rs_mla,
    ref_dcp_a2a_lse_reduce,
)

ROWS = 6  # one captured batch size below the bound


def _inputs(world, seed):
    g = torch.Generator().manual_seed(seed)
    per_rank = []
    for _ in range(world):
        q_nope = (torch.randn(H_LOC, ROWS, D, generator=g) * 3).to(torch.bfloat16).transpose(0, 1)
        q_pe = (torch.randn(ROWS, H_LOC, R, generator=g) * 3).to(torch.bfloat16)
        out = torch.randn(ROWS, world * H_LOC, D, generator=g).to(torch.bfloat16)
        lse = torch.randn(ROWS, world * H_LOC, generator=g) * 3
        lse[torch.rand(ROWS, world * H_LOC, generator=g) < 0.2] = -math.inf  # empty shards
        per_rank.append((q_nope, q_pe, out, lse))
    return per_rank


def _graph_worker(rank, world):
    from torch_sdcp.integrations import sglang as face

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    coord = Coordinator(dist.group.WORLD)

    def never(*args):
        raise AssertionError("SGLang's own function was called: the seam left peer memory")

    face.configure(dcp_group=lambda: coord, originals=dict.fromkeys(
        ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "all_gather_q_for_mla_decode"), never))
    face.face.options = lambda: {"timeout_s": 120.0, "fallback": True, "allow_shared_device": True}
    done = face.prepare(coord, max_rows=BOUND, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R, dtype=torch.bfloat16,
                        device=device)
    assert done == {"output_lse": True, "query": True}, done

    first = _inputs(world, 0)[rank]
    q_nope_storage = first[0].transpose(0, 1).contiguous().to(device)  # [H, B, D]: q_nope_out is its transpose
    s_q_nope = q_nope_storage.transpose(0, 1)
    s_q_pe, s_out, s_lse = (x.to(device) for x in first[1:])

    def seams():
        q_nope, q_pe = face.all_gather_q_for_mla_decode(s_q_nope, s_q_pe)
        ag_rs = face.cp_lse_ag_out_rs_mla(s_out, s_lse, coord, is_lse_base_on_e=False).transpose(0, 1)
        a2a = face.dcp_a2a_lse_reduce(s_out, s_lse, coord, is_lse_base_on_e=True)
        return q_nope, q_pe, ag_rs, a2a

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream
        seams()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        r_nope, r_pe, r_ag, r_a2a = seams()
    for seed in (1, 2, 3):
        per_rank = _inputs(world, seed)
        q_nope, q_pe, out, lse = per_rank[rank]
        q_nope_storage.copy_(q_nope.transpose(0, 1))
        s_q_pe.copy_(q_pe)
        s_out.copy_(out)
        s_lse.copy_(lse)
        graph.replay()
        torch.cuda.synchronize()
        face.check()
        want_nope, want_pe = ref_all_gather_q_for_mla_decode(q_nope, q_pe, coord)
        assert torch.equal(r_nope.cpu(), want_nope) and torch.equal(r_pe.cpu(), want_pe)
        want_ag = ref_cp_lse_ag_out_rs_mla(out, lse, coord, None, False).transpose(0, 1)
        torch.testing.assert_close(r_ag.cpu(), want_ag, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(r_a2a.cpu(), ref_dcp_a2a_lse_reduce(out, lse, coord, True), rtol=1.6e-2,
                                   atol=1e-2)
    del graph
    face.teardown()
    return True


@requires_gpus(1)
def test_seams_captured_and_replayed_two_ranks_on_one_gpu():
    assert run_workers(_graph_worker, 2, timeout=300) == [True, True]
