"""The vLLM plugin (torch_sdcp.integrations.vllm) without vLLM: a stand-in (_vllm_stand_in.py)
for the parts of vLLM 0.33.0 the plugin touches (module paths, signatures,
the MLADCPManager construction protocol, the sparse indexer's call through
its module global, dbo_current_ubatch_id, get_dcp_group), then vLLM's call
protocol replayed on the host backend by spawned gloo ranks: masking with
empty shards and CUDA-graph padding rows, both combine backends and LSE
bases, the query gather with padded head storage, the top-K merge in place,
two micro-batches on two threads, rows up to the 512-row bound and the
fallback to vLLM's own functions above it. In-process: the setting, the
version refusal, idempotent and reversible patching, the peer-memory gate,
argument errors, and where the top-K order agrees with vLLM's selector.

The stand-in is written from vLLM 0.33.0's call sites as docs/VLLM.md
describes them; test_vllm_conformance.py checks them against a real vLLM's
sources.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import requires_gpus
from _vllm_stand_in import BOUND, H_LOC, Coordinator, D, FakeVllm, Layer, P, W, _Collect, build_fake_vllm
from _vllm_stand_in import config as _config
from _vllm_stand_in import mask_loop as _mask_loop
from _vllm_stand_in import vllm_select as _vllm_select

from torch_sdcp import reference
from torch_sdcp.integrations import vllm_calls, vllm_topk
from torch_sdcp.integrations._boundaries import query_direct
from torch_sdcp_plugins import vllm as vllm_entry
from torch_sdcp_settings import VLLM

# ---------------------------------------------------------------------------
# Inputs of one decode step, for every rank (seeded: each rank rebuilds all)
# ---------------------------------------------------------------------------

K, L, I = 16, 64, 4  # top-K, local tokens per rank, KV interleave


def _combine_inputs(world, rows, seed):
    """Per rank (out [T, H, D] bf16, lse [T, H]) and the shared masking
    metadata: requests of 1-3 rows (speculative decoding), rows past the last
    request are CUDA-graph padding; per rank local seq_lens with zeros (empty
    shards) whose rows carry garbage: a large finite LSE and NaN payload."""
    g = torch.Generator().manual_seed(seed)
    heads = world * H_LOC
    real = rows if rows < 4 else rows - 1 - int(torch.randint(0, 3, (1,), generator=g))
    lens = []
    while sum(lens) < real:
        lens.append(min(int(torch.randint(1, 4, (1,), generator=g)), real - sum(lens)))
    qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    per_rank = []
    for _ in range(world):
        out = torch.randn(rows, heads, D, generator=g).to(torch.bfloat16)
        lse = torch.randn(rows, heads, generator=g) * 3
        seq_lens = torch.randint(0, 40, (len(lens),), generator=g, dtype=torch.int32)
        seq_lens[torch.rand(len(lens), generator=g) < 0.3] = 0
        masked = _mask_loop(torch.zeros(rows, 1), seq_lens, qsl)[:, 0] == -math.inf
        lse[masked] = 80.0  # would dominate if it got a weight
        out[masked] = float("nan")
        per_rank.append((out, lse, seq_lens))
    return per_rank, qsl


def _combine_expected(per_rank, qsl, rank, world, base2):
    out = torch.stack([o for o, _, _ in per_rank])
    lse = torch.stack([_mask_loop(l_, s, qsl) for _, l_, s in per_rank])
    ref_out, ref_lse = reference.lse_combine_ref64(out, lse, base2=base2)
    return reference.output_lse_shard(ref_out, ref_lse, rank, world)


def _query_inputs(world, rows, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, H_LOC, W, generator=g) * 4).to(dtype) for _ in range(world)]


def _global_of(world):
    """table[r][j] = the global token at local index j of rank r (by brute
    force over the ownership rule)."""
    table = torch.empty(world, L, dtype=torch.int64)
    for gt in range(world * L):
        owner = (gt // I) % world
        local = (gt // (I * world)) * I + gt % I
        table[owner, local] = gt
    return table


def _topk_inputs(world, rows, seed):
    """Per rank (logits [T, L + 8] fp32 with row_starts offsets, the local
    top-K positions [T, K] with -1 holes) and the expected global candidates."""
    g = torch.Generator().manual_seed(seed)
    table = _global_of(world)
    row_starts = torch.randint(0, 8, (rows,), generator=g, dtype=torch.int32)
    per_rank = []
    for r in range(world):
        local_scores = torch.randint(-6, 6, (rows, L), generator=g).float()  # many ties
        local_scores[local_scores == 0] = 0.5  # no zero: -0.0 vs +0.0 is a documented difference
        logits = torch.randn(rows, L + 8, generator=g)  # garbage outside each row's window
        for t in range(rows):
            s = int(row_starts[t])
            logits[t, s:s + L] = local_scores[t]
        # The rank's local top-K (vLLM's per-row top-k leaves the order open: shuffle it).
        best = torch.sort(local_scores, dim=1, descending=True, stable=True).indices[:, :K]
        perm = torch.argsort(torch.rand(rows, K, generator=g), dim=1)
        local = best.gather(1, perm).to(torch.int32)
        local[torch.rand(rows, K, generator=g) < 0.15] = -1  # short rows
        gids = torch.where(local >= 0, table[r][local.clamp_min(0).long()], -1).to(torch.int32)
        scores = torch.where(local >= 0, local_scores.gather(1, local.clamp_min(0).long()), -math.inf)
        per_rank.append((logits, local, row_starts, scores, gids))
    return per_rank


# ---------------------------------------------------------------------------
# The replay (spawned gloo ranks, host backend)
# ---------------------------------------------------------------------------


def _step(ns, managers, rank, world, rows, seed, qdtype):
    """One decode step of every manager (layer) on this thread's micro-batch;
    returns how many calls took vLLM's own path."""
    indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
    ub = getattr(ns.ubatch, "id", 0)
    before = sum(1 for _, u in ns.calls if u == ub)
    for li, (mgr, base2) in enumerate(managers):
        per_rank, qsl = _combine_inputs(world, rows, seed + li)
        out, lse, seq_lens = per_rank[rank]
        if li % 2:  # [B, 1, H, D] inputs are squeezed
            out = out.unsqueeze(1)
        if li == 0:  # return_lse, through the module function the manager's partial wraps
            got, got_lse = mgr.combine.func(out, lse, cp_group=mgr.group, return_lse=True,
                                            is_lse_base_on_e=not base2, seq_lens=seq_lens, query_start_loc=qsl)
        else:
            got, got_lse = mgr.combine(out, lse, seq_lens=seq_lens, query_start_loc=qsl), None
        ref_out, ref_lse = _combine_expected(per_rank, qsl, rank, world, base2)
        assert got.shape == (rows, H_LOC, D) and got.dtype == torch.bfloat16
        assert not torch.isnan(got).any(), "a masked row's payload leaked"
        torch.testing.assert_close(got.double(), ref_out, rtol=2e-2, atol=2e-2)
        if got_lse is not None:
            torch.testing.assert_close(got_lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        pad = rows - int(qsl[-1])
        if pad:
            assert (got[-pad:] == 0).all(), "padding rows must combine to 0"

        qs = _query_inputs(world, rows, seed + 100 + li, qdtype)
        q = mgr.query_gather(qs[rank])
        want = torch.cat(qs, dim=1)
        assert q.shape == want.shape and q.dtype == qdtype
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), "query gather is not bit-identical"
        assert q.untyped_storage().nbytes() >= rows * P * W * q.element_size(), "padded head storage missing"

        cands = _topk_inputs(world, rows, seed + 200 + li)
        logits, local, row_starts, _, _ = cands[rank]
        buf = torch.full((rows + 3, K + 4), 7, dtype=torch.int32)  # wider than the view: in-place on a view
        buf[:rows, :K] = local
        indexer.sparse_attn_indexer_decode(logits, buf, rows, K, rank, world, I, row_starts=row_starts)
        got_ids = buf[:rows, :K]
        assert (buf[rows:] == 7).all() and (buf[:, K:] == 7).all(), "wrote outside topk_indices"
        shards = [(s, i) for _, _, _, s, i in cands]
        ref = reference.topk_merge_ref(shards, K)
        vllm_set = _vllm_select(torch.cat([s for s, _ in shards], 1), torch.cat([i for _, i in shards], 1), K)
        assert torch.equal(got_ids.sort(1).values, vllm_set.sort(1).values), "not vLLM's selected set"
        if rows <= BOUND:
            assert torch.equal(got_ids, ref), "not the documented order"
    return sum(1 for _, u in ns.calls if u == ub) - before


