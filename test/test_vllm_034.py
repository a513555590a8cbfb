"""The vLLM plugin on vLLM 0.34's shapes (the stand-in's version switch), on
spawned gloo ranks (host backend): the combine with ``out=``, the combine
after the V up-projection (``v_up_proj_combine``), the query gather's early
bound (``direct_query_gather_max_tokens``), the top-K merge with 0.34's
parameters and key (bf16 logits: 16 score bits), and the direct top-K
getter taken over or left to vLLM with one line that says why."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from _dist import run_workers
from _vllm_stand_in import BOUND, H_LOC, Coordinator, D, FakeVllm, Layer, P, W, build_fake_vllm
from _vllm_stand_in import config as _config

from torch_sdcp_plugins import vllm as vllm_entry

K, VH = 16, 8  # top-K, V head dim (128 in DeepSeek-V3; small here)


def _v_up_inputs(world, rows, seed):
    g = torch.Generator().manual_seed(seed)
    heads = world * H_LOC
    w_uv = (torch.randn(heads, D, VH, generator=g) / 4).to(torch.bfloat16)
    per_rank = [((torch.randn(rows, heads, D, generator=g)).to(torch.bfloat16), torch.randn(rows, heads, generator=g))
                for _ in range(world)]
    return w_uv, per_rank


def _merge_inputs(world, rows, seed):
    """Logits whose scores differ below their top 16 bits (ties for a bf16
    key, not for fp32), local top-K positions with holes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        base = torch.randint(-4, 4, (rows, 64), generator=g).float() + 0.5
        logits = base + torch.randint(0, 3, (rows, 64), generator=g).float() * 2 ** -12  # low bits only
        local = torch.stack([torch.randperm(64, generator=g)[:K] for _ in range(rows)]).to(torch.int32)
        local[torch.rand(rows, K, generator=g) < 0.1] = -1
        out.append((logits, local))
    return out


def _worker(rank, world):
    torch.set_num_threads(1)
    ns = build_fake_vllm("0.34.0")
    sys.modules.update(ns.mods)
    group = dist.new_group(backend="gloo")
    ns.coordinator = Coordinator(dist.group.WORLD, {0: group}, lambda: 0)
    from torch_sdcp.integrations import vllm as plugin

    vllm_entry.register()
    assert plugin.is_installed()
    indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
    # The indexer's construction: the direct top-K is not created, the plugin's top-K takes its rows.
    assert indexer.build_indexer("cpu", BOUND, K) == 0
    assert ("_get_direct_dcp_topk_workspace", 0) not in ns.calls
    mgr = Layer(ns, "model.layers.0.self_attn.mla_attn", vllm_config=_config(1, "a2a", index_topk=K, v_head_dim=VH),
                device="cpu", num_heads=H_LOC, query_head_dim=W, output_head_dim=D, query_dtype=torch.bfloat16,
                output_dtype=torch.bfloat16, padded_num_heads=P, is_lse_base_on_e=True, use_pcp=False).dcp_manager
    assert mgr.v_up_proj_combine.func is plugin.dcp_a2a_v_up_proj_lse_reduce
    assert mgr.direct_query_gather_max_tokens == BOUND
    own_v_up = plugin.engine.originals["dcp_a2a_v_up_proj_lse_reduce"]
    own_a2a = plugin.engine.originals["dcp_a2a_lse_reduce"]
    for rows in (3, 16):  # below and above vLLM's 8 rows: latent first, then up-projection first
        w_uv, per_rank = _v_up_inputs(world, rows, seed=rows)
        out_, lse = per_rank[rank]
        got = torch.full((rows, H_LOC * VH), float("nan"), dtype=torch.bfloat16)
        mgr.v_up_proj_combine(out_, lse, w_uv, got)
        want = torch.empty_like(got)
        own_v_up(out_, lse, w_uv, want, mgr.group)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        # The combine's out=: written there, and returned.
        into = torch.empty(rows, H_LOC, D, dtype=torch.bfloat16)
        assert mgr.combine(out_, lse, seq_lens=None, query_start_loc=None).shape == into.shape
        assert plugin.dcp_a2a_lse_reduce(out_, lse, mgr.group, out=into) is into
        torch.testing.assert_close(into.float(), own_a2a(out_, lse, mgr.group).float(), rtol=2e-2, atol=2e-2)
    # The top-K merge, 0.34's parameters: equal to vLLM's own on the same inputs, bf16 key ties included.
    own_merge = plugin.engine.originals["_merge_dcp_topk_global"]
    for dtype in (torch.bfloat16, torch.float32):
        logits, local = _merge_inputs(world, 6, seed=7)[rank]
        got, want = local.clone(), local.clone()
        indexer._merge_dcp_topk_global(logits, got, K, rank, world, 4, logits_dtype=dtype, num_positions=4096)
        own_merge(logits, want, K, rank, world, 4, logits_dtype=dtype, num_positions=4096)
        assert torch.equal(torch.sort(got, dim=1).values, torch.sort(want, dim=1).values), (dtype, got, want)
    merged = [c for c, _ in ns.calls if c in ("_merge_dcp_topk_global", "direct_topk_merge")]
    assert merged == ["_merge_dcp_topk_global"] * 2, merged  # only the reference calls ran vLLM's
    # Rows within a direct bound vLLM kept (its switch set by the user) go to vLLM's own merge.
    import os

    os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "1"
    logits, local = _merge_inputs(world, 4, seed=9)[rank]
    indexer._merge_dcp_topk_global(logits, local.clone(), K, rank, world, 4, direct_max_rows=8)
    assert ns.calls[-1][0] == "direct_topk_merge"
    plugin.uninstall()
    plugin.teardown()
    return True


