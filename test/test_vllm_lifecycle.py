"""The vLLM plugin's life cycle with the stand-in of test_vllm_plugin.py: the
entry point that never raises and imports nothing of torch_sdcp while off,
the settings checked there, the seams decided per setting (SDCP_VLLM_SEAMS,
vLLM's explicit direct-path switches) and not by ``dcp_q_replicate``, the
start-up log once per DCP group, the version check, the per-step health
check in the worker's ``sample_tokens`` (synchronous and async outputs; on
real host-backend workspaces after a peer's failure), and teardown through
``destroy_model_parallel`` (an engine re-created in one process leaves
nothing behind)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import requires_gpus
from _vllm_stand_in import H_LOC, Coordinator, D, FakeVllm, W, build_fake_vllm
from _vllm_stand_in import config as _config

from torch_sdcp_plugins import vllm as vllm_entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVS = ("SDCP_VLLM", "SDCP_VLLM_MAX_ROWS", "SDCP_VLLM_TIMEOUT_S", "SDCP_VLLM_SEAMS", "VLLM_USE_DIRECT_DCP_A2A",
        "VLLM_USE_DIRECT_DCP_Q_GATHER")


@pytest.fixture
def env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch



class _PeerStub:
    """A workspace on peer memory, as far as the plugin can tell: it records
    closes and raises from check() once ``failure`` is set."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.peer = True
        self.failure = None
        self.kind = type(self).__name__
        _PeerStub.made.append(self)

    def close(self):
        self.peer = False

    def check(self):
        if self.failure is not None:
            raise RuntimeError(self.failure)


@pytest.fixture
def stubs(monkeypatch):
    import torch_sdcp.workspaces as wsmod

    _PeerStub.made = []
    for name in ("OutputLSEWorkspace", "QueryWorkspace", "ExchangeWorkspace", "TopKWorkspace"):
        monkeypatch.setattr(wsmod, name, type(name, (_PeerStub,), {}))
    return _PeerStub.made


def _manager(ns, config=None, **over):
    kw = dict(device="cpu", num_heads=H_LOC, query_head_dim=W, output_head_dim=D, query_dtype=torch.bfloat16,
              output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=True, use_pcp=False)
    kw.update(over)
    return ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager(config or _config(index_topk=16), **kw)


def _group(name="dcp:0"):
    return types.SimpleNamespace(cpu_group=object(), world_size=2, rank_in_group=0, unique_name=name)


# ---------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "0"])
def test_entry_off_imports_nothing_of_ours(value):
    code = ("import sys, torch_sdcp_plugins.vllm as entry; entry.register(); "
            "ours = sorted(m for m in sys.modules if m == 'torch_sdcp' or m.startswith('torch_sdcp.')); "
            "assert not ours, ours; assert 'torch' not in sys.modules, 'torch imported'")
    env = {k: v for k, v in os.environ.items() if k not in ENVS}
    if value is not None:
        env["SDCP_VLLM"] = value
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)


def test_entry_register_never_raises(env, collect):
    from torch_sdcp.integrations import vllm as plugin
    from torch_sdcp_plugins import vllm as entry

    env.setenv("SDCP_VLLM", "1")

    def broken():
        raise RuntimeError("injected failure inside install")

    with FakeVllm():
        env.setattr(plugin, "install", broken)
        assert entry.register() is None
        assert entry.register() is None  # again: still logged once
        assert not plugin.is_installed()
    errors = [m for lvl, m in collect.records if lvl == "ERROR"]
    assert len(errors) == 1 and "injected failure inside install" in errors[0], collect.records


@pytest.mark.parametrize("name,value", [("SDCP_VLLM_MAX_ROWS", "0"), ("SDCP_VLLM_MAX_ROWS", "lots"),
                                        ("SDCP_VLLM_TIMEOUT_S", "-1"), ("SDCP_VLLM_TIMEOUT_S", "soon"),
                                        ("SDCP_VLLM_SEAMS", "combine,bogus")])
def test_entry_refuses_bad_settings(env, collect, name, value):
    from torch_sdcp.integrations import vllm as plugin
    from torch_sdcp_plugins import vllm as entry

    env.setenv("SDCP_VLLM", "1")
    env.setenv(name, value)
    with FakeVllm() as ns:
        original = ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager._init_combine
        entry.register()
        assert not plugin.is_installed()
        assert ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager._init_combine is original
    errors = [m for lvl, m in collect.records if lvl == "ERROR"]
    assert len(errors) == 1 and name in errors[0] and repr(value) in errors[0], errors