def _protocol_worker(rank, world, rows_list, threads):
    import os

    torch.set_num_threads(1)
    ns = build_fake_vllm()
    sys.modules.update(ns.mods)
    groups = {u: dist.new_group(backend="gloo") for u in range(2)}
    ns.coordinator = Coordinator(dist.group.WORLD, groups, lambda: getattr(ns.ubatch, "id", 0))
    log = _Collect()
    logging.getLogger("vllm").addHandler(log)
    logging.getLogger("vllm").setLevel(logging.INFO)

    from torch_sdcp.integrations import vllm as plugin

    assert os.environ["SDCP_VLLM"] == "1"
    vllm_entry.register()
    assert plugin.is_installed()
    glm = ns.mods["vllm.models.glm5next.nvidia.sparse_indexer"]
    assert glm._merge_dcp_topk_global is plugin.merge_dcp_topk_global, "a by-name import was not patched"

    dcp = ns.mods["vllm.v1.attention.ops.dcp"]
    n_ub = 2
    kw = dict(device="cpu", num_heads=H_LOC, query_head_dim=W, output_head_dim=D, output_dtype=torch.bfloat16,
              padded_num_heads=P, use_pcp=False)
    managers = [  # layers 0-2: ag_rs base e, a2a base e, ag_rs base 2 (fp8 and bf16 queries share nothing)
        (Layer(ns, f"model.layers.{li}.self_attn.mla_attn", vllm_config=_config(n_ub, backend, index_topk=K),
               query_dtype=torch.float8_e4m3fn, is_lse_base_on_e=not base2, **kw).dcp_manager, base2)
        for li, (backend, base2) in enumerate((("ag_rs", False), ("a2a", False), ("ag_rs", True)))
    ]
    assert [c for c, _ in ns.calls if c.startswith("_init")] == [], "vLLM's own _init_* ran"
    for li, (mgr, _) in enumerate(managers):
        assert isinstance(mgr.combine, functools.partial)
        assert mgr.combine.func is (plugin.dcp_a2a_lse_reduce if mgr.use_a2a else plugin.cp_lse_ag_out_rs)
        # Each layer's calls carry its index as their call tag.
        assert mgr.combine.keywords["tag"] == mgr.query_gather.keywords["tag"] == li
    # One set per micro-batch (Output/LSE, query, top-K), shared by every layer.
    wss = plugin.workspaces()
    assert len(wss) == 3 * n_ub and all(w.peer for w in wss), wss
    assert all(w.timeout_s == plugin.DEFAULT_TIMEOUT_S for w in wss)

    results, errors = {}, []

    def run(ub):
        ns.ubatch.id = ub
        try:
            fell_back = 0
            for i, rows in enumerate(rows_list):
                fell_back += _step(ns, managers, rank, world, rows, seed=1000 * ub + 10 * i,
                                   qdtype=torch.float8_e4m3fn)
            results[ub] = fell_back
        except BaseException as e:
            import traceback

            errors.append(f"micro-batch {ub}: {e}\n{traceback.format_exc()}")

    if threads:
        ts = [threading.Thread(target=run, args=(ub,)) for ub in range(n_ub)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        run(0)
    assert not errors, "\n".join(errors)
    plugin.uninstall()
    assert dcp.MLADCPManager._init_combine.__name__ == "_init_combine"
    assert glm._merge_dcp_topk_global.__name__ == "_merge_dcp_topk_global"
    from torch_sdcp import integrations

    counts = integrations.counters()["vllm"]
    plugin.teardown()
    return results, [m for lvl, m in log.records if lvl == "WARNING"], [m for lvl, m in log.records
                                                                         if lvl == "INFO"], counts


def test_vllm_protocol_two_microbatches():
    rows_list = [1, 7, BOUND, BOUND + 1]
    results = run_workers(_protocol_worker, 2, args=(rows_list, True), timeout=120, env={"SDCP_VLLM": "1"})
    for per_ub, warnings, infos, counts in results:
        # Every seam counted its peer calls and, above the bound, its fallbacks by reason (once per
        # micro-batch and layer; the three-rank run has no call above the bound).
        for seam in ("cp_lse_ag_out_rs", "gather_query", "merge_dcp_topk_global"):
            assert counts[seam]["peer"] > 0 and counts[seam]["fallback:rows-over-bound"] > 0, counts
            assert counts[seam]["timeout"] == counts[seam]["void"] == counts[seam]["error"] == 0, counts
        assert any("seams:" in m and "peer" in m for m in infos), infos  # the counters, logged at teardown
        sizes = [m for m in infos if "bytes per rank" in m]  # every workspace's bytes, at creation
        assert len(sizes) == 6 and not [m for m in sizes if ": 0 bytes" in m], sizes
        # Above the bound: each layer's three boundaries took vLLM's own path (and nothing else did).
        assert per_ub == {0: 9, 1: 9}, per_ub
        assert not [w for w in warnings if "exceed" in w], warnings  # an expected fallback: no warning
        rows_notes = [m for m in infos if "exceed" in m]
        # Once per seam (both combines, the query gather, the top-K merge), not per call.
        assert len(rows_notes) == 4, infos
        assert any("installed" in m for m in infos), infos


def _layer_tag_worker(rank, world):
    """Rank r builds layer 3 + r: its first combine and query gather are
    another layer's call on the peer, named on every rank by the call tags."""
    torch.set_num_threads(1)
    ns = build_fake_vllm()
    sys.modules.update(ns.mods)
    groups = {u: dist.new_group(backend="gloo") for u in range(2)}
    ns.coordinator = Coordinator(dist.group.WORLD, groups, lambda: 0)

    from torch_sdcp.integrations import vllm as plugin

    vllm_entry.register()
    mgrs = [Layer(ns, f"model.layers.{3 + rank}.self_attn.mla_attn", vllm_config=_config(), device="cpu",
                  num_heads=H_LOC, query_head_dim=W, output_head_dim=D, query_dtype=torch.float8_e4m3fn,
                  output_dtype=torch.bfloat16, padded_num_heads=P, is_lse_base_on_e=True,
                  use_pcp=False).dcp_manager for _ in range(2)]  # one layer for the combine, one for the query
    assert mgrs[0].combine.keywords["tag"] == 3 + rank
    per_rank, qsl = _combine_inputs(world, 2, seed=5)
    out, lse, seq_lens = per_rank[rank]
    named = "rank 0 called with call tag 3, rank 1 with call tag 4"
    with pytest.raises(RuntimeError, match=named):
        mgrs[0].combine(out, lse, seq_lens=seq_lens, query_start_loc=qsl)
    with pytest.raises(RuntimeError, match=named):
        mgrs[1].query_gather(_query_inputs(world, 2, 6, torch.float8_e4m3fn)[rank])
    # The top-K merge: the layer its indexer op resolved (vLLM passes the merge no layer).
    indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
    assert plugin.try_prepare_topk(ns.coordinator, max_rows=BOUND, k=K, device="cpu", num_ubatches=1)
    logits, local, row_starts, _, _ = _topk_inputs(world, 2, 7)[rank]
    buf = torch.full((2, K), -1, dtype=torch.int32)
    buf[:, :] = local
    with pytest.raises(RuntimeError, match=named):
        indexer.sparse_attn_indexer_decode(logits, buf, 2, K, rank, world, I, row_starts=row_starts,
                                           k_cache_prefix=f"model.layers.{3 + rank}.self_attn.indexer.k_cache")
    plugin.teardown()
    plugin.uninstall()
    assert indexer._resolve_layer_name.__name__ == "_resolve_layer_name", "not restored"
    return True


def test_vllm_layers_carry_their_index_as_call_tag():
    assert run_workers(_layer_tag_worker, 2, timeout=120, env={"SDCP_VLLM": "1"}) == [True, True]


def test_layer_index(plugin):
    assert plugin.layer_index("model.layers.3.self_attn.attn") == 3
    assert plugin.layer_index("model.layers.61.mtp.attn") == 61
    for name in ("lm_head", "model.layers.3.experts.5", None, 3):
        assert plugin.layer_index(name) is None, name


def test_vllm_protocol_three_ranks():
    results = run_workers(_protocol_worker, 3, args=([3, 16], False), timeout=120, env={"SDCP_VLLM": "1"})
    for per_ub, warnings, _, _ in results:
        assert per_ub == {0: 0} and warnings == [], (per_ub, warnings)


# ---------------------------------------------------------------------------
# In process: the setting, versions, patching, the gate, arguments
# ---------------------------------------------------------------------------


@pytest.fixture
def plugin():
    from torch_sdcp.integrations import vllm as plugin

    return plugin


@pytest.fixture
def collect():
    handler = _Collect()
    for name in ("vllm", "torch_sdcp"):
        logging.getLogger(name).addHandler(handler)
    yield handler
    for name in ("vllm", "torch_sdcp"):
        logging.getLogger(name).removeHandler(handler)


def test_import_does_not_import_vllm():
    import subprocess

    # The library never imports an entry shim (the shims import the library, and the settings module).
    code = ("import sys, torch_sdcp, torch_sdcp.integrations, torch_sdcp.integrations.vllm, "
            "torch_sdcp.integrations.sglang; "
            "shims = [m for m in ('torch_sdcp_plugins.vllm', 'torch_sdcp_plugins.sglang') if m in sys.modules]; "
            "assert not shims, shims; assert 'torch_sdcp_settings' in sys.modules; "
            "import torch_sdcp_plugins.vllm as e; e.register(); assert 'vllm' not in sys.modules, 'vllm imported'")
    import os

    env = {k: v for k, v in os.environ.items() if k != "SDCP_VLLM"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=120)


@pytest.mark.parametrize("value", [None, "0", "off", ""])
def test_off_by_default(plugin, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SDCP_VLLM", raising=False)
    else:
        monkeypatch.setenv("SDCP_VLLM", value)
    with FakeVllm() as ns:
        original = ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager._init_combine
        vllm_entry.register()
        assert not plugin.is_installed()
        assert ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager._init_combine is original


def test_bad_setting_is_logged_and_off(plugin, monkeypatch, collect):
    monkeypatch.setenv("SDCP_VLLM", "maybe")
    with FakeVllm():
        vllm_entry.register()
        assert not plugin.is_installed()
    assert any(lvl == "ERROR" and "SDCP_VLLM" in m for lvl, m in collect.records), collect.records


def test_unknown_version_refused(plugin, monkeypatch, collect):
    monkeypatch.setenv("SDCP_VLLM", "1")
    with FakeVllm(version="0.35.0") as ns:
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
        before = (dict(vars(dcp.MLADCPManager)), indexer._merge_dcp_topk_global)
        vllm_entry.register()
        vllm_entry.register()
        assert not plugin.is_installed()
        assert (dict(vars(dcp.MLADCPManager)), indexer._merge_dcp_topk_global) == before, "patched anyway"
    errors = [m for lvl, m in collect.records if lvl == "ERROR"]
    assert len(errors) == 1 and "0.35.0" in errors[0] and "0.33.0, 0.34.0" in errors[0], errors


def test_unknown_version_fails_start_up_with_require(plugin, monkeypatch):
    monkeypatch.setenv("SDCP_VLLM", "require")
    with FakeVllm(version="0.35.0"), pytest.raises(RuntimeError, match="require"):
        vllm_entry.register()


def test_missing_target_refused(plugin, monkeypatch, collect):
    monkeypatch.setenv("SDCP_VLLM", "1")
    with FakeVllm() as ns:
        del ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]._merge_dcp_topk_global
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        before = dict(vars(dcp.MLADCPManager))
        assert not plugin.install()
        assert dict(vars(dcp.MLADCPManager)) == before, "a partial install"
    assert any(lvl == "ERROR" and "_merge_dcp_topk_global" in m for lvl, m in collect.records)


def test_install_idempotent_and_reversible(plugin):
    with FakeVllm() as ns:
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
        glm = ns.mods["vllm.models.glm5next.nvidia.sparse_indexer"]
        before = dict(vars(dcp.MLADCPManager)), indexer._merge_dcp_topk_global
        assert plugin.install() and plugin.install()
        assert dcp.MLADCPManager._init_combine is plugin._manager_init_combine
        assert dcp.MLADCPManager._init_query_gather is plugin._manager_init_query_gather
        assert indexer._merge_dcp_topk_global is plugin.merge_dcp_topk_global
        assert glm._merge_dcp_topk_global is plugin.merge_dcp_topk_global
        # Patched at install: all but the worker's step (Kimi-K3's layer too: its module is imported);
        # plus two re-exports (the merge, destroy_model_parallel).
        # Nor 0.34's direct top-K getter; plus the two indexer modules' layer-name readers.
        assert len(plugin._state.patches) == len(plugin.PATCHED) - 2 + 2 + 2
        assert indexer._resolve_layer_name.__wrapped__ is not None and glm._resolve_layer_name is not None
        plugin.uninstall()
        plugin.uninstall()
        assert (dict(vars(dcp.MLADCPManager)), indexer._merge_dcp_topk_global) == before
        assert glm._merge_dcp_topk_global is before[1]
        assert plugin.install()  # and again
        assert indexer._merge_dcp_topk_global is plugin.merge_dcp_topk_global


def test_patched_signatures_match(plugin):
    """The replacements take exactly what vLLM passes (the table the
    conformance test checks against vLLM's sources), and the call tag that
    the manager's partials bind (keyword-only, never passed by vLLM)."""
    import inspect

    def params(text):
        return text.replace(" ", "")

    def strip(fn):  # parameters without annotations, less the face's own keyword-only call tag
        s = inspect.signature(fn)
        return "(" + ",".join(
            ("**" if p.kind is p.VAR_KEYWORD else "") + p.name
            + ("" if p.default is inspect.Parameter.empty else "=" + repr(p.default))
            for p in s.parameters.values() if not (p.name == "tag" and p.kind is p.KEYWORD_ONLY)) + ")"

    dcp, idx = "vllm.v1.attention.ops.dcp", "vllm.model_executor.layers.sparse_attn_indexer"
    # The replacements take 0.34's parameters; 0.33's are their leading ones.
    table = plugin.VLLM_SIGNATURES_BY_SERIES["0.34"]
    assert strip(plugin.cp_lse_ag_out_rs) == params(table[(dcp, "cp_lse_ag_out_rs")])
    assert strip(plugin.dcp_a2a_lse_reduce) == params(table[(dcp, "dcp_a2a_lse_reduce")])
    assert strip(plugin.dcp_a2a_v_up_proj_lse_reduce) == params(table[(dcp, "dcp_a2a_v_up_proj_lse_reduce")])
    assert strip(plugin.merge_dcp_topk_global) == params(table[(idx, "_merge_dcp_topk_global")])
    assert strip(plugin._manager_init_combine) == params(table[(dcp, "MLADCPManager._init_combine")])
    assert strip(plugin._manager_init_query_gather) == params(table[(dcp, "MLADCPManager._init_query_gather")])
    assert strip(plugin._direct_topk_workspace) == params(table[(idx, "_get_direct_dcp_topk_workspace")])
    for (mod, path), text in plugin.VLLM_SIGNATURES_BY_SERIES["0.33"].items():
        if path in plugin._LAYERS:  # wrapped, not replaced: the wrapper binds each version's own parameters
            continue
        assert params(table[(mod, path)]).startswith(params(text)[:-1]), (mod, path)
    # The stand-in agrees with each version's table too.
    for version, series in (("0.33.0", "0.33"), ("0.34.0", "0.34")):
        ns = build_fake_vllm(version)
        for (mod, path), text in plugin.VLLM_SIGNATURES_BY_SERIES[series].items():
            owner = ns.mods[mod]
            for part in path.split("."):
                owner = getattr(owner, part)
            assert strip(owner) == params(text), (version, mod, path)


class _NoPeer:
    """A workspace whose group failed the peer-memory gate."""

    peer = False

    def __init__(self, *a, **k):
        pass

    def close(self):
        pass


def test_peer_unavailable_keeps_vllm(plugin, monkeypatch, collect):
    import torch_sdcp.workspaces as wsmod

    for name in ("OutputLSEWorkspace", "QueryWorkspace", "ExchangeWorkspace", "TopKWorkspace"):
        monkeypatch.setattr(wsmod, name, _NoPeer)
    with FakeVllm() as ns:
        ns.coordinator = types.SimpleNamespace(cpu_group=object(), world_size=2, rank_in_group=0,
                                               unique_name="dcp:0")
        assert plugin.install()
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        mgr = dcp.MLADCPManager(_config(index_topk=K), device="cpu", num_heads=H_LOC, query_head_dim=W,
                                output_head_dim=D, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                padded_num_heads=None, is_lse_base_on_e=True, use_pcp=False)
        assert mgr.combine.func is dcp.cp_lse_ag_out_rs, "vLLM's own combine must stay"
        assert mgr.query_gather == mgr._gather_query
        assert [c for c, _ in ns.calls] == ["_init_combine", "_init_query_gather"]
        assert plugin.workspaces() == []
    warnings = [m for lvl, m in collect.records if lvl == "WARNING" and "unavailable" in m]
    assert len(warnings) == 4, collect.records  # once per boundary, and the group's start-up line
    assert "combine off (peer memory unavailable)" in warnings[-1], warnings


def test_pcp_single_rank_and_query_replication_keep_vllm(plugin, monkeypatch):
    import torch_sdcp.workspaces as wsmod

    made = []
    for name in ("QueryWorkspace", "ExchangeWorkspace"):
        monkeypatch.setattr(wsmod, name, lambda *a, **k: made.append(a) or _NoPeer())
    with FakeVllm() as ns:
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        assert plugin.install()
        kw = dict(device="cpu", num_heads=H_LOC, query_head_dim=W, output_head_dim=D, query_dtype=torch.bfloat16,
                  output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=True)
        ns.coordinator = types.SimpleNamespace(cpu_group=object(), world_size=1, rank_in_group=0, unique_name="x")
        one = dcp.MLADCPManager(_config(), use_pcp=False, **kw)
        assert one.combine.func is dcp.cp_lse_ag_out_rs and one.query_gather == one._gather_query
        ns.coordinator = types.SimpleNamespace(cpu_group=object(), world_size=2, rank_in_group=0, unique_name="y")
        monkeypatch.setattr(wsmod, "OutputLSEWorkspace", _NoPeer)
        pcp = dcp.MLADCPManager(_config(), use_pcp=True, **kw)
        assert pcp.combine.func is dcp.cp_lse_ag_out_rs and pcp.query_gather is None
        assert made == [], "no query workspace with PCP"
        # dcp_q_replicate does not decide: the attention class does (GLM-5 on CUDA gathers anyway).
        qrep = dcp.MLADCPManager(_config(q_replicate=True), use_pcp=False, **kw)
        assert len(made) == 1 and qrep.query_gather == qrep._gather_query  # no peer memory: vLLM's own


def test_bound_from_engine_and_cap(plugin, monkeypatch):
    assert plugin.row_bound(512) == 512
    monkeypatch.setenv("SDCP_VLLM_MAX_ROWS", "128")
    assert plugin.row_bound(512) == 128 and plugin.row_bound(64) == 64
    monkeypatch.setenv("SDCP_VLLM_MAX_ROWS", "lots")
    with pytest.raises(ValueError, match="SDCP_VLLM_MAX_ROWS"):
        plugin.row_bound(512)
    monkeypatch.setenv("SDCP_VLLM_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="SDCP_VLLM_TIMEOUT_S"):
        VLLM.timeout_s()


# ---------------------------------------------------------------------------
# Masking and top-K semantics (pure functions)
# ---------------------------------------------------------------------------


def test_mask_empty_shards_matches_the_contract(plugin):
    g = torch.Generator().manual_seed(3)
    for rows, lens in [(9, [1, 2, 3]), (6, [2, 2, 2]), (5, [1]), (4, [2, 0, 1])]:
        qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        seq_lens = torch.randint(0, 3, (len(lens),), generator=g, dtype=torch.int32)
        lse = torch.randn(rows, 3, generator=g)
        got = plugin.mask_empty_shards(lse, seq_lens, qsl)
        assert torch.equal(got, _mask_loop(lse, seq_lens, qsl)), (rows, lens, seq_lens)
    lse = torch.randn(4, 2)
    empty = plugin.mask_empty_shards(lse, torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    assert (empty == -math.inf).all()
    assert plugin.mask_empty_shards(lse, None, None) is lse
    with pytest.raises(ValueError, match="both or neither"):
        plugin.mask_empty_shards(lse, torch.ones(2), None)
    with pytest.raises(ValueError, match="query_start_loc"):
        plugin.mask_empty_shards(lse, torch.ones(2), torch.zeros(2))


def _ids_scores(rows, m, seed, values):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4 * m, generator=g)[:m] for _ in range(rows)]).to(torch.int32)
    ids[torch.rand(rows, m, generator=g) < 0.1] = -1
    scores = torch.tensor(values)[torch.randint(0, len(values), (rows, m), generator=g)]
    return scores.float(), ids