def test_vllm_034_seams_equal_vllms_own():
    assert run_workers(_worker, 2, timeout=120, env={"SDCP_VLLM": "1"}) == [True, True]



def test_direct_topk_stays_vllms_when_the_user_sets_its_switch(monkeypatch, collect):
    from torch_sdcp.integrations import vllm as plugin

    monkeypatch.setenv("SDCP_VLLM", "1")
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "1")
    with FakeVllm("0.34.0") as ns:
        vllm_entry.register()
        indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
        assert indexer._get_direct_dcp_topk_workspace is plugin._direct_topk_workspace
        assert indexer.build_indexer("cpu", BOUND, K) == BOUND
        assert ("_get_direct_dcp_topk_workspace", 0) in ns.calls
    lines = [m for _, m in collect.records if "direct top-K" in m]
    assert len(lines) == 1 and "VLLM_USE_DIRECT_DCP_A2A=1 set by the user" in lines[0], lines


def test_033_keeps_its_table():
    """On 0.33 nothing of 0.34 is patched, and vLLM's merge gets 0.33's seven arguments."""
    from torch_sdcp.integrations import vllm as plugin

    with FakeVllm("0.33.0") as ns:
        assert plugin.install()
        indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
        assert not hasattr(indexer, "_get_direct_dcp_topk_workspace")
        assert plugin._state.series == "0.33"
        assert "dcp_a2a_v_up_proj_lse_reduce" not in plugin.engine.originals


def test_bf16_selection_scores_key_16_bits():
    from torch_sdcp.integrations.vllm_topk import selection_scores

    s = torch.tensor([[1.0, 1.0 + 2 ** -12, -0.0, 0.0, -math.inf, 2.0]])
    key = selection_scores(s, torch.bfloat16)
    assert key[0, 0] == key[0, 1], "equal in the top 16 bits: a tie"
    assert key[0, 2] < key[0, 3] and key[0, 4] < key[0, 2] and key[0, 5] > key[0, 0]
    assert torch.equal(selection_scores(s, torch.float32), s)