def test_seams_setting(env):
    from torch_sdcp_plugins import vllm as entry

    assert entry.seams() == ("combine", "query", "topk")
    env.setenv("SDCP_VLLM_SEAMS", " topk, Combine ")
    assert entry.seams() == ("combine", "topk")
    env.setenv("SDCP_VLLM_SEAMS", "")
    assert entry.seams() == ("combine", "query", "topk")


def test_version_check():
    from torch_sdcp.integrations import vllm as plugin

    for version in ("0.33.0", "0.33.1", "0.33.12", "0.33.0+cu130", "0.34.0", "0.34.1"):
        assert plugin.supported_version(version), version
    for version in ("0.35.0", "0.33", "0.330.1", "0.33.1rc1", "1.33.0", "unknown"):
        assert not plugin.supported_version(version), version
    with FakeVllm(version="0.33.2"):
        assert plugin.install()


# ---------------------------------------------------------------------------
# The seams
# ---------------------------------------------------------------------------


def _seam_log(collect):
    return [m for lvl, m in collect.records if lvl in ("INFO", "WARNING") and "DCP group" in m]


def test_query_seam_prepared_whatever_q_replicate_says(env, stubs, collect):
    from torch_sdcp.integrations import vllm as plugin

    with FakeVllm() as ns:
        ns.coordinator = _group()
        assert plugin.install()
        mgr = _manager(ns, _config(q_replicate=True, index_topk=16))
        assert isinstance(mgr.query_gather, functools.partial) and mgr.query_gather.func is plugin.gather_query
        assert mgr.combine.func is plugin.cp_lse_ag_out_rs
        _manager(ns, _config(q_replicate=True, index_topk=16))  # a second layer: same group, no second log
        assert sorted(w.kind for w in plugin.workspaces()) == ["OutputLSEWorkspace", "QueryWorkspace",
                                                               "TopKWorkspace"]
    lines = _seam_log(collect)
    assert len(lines) == 1 and "dcp:0" in lines[0], collect.records
    assert "combine ON" in lines[0] and "query ON" in lines[0] and "topk ON" in lines[0], lines


def test_seams_off_by_setting(env, stubs, collect):
    from torch_sdcp.integrations import vllm as plugin

    env.setenv("SDCP_VLLM_SEAMS", "combine")
    with FakeVllm() as ns:
        ns.coordinator = _group()
        assert plugin.install()
        mgr = _manager(ns)
        assert mgr.combine.func is plugin.cp_lse_ag_out_rs
        assert mgr.query_gather == mgr._gather_query
        assert [w.kind for w in plugin.workspaces()] == ["OutputLSEWorkspace"]
    (line,) = _seam_log(collect)
    assert "query off (not in SDCP_VLLM_SEAMS)" in line and "topk off (not in SDCP_VLLM_SEAMS)" in line, line


def test_explicit_direct_paths_stay_vllms(env, stubs, collect):
    from torch_sdcp.integrations import vllm as plugin

    env.setenv("VLLM_USE_DIRECT_DCP_A2A", "0")
    env.setenv("VLLM_USE_DIRECT_DCP_Q_GATHER", "1")
    with FakeVllm() as ns:
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        ns.coordinator = _group("dcp:a2a")
        assert plugin.install()
        a2a = _manager(ns, _config(backend="a2a"))
        assert a2a.combine.func is dcp.dcp_a2a_lse_reduce, "the user's a2a choice must stay vLLM's"
        assert a2a.query_gather == a2a._gather_query
        ns.coordinator = _group("dcp:ag_rs")
        ag_rs = _manager(ns, _config(backend="ag_rs"))  # VLLM_USE_DIRECT_DCP_A2A means nothing to ag_rs
        assert ag_rs.combine.func is plugin.cp_lse_ag_out_rs
    lines = _seam_log(collect)
    assert len(lines) == 2, lines
    assert "combine off (VLLM_USE_DIRECT_DCP_A2A=0 set by the user)" in lines[0], lines
    assert "query off (VLLM_USE_DIRECT_DCP_Q_GATHER=1 set by the user)" in lines[0], lines
    assert "combine ON" in lines[1], lines