def test_topk_set_agrees_with_vllm_where_defined():
    """Finite scores, ties, -inf, invalid ids, only one sign of zero: the
    same set as vLLM's selector, and the order is the library's."""
    for seed, values in enumerate([[1.0, 2.0, 3.0], [-math.inf, 0.0, 5.0, 5.0], [-0.0, -1.5, 2.25, math.inf]]):
        scores, ids = _ids_scores(6, 40, seed, values)
        for k in (1, 8, 40, 50):
            ours = reference.topk_select_ref(scores, ids, k)
            theirs = _vllm_select(scores, ids, k)
            assert torch.equal(ours.sort(1).values, theirs.sort(1).values), (values, k)


def test_topk_documented_differences():
    """The cases docs/VLLM.md lists: vLLM ranks +0.0 above -0.0 and +NaN
    above +inf; torch_sdcp ties the zeros (lower id first) and ranks NaN
    below -inf."""
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    zeros = torch.tensor([[-0.0, 0.0]])
    assert reference.topk_select_ref(zeros, ids, 1).tolist() == [[1]]
    assert _vllm_select(zeros, ids, 1).tolist() == [[2]]
    nan = torch.tensor([[math.nan, math.inf]])
    assert reference.topk_select_ref(nan, ids, 1).tolist() == [[2]]
    assert _vllm_select(nan, ids, 1).tolist() == [[1]]
    low = torch.tensor([[math.nan, -math.inf]])
    assert reference.topk_select_ref(low, ids, 1).tolist() == [[2]]
    assert _vllm_select(low, ids, 1).tolist() == [[1]]  # a positive NaN beats -inf in vLLM


def test_local_candidates_mapping(plugin):
    """local -> global through the interleave, scores at row_start + local
    (clamped to the row), -1 kept."""
    world = 3
    table = _global_of(world)
    logits = torch.arange(2 * 70, dtype=torch.float32).view(2, 70)
    local = torch.tensor([[0, 5, -1, 63], [1, 4, 7, 62]], dtype=torch.int32)
    starts = torch.tensor([3, 6], dtype=torch.int32)
    for r in range(world):
        scores, ids = vllm_topk._local_candidates(logits, local, r, world, I, starts)
        want_ids = torch.where(local >= 0, table[r][local.clamp_min(0).long()], -1)
        assert torch.equal(ids, want_ids.to(torch.int32))
        col = (local.clamp_min(0).long() + starts.long().unsqueeze(1)).clamp_max(69)
        want = torch.where(local >= 0, logits.gather(1, col), -math.inf)
        assert torch.equal(scores, want)


# ---------------------------------------------------------------------------
# CUDA graphs (GPU machines only): masking and the three boundaries captured
# once and replayed with inputs changed in place.
# ---------------------------------------------------------------------------


def _fixed_masking(world, rows, seed):
    """As _combine_inputs with a fixed request count (static graph shapes)."""
    g = torch.Generator().manual_seed(seed)
    ends = sorted(torch.randperm(rows - 1, generator=g)[:3].add(1).tolist())
    qsl = torch.tensor([0] + ends, dtype=torch.int32)
    per_rank = []
    for _ in range(world):
        out = torch.randn(rows, world * H_LOC, D, generator=g).to(torch.bfloat16)
        lse = torch.randn(rows, world * H_LOC, generator=g) * 3
        seq_lens = torch.randint(0, 2, (3,), generator=g, dtype=torch.int32) * 5
        masked = _mask_loop(torch.zeros(rows, 1), seq_lens, qsl)[:, 0] == -math.inf
        lse[masked] = 80.0
        out[masked] = float("nan")
        per_rank.append((out, lse, seq_lens))
    return per_rank, qsl