# ---------------------------------------------------------------------------
# The step's health check
# ---------------------------------------------------------------------------


class _AsyncOutput:
    """vLLM's AsyncModelRunnerOutput: get_output waits for the step."""

    def __init__(self):
        self.waited = 0

    def get_output(self):
        self.waited += 1
        return "tokens"


def test_health_check_in_sample_tokens(env, stubs):
    from torch_sdcp.integrations import vllm as plugin

    with FakeVllm() as ns:
        worker_cls = ns.mods["vllm.v1.worker.gpu_worker"].Worker
        original = worker_cls.sample_tokens
        ns.coordinator = _group()
        assert plugin.install()
        assert worker_cls.sample_tokens is original, "the worker's step is patched in the process that builds"
        _manager(ns)
        assert worker_cls.sample_tokens is plugin.worker_sample_tokens
        assert worker_cls(output="tokens").sample_tokens(None) == "tokens"
        pending = _AsyncOutput()
        assert worker_cls(output=pending).sample_tokens(None) is pending
        assert pending.get_output() == "tokens" and pending.waited == 1

        stubs[1].failure = "injected: query call timed out"
        with pytest.raises(RuntimeError, match="1 of 3 live workspace.*injected: query call timed out"):
            worker_cls(output="tokens").sample_tokens(None)
        pending = _AsyncOutput()
        out = worker_cls(output=pending).sample_tokens(None)  # the step is not over yet: no verdict
        with pytest.raises(RuntimeError, match="injected"):
            out.get_output()
        assert pending.waited == 1, "checked after the wait, not before"

        class Slotted:  # an output type that takes no new attribute
            __slots__ = ()

            def get_output(self):
                return "tokens"

        with pytest.raises(RuntimeError, match="injected"):  # checked at once instead
            worker_cls(output=Slotted()).sample_tokens(None)
        plugin.uninstall()
        assert worker_cls.sample_tokens is original


def _failure_worker(rank, world):
    """Rank 0 enters a combine that rank 1 never makes: rank 0 times out,
    poisons and aborts; after that, the step check raises on both ranks."""
    torch.set_num_threads(1)
    ns = build_fake_vllm()
    sys.modules.update(ns.mods)
    ns.coordinator = Coordinator(dist.group.WORLD, {0: dist.group.WORLD}, lambda: 0)
    from torch_sdcp.integrations import vllm as plugin

    vllm_entry.register()
    assert plugin.is_installed()
    mgr = _manager(ns)
    worker = ns.mods["vllm.v1.worker.gpu_worker"].Worker(output="tokens")
    assert len(plugin.workspaces()) == 3 and all(w.peer for w in plugin.workspaces())
    assert worker.sample_tokens(None) == "tokens"
    started = time.perf_counter()
    n = 0
    while time.perf_counter() - started < 1.0:
        plugin.check_step()
        n += 1
    rate = n / (time.perf_counter() - started)
    if rank == 0:
        out = torch.zeros(2, H_LOC * world, D, dtype=torch.bfloat16)
        lse = torch.zeros(2, H_LOC * world)
        with pytest.raises(RuntimeError):
            mgr.combine(out, lse)
    dist.barrier()
    try:
        worker.sample_tokens(None)
    except RuntimeError as e:
        raised = str(e)
    else:
        raised = None
    dist.barrier()
    ns.mods["vllm.distributed"].destroy_model_parallel()
    return raised, rate, len(plugin.workspaces())


def test_health_check_raises_on_every_rank_after_a_failure():
    results = run_workers(_failure_worker, 2, timeout=120, env={"SDCP_VLLM": "1", "SDCP_VLLM_TIMEOUT_S": "1"})
    for rank, (raised, rate, left) in enumerate(results):
        assert raised is not None and "recorded a failure" in raised, (rank, raised)
        assert rate > 1000, rate  # host memory only: far below a decode step's cost
        assert left == 0


# ---------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------