def _gpu_capture_worker(rank, world, shared=False):
    from torch_sdcp.integrations import vllm as plugin

    device = torch.device("cuda", 0 if shared else rank)
    torch.cuda.set_device(device)
    if shared:  # both ranks on one GPU: correct, time-sliced
        options = vllm_calls.face.options
        vllm_calls.face.options = lambda: {**options(), "allow_shared_device": True}
    coord = Coordinator(dist.group.WORLD, {0: dist.group.WORLD}, lambda: 0)
    plugin.configure(dcp_group=lambda: coord)
    rows = 8
    assert plugin.try_prepare_output_lse(coord, max_rows=16, total_heads=world * H_LOC, head_dim=D,
                                         dtype=torch.bfloat16, device=device)
    assert plugin.try_prepare_query_gather(coord, max_rows=16, local_heads=H_LOC, width=W,
                                           dtype=torch.float8_e4m3fn, device=device)
    assert plugin.try_prepare_topk(coord, max_rows=16, k=K, device=device)

    def load(seed):
        per_rank, qsl = _fixed_masking(world, rows, seed)
        qs = _query_inputs(world, rows, seed, torch.float8_e4m3fn)
        cands = _topk_inputs(world, rows, seed)
        return per_rank, qsl, qs, cands

    per_rank, qsl, qs, cands = load(0)
    s_out, s_lse, s_seq = (x.to(device) for x in per_rank[rank])
    s_qsl, s_q = qsl.to(device), qs[rank].to(device)
    s_logits, s_local, s_starts = (x.to(device) for x in cands[rank][:3])
    s_topk = s_local.clone()

    def calls():
        res = plugin.cp_lse_ag_out_rs(s_out, s_lse, coord, return_lse=True, seq_lens=s_seq,
                                      query_start_loc=s_qsl)
        q = plugin.gather_query(s_q, coord, padded_num_heads=P)
        plugin.merge_dcp_topk_global(s_logits, s_topk, K, rank, world, I, row_starts=s_starts)
        return res, q

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream
        calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (r_out, r_lse), r_q = calls()
    for seed in (1, 2, 3):
        per_rank, qsl, qs, cands = load(seed)
        for dst, src in zip((s_out, s_lse, s_seq, s_qsl, s_q, s_logits, s_local, s_starts),
                            (*per_rank[rank], qsl, qs[rank], *cands[rank][:3]), strict=False):
            dst.copy_(src)
        s_topk.copy_(s_local)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _combine_expected(per_rank, qsl, rank, world, base2=False)
        assert not torch.isnan(r_out).any()
        torch.testing.assert_close(r_out.cpu().double(), ref_out, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(r_q.cpu().view(torch.uint8), torch.cat(qs, dim=1).view(torch.uint8))
        ref_ids = reference.topk_merge_ref([(s, i) for _, _, _, s, i in cands], K)
        assert torch.equal(s_topk.cpu(), ref_ids)
    del graph
    plugin.teardown()
    return True


@requires_gpus(2)
def test_capture_and_replay_cuda():
    assert run_workers(_gpu_capture_worker, 2, timeout=300) == [True, True]


@requires_gpus(1)
def test_capture_and_replay_two_ranks_on_one_gpu():
    assert run_workers(_gpu_capture_worker, 2, args=(True,), timeout=300) == [True, True]


@requires_gpus(1)
def test_mask_empty_shards_captured_cuda():
    from torch_sdcp.integrations import vllm as plugin

    device = torch.device("cuda", 0)
    lse = torch.randn(8, 4, device=device)
    seq = torch.tensor([3, 0, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 3, 6], dtype=torch.int32, device=device)
    plugin.mask_empty_shards(lse, seq, qsl)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = plugin.mask_empty_shards(lse, seq, qsl)
    for s, q in (([0, 1, 1], [0, 1, 5, 7]), ([2, 2, 0], [0, 3, 4, 4])):
        seq.copy_(torch.tensor(s))
        qsl.copy_(torch.tensor(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), _mask_loop(lse.cpu(), seq.cpu(), qsl.cpu()))


def test_query_gather_workspace_by_dtype(plugin):
    # The data-as-flag query workspace for dtypes whose all-ones element is NaN
    # and heads of whole 16-byte vectors; the tagged exchange for the rest.
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32):
        assert query_direct(576, dtype), dtype
    for dtype in (torch.uint8, torch.int8, torch.float8_e4m3fnuz):
        assert not query_direct(576, dtype), dtype
    assert not query_direct(20, torch.float8_e4m3fn)


def test_layer_names_with_several_numbers_keep_a_tag_per_layer(caplog):
    """LongCat-Flash names two attention layers per decoder layer
    (``model.layers.3.self_attn.1``): each still gets its own call tag, and
    one start-up line says how they are tagged."""
    from torch_sdcp.integrations import vllm_topk
    from torch_sdcp.integrations.vllm_config import layer_tag
    from torch_sdcp.integrations.vllm_layers import building_layer_tag, layer_constructor

    noted = []
    names = [f"model.layers.{d}.self_attn.{a}" for d in range(3) for a in range(2)]
    assert [layer_tag(n, lambda *a: noted.append(a)) for n in names] == [0, 1, 1000, 1001, 2000, 2001]
    assert [n for n, _ in noted] == names
    assert layer_tag("model.layers.3.self_attn.attn") == 3 and layer_tag("lm_head") is None
    assert layer_tag("model.layers.3.experts.1000") is None  # a part that does not fit base 1000

    building = threading.local()

    class Attention:  # a vLLM layer whose __init__ builds its manager (which reads the tag)
        def __init__(self, prefix):
            self.tag = building_layer_tag(building)

    Attention.__init__ = layer_constructor(Attention.__init__, building, vllm_topk.note_layer_name)
    vllm_topk.face.logged.discard(("layer-name",))
    with caplog.at_level(logging.INFO):
        assert Attention("model.layers.7.self_attn.1.mla_attn").tag == 7001
        assert Attention("model.layers.7.self_attn.0.mla_attn").tag == 7000
    lines = [r.getMessage() for r in caplog.records if "several integer parts" in r.getMessage()]
    assert len(lines) == 1 and "7001" in lines[0], lines