def test_engine_recreated_leaves_nothing_behind(env, stubs):
    from torch_sdcp.integrations import vllm as plugin

    with FakeVllm() as ns:
        destroy = ns.mods["vllm.distributed"].destroy_model_parallel  # the re-export the executors import
        assert plugin.install()
        for engine in range(2):
            ns.coordinator = _group(f"dcp:{engine}")
            _manager(ns)
            _manager(ns)
            assert len(plugin.workspaces()) == 3
            ns.mods["vllm.distributed"].destroy_model_parallel()
            assert plugin.workspaces() == []
            assert ns.coordinator is None, "vLLM's own destroy_model_parallel must run"
        assert len(stubs) == 6 and not any(w.peer for w in stubs), "a workspace was left open"
        plugin.uninstall()
        assert ns.mods["vllm.distributed"].destroy_model_parallel is destroy


def test_teardown_failure_does_not_stop_shutdown(env, stubs, collect):
    from torch_sdcp.integrations import vllm as plugin

    with FakeVllm() as ns:
        ns.coordinator = _group()
        assert plugin.install()
        _manager(ns)

        def failing_close():
            raise RuntimeError("injected close failure")

        stubs[0].close = failing_close
        ns.mods["vllm.distributed.parallel_state"].destroy_model_parallel()
        assert ns.coordinator is None and plugin.workspaces() == []
        assert not any(w.peer for w in stubs[1:])
    assert any(lvl == "ERROR" and "injected close failure" in m for lvl, m in collect.records), collect.records


def _gpu_health_worker(rank, world):
    """A combine captured in a CUDA graph, replayed on both ranks (the step
    check passes), then replayed by rank 0 alone: its kernel times out and
    aborts; rank 1's next replay meets the abort. The step check then raises
    on both ranks, reading host memory only."""
    from torch_sdcp.integrations import vllm as plugin
    from torch_sdcp.integrations import vllm_calls

    device = torch.device("cuda", 0)  # both ranks on one GPU: correct, time-sliced
    torch.cuda.set_device(device)
    options = vllm_calls.face.options
    vllm_calls.face.options = lambda: {**options(), "allow_shared_device": True}
    coord = Coordinator(dist.group.WORLD, {0: dist.group.WORLD}, lambda: 0)
    plugin.configure(dcp_group=lambda: coord)
    assert plugin.try_prepare_output_lse(coord, max_rows=16, total_heads=world * H_LOC, head_dim=D,
                                         dtype=torch.bfloat16, device=device)
    out = torch.randn(8, world * H_LOC, D, device=device).to(torch.bfloat16)
    lse = torch.randn(8, world * H_LOC, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plugin.cp_lse_ag_out_rs(out, lse, coord)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plugin.cp_lse_ag_out_rs(out, lse, coord)
    graph.replay()
    torch.cuda.synchronize()
    plugin.check_step()
    dist.barrier()
    if rank == 0:
        graph.replay()  # rank 1 skips this step: rank 0 waits out SDCP_VLLM_TIMEOUT_S, records and aborts
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        graph.replay()  # meets rank 0's abort
        torch.cuda.synchronize()
    dist.barrier()
    try:
        plugin.check_step()
    except RuntimeError as e:
        raised = str(e)
    else:
        raised = None
    del graph
    plugin.teardown()
    return raised


@requires_gpus(1)
def test_health_check_after_a_failure_in_a_replayed_graph_two_ranks_on_one_gpu():
    results = run_workers(_gpu_health_worker, 2, timeout=180, env={"SDCP_VLLM_TIMEOUT_S": "2"})
    for rank, raised in enumerate(results):
        assert raised is not None and "recorded a failure" in raised, (rank, raised)


# ---------------------------------------------------------------------------
# Operability: seams not selected stay unpatched, a step check that cannot be
# installed, the require mode
# ---------------------------------------------------------------------------


def test_combine_only_leaves_the_topk_merge_unpatched(env, stubs, collect):
    from torch_sdcp.integrations import vllm as plugin

    env.setenv("SDCP_VLLM_SEAMS", "combine")
    with FakeVllm() as ns:
        indexer = ns.mods["vllm.model_executor.layers.sparse_attn_indexer"]
        glm = ns.mods["vllm.models.glm5next.nvidia.sparse_indexer"]
        original = indexer._merge_dcp_topk_global
        ns.coordinator = _group()
        assert plugin.install()
        assert indexer._merge_dcp_topk_global is original and glm._merge_dcp_topk_global is original
        _manager(ns)
        plugin.uninstall()
    assert not [m for lvl, m in collect.records if "top-K" in m and lvl == "WARNING"], collect.records


def test_step_check_import_raising_keeps_every_seam_vllms(env, stubs, collect):
    import importlib

    from torch_sdcp.integrations import vllm as plugin

    real = importlib.import_module

    def import_module(name, *a, **k):
        if name == "vllm.v1.worker.gpu_worker":
            raise RuntimeError("injected: CUDA initialisation failed while importing gpu_worker")
        return real(name, *a, **k)

    with FakeVllm() as ns:
        ns.coordinator = _group()
        assert plugin.install()
        env.setattr(importlib, "import_module", import_module)
        dcp = ns.mods["vllm.v1.attention.ops.dcp"]
        mgr = _manager(ns)  # the manager is built: nothing aborts
        env.setattr(importlib, "import_module", real)
        assert mgr.combine.func is dcp.cp_lse_ag_out_rs and mgr.query_gather == mgr._gather_query
        assert plugin.workspaces() == []
    errors = [m for lvl, m in collect.records if lvl == "ERROR"]
    assert len(errors) == 1 and "injected: CUDA initialisation" in errors[0], errors


def test_require_mode_fails_the_build_with_the_line(env, stubs):
    from torch_sdcp.integrations import vllm as plugin

    env.setenv("SDCP_VLLM", "require")
    with FakeVllm() as ns:
        ns.coordinator = types.SimpleNamespace(cpu_group=object(), world_size=1, rank_in_group=0, unique_name="one")
        assert plugin.install()
        refused = r"combine off \(single rank\).*--decode-context-parallel-size.*SDCP_VLLM=require"
        with pytest.raises(RuntimeError, match=refused):
            _manager(ns)
        ns.coordinator = _group()
        _manager(ns, _config())  # no sparse indexer: the top-K does not apply, nothing is refused


def test_require_mode_fails_registration_on_a_refused_version(env, collect):
    env.setenv("SDCP_VLLM", "require")
    with FakeVllm(version="0.35.0"), pytest.raises(RuntimeError, match="SDCP_VLLM=require"):
        vllm_entry.register()
    vllm_entry._logged.clear()


def test_post_releases_accepted():
    from torch_sdcp.integrations import vllm as plugin

    assert plugin.supported_version("0.33.0.post1") and plugin.supported_version("0.33.1.post2+cu130")
    assert not plugin.supported_version("0.35.0.post1")


def test_plugin_check_reports_seams_rows_and_bytes(env):
    """``python -m torch_sdcp.plugin_check``: the seams the settings leave on,
    the capped bound and the layout's bytes (DeepSeek-V3.2 at DCP8, docs/VLLM.md's table)."""
    from torch_sdcp import plugin_check

    argv = ["--engine", "vllm", "-dcp", "8", "--dcp-comm-backend", "a2a", "--num-heads", "128", "--rows", "4096",
            "--index-topk", "2048", "--query-dtype", "float8_e4m3fn"]
    status, text = plugin_check.report(argv)
    assert status == 0 and "combine ON" in text and "query ON" in text and "topk ON" in text, text
    assert "total per rank: 2713400832 bytes" in text, text
    env.setenv("SDCP_VLLM", "require")
    env.setenv("SDCP_VLLM_SEAMS", "combine,topk")
    env.setenv("SDCP_VLLM_MAX_ROWS", "1024")
    env.setenv("VLLM_USE_DIRECT_DCP_A2A", "1")
    status, text = plugin_check.report(argv)
    assert status == 1 and "rows bound: 1024" in text, text
    assert "combine off (VLLM_USE_DIRECT_DCP_A2A=1 set by the user) [to turn it on: unset" in text, text
    assert "query off (not in SDCP_VLLM_SEAMS)" in text and "start-up would stop (seams combine cannot" in text, text
    env.setenv("SDCP_VLLM_TIMEOUT_S", "soon")
    status, text = plugin_check.report(argv)
    assert status == 1 and "SDCP_VLLM_TIMEOUT_S" in text and "'soon'" in text, text


def test_plugin_check_runs_as_a_module(env):
    out = subprocess.run([sys.executable, "-m", "torch_sdcp.plugin_check", "--engine", "vllm", "--rows", "64"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "the plugin is off" in out.stdout and "rows bound: 64" in out.stdout, out
