"""The SGLang plugin's hooks around its calls (torch_sdcp.integrations.sglang_step)
on the stand-in of _sglang_stand_in.py, in process: the per-step check (a
failed step's output never leaves, by either scheduler loop; it waits for the
step and costs nothing without a workspace), the rows bound SGLang gives and
its cap, the workspaces made before SGLang sizes its KV pool or after it
(which, when, and the bytes logged), the model's geometries, and the
pre-capture point following SGLang's settings.
"""

from __future__ import annotations

import logging
import types

import _sglang_stand_in as stand_in
import pytest
import torch
from _engine_stand_in import InModules
from _sglang_stand_in import (
    BOUND,
    H_LOC,
    MLA,
    MODEL_RUNNER,
    REGISTRY,
    RUNNER,
    SCHEDULER,
    TOKENS_PER_REQ,
    D,
    R,
    build_fake_sglang,
    installed_fake_sglang,
)

from torch_sdcp.integrations import sglang_step as face_step

fake = pytest.fixture(installed_fake_sglang)



def test_step_check_fails_the_step(fake, monkeypatch):
    from torch_sdcp import integrations
    from torch_sdcp.integrations import _cache
    from torch_sdcp.integrations import sglang as face

    class Poisoned:
        peer = True

        def check(self):
            raise RuntimeError("torch_sdcp: OutputLSEWorkspace on rank 0 timed out waiting for a peer")

    assert face.install()
    fake.mods[REGISTRY].HookRegistry.apply_hooks()
    runner = fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential())
    assert runner.forward(lambda: "ok") == "ok"
    monkeypatch.setitem(_cache.CACHE, ("sglang", "output_lse", "g", (), "cpu", 0), _cache.Entry(Poisoned(), 8, True))
    with pytest.raises(RuntimeError, match="timed out"):
        runner.forward(lambda: "ok")
    assert integrations.counters()["sglang"][_cache.STEP_CHECK]["timeout"] == 1


class _Recorded:
    """A peer workspace whose calls ran on the stand-in's device: ``fail()``
    is the error record a failing kernel writes when it runs."""

    peer = True

    def __init__(self):
        self.error = None

    def fail(self):
        self.error = "torch_sdcp: OutputLSEWorkspace on rank 0 timed out waiting for a peer"

    def check(self):
        if self.error is not None:
            raise RuntimeError(self.error)


def _scheduler(fake, monkeypatch, overlap, hooks=None):
    """The stand-in scheduler over SGLang's hooked ModelRunner, a recorded
    workspace in this face's cache, and the plugin's hooks (all of HOOKS, or
    the named targets only) applied by SGLang's registry."""
    from torch_sdcp.integrations import _cache
    from torch_sdcp.integrations import sglang as face

    registry = fake.mods[REGISTRY]
    for target, kind, hook in face.HOOKS:
        if hooks is None or target.rsplit(".", 1)[-1] in hooks:
            registry.HookRegistry.register(target, hook, getattr(registry.HookType, kind))
    registry.HookRegistry.apply_hooks()
    ws = _Recorded()
    monkeypatch.setitem(_cache.CACHE, ("sglang", "output_lse", "g", (), "cpu", 0), _cache.Entry(ws, 8, True))
    device = stand_in.Device()
    runner = fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential())
    return fake.mods[SCHEDULER].Scheduler(runner, device, overlap), device, ws


def _batches(device, ws, failing):
    """Decode steps 0..3; step ``failing`` launches a call that fails on the
    device (its error recorded when its kernel runs, not at launch)."""
    def step(i):
        def forward():
            device.launch(ws.fail if i == failing else lambda: None)
            return f"tokens of step {i}"
        return forward
    return [step(i) for i in range(4)]


def test_overlap_scheduler_a_failed_steps_output_never_leaves(fake, monkeypatch):
    """Under SGLang's overlap loop, step 1's result is processed after step
    2's forward was launched; step 1's failing call records its error only
    when its kernel runs. The check before ModelRunner.forward alone lets step
    1's tokens reach the detokenizer (the control below); the check in result
    processing, after copy_done, raises before any of them is streamed."""
    from torch_sdcp import integrations
    from torch_sdcp.integrations import _cache

    sched, device, ws = _scheduler(fake, monkeypatch, overlap=True, hooks=("forward",))
    batches = _batches(device, ws, failing=1)
    with pytest.raises(RuntimeError, match="timed out"):
        sched.event_loop_overlap(batches)
    assert [b for b, _ in sched.outputs] == batches[:2], "control: without the result check step 1's output leaves"

    rebuilt = build_fake_sglang()  # a fresh process: SGLang's functions unhooked, a fresh registry
    with InModules(rebuilt.mods):
        sched, device, ws = _scheduler(rebuilt, monkeypatch, overlap=True)
        batches = _batches(device, ws, failing=1)
        before = integrations.counters()["sglang"].get(_cache.STEP_CHECK, {}).get("timeout", 0)
        with pytest.raises(RuntimeError, match="the step's output is not returned.*timed out"):
            sched.event_loop_overlap(batches)
        assert [b for b, _ in sched.outputs] == batches[:1], "an output of the failed step 1 left"
        assert (len(device.launched), device.done) == (3, 2), "raised in step 1's result processing, step 2 launched"
        assert integrations.counters()["sglang"][_cache.STEP_CHECK]["timeout"] == before + 1


def test_normal_scheduler_a_failed_steps_output_never_leaves(fake, monkeypatch):
    """SGLang's normal loop processes each result right after its forward:
    the check after the step's synchronisation stops the failed step's
    output there, before the next step is launched."""
    sched, device, ws = _scheduler(fake, monkeypatch, overlap=False)
    batches = _batches(device, ws, failing=2)
    device.launch = lambda kernel: kernel()  # a host backend's call completes before it returns
    with pytest.raises(RuntimeError, match="timed out"):
        sched.event_loop_normal(batches)
    assert [b for b, _ in sched.outputs] == batches[:2]


def test_result_check_waits_for_the_step(monkeypatch):
    """copy_done when SGLang recorded one, else the current CUDA stream (what
    the processors' tolist() waits for); nothing without CUDA."""
    import types as t


    waited = []
    face_step._wait_for_step(t.SimpleNamespace(copy_done=t.SimpleNamespace(synchronize=lambda: waited.append("event"))))
    stream = t.SimpleNamespace(synchronize=lambda: waited.append("stream"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    face_step._wait_for_step(t.SimpleNamespace(copy_done=None))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    face_step._wait_for_step(t.SimpleNamespace(copy_done=None))
    assert waited == ["event", "stream"]


def test_result_check_costs_nothing_without_a_workspace(fake):
    """No peer workspace: no wait, no check (SGLang keeps its own timing)."""
    import types as t

    from torch_sdcp.integrations import sglang as face

    face.before_results(None, None, t.SimpleNamespace(copy_done=t.SimpleNamespace(
        synchronize=lambda: pytest.fail("waited without a workspace"))))


def test_bound_from_sglang_and_cap(fake, monkeypatch):

    runner = fake.mods[RUNNER].BaseRunner(fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential()))
    assert face_step._row_bound(runner) == BOUND
    runner._widest_decode_rows = lambda: None  # no CUDA graphs: max_running_requests x tokens per request
    assert face_step._row_bound(runner) == 64 * TOKENS_PER_REQ
    monkeypatch.setenv("SDCP_SGLANG_MAX_ROWS", "100")
    assert face_step._row_bound(runner) == 100
    monkeypatch.setenv("SDCP_SGLANG_MAX_ROWS", "lots")
    with pytest.raises(ValueError, match="SDCP_SGLANG_MAX_ROWS"):
        face_step._row_bound(runner)


def test_rows_known_before_the_kv_pool(fake, monkeypatch):
    """Before the pool: the CUDA-graph configuration's widest decode batch
    (SGLang only filters that list later), else the --max-running-requests
    the user set, else unknown; capped by SDCP_SGLANG_MAX_ROWS."""

    mr = fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential())
    fake.graphs.cuda_graph_config.decode.bs = [1, 8, 3]
    assert face_step._rows_before_the_pool(mr) == 8 * TOKENS_PER_REQ
    fake.graphs.cuda_graph_config = None
    assert face_step._rows_before_the_pool(mr) is None
    fake.schedule.max_running_requests = 48
    assert face_step._rows_before_the_pool(mr) == 48 * TOKENS_PER_REQ
    monkeypatch.setenv("SDCP_SGLANG_MAX_ROWS", "20")
    assert face_step._rows_before_the_pool(mr) == 20


def test_workspaces_before_the_kv_pool_which_and_when(fake, monkeypatch, caplog):
    """The target model's workspaces are prepared before SGLang sizes its KV
    pool, with the seams the settings select; a draft model, DCP off, or a
    bound not known yet leave them to the warm-up; a failure is logged and
    never reaches SGLang."""
    from torch_sdcp.integrations import sglang as face

    made = []
    monkeypatch.setattr(face_step, "prepare", lambda group, **k: made.append(k) or {"output_lse": True, "query": True})
    model = torch.nn.Sequential(MLA(2), MLA(2))
    mr = fake.mods[MODEL_RUNNER].ModelRunner(model)
    face.before_alloc_memory_pool(mr)  # a cpu runner: SGLang never warms it up, nothing is made
    assert made == [] and face.engine.early_rows == {}
    monkeypatch.setattr(face_step, "_WARMED_UP_ON", ("cuda", "cpu"))
    fake.parallel.dcp_comm_backend = "fi_a2a"  # the combine stays SGLang's: the query only
    face.before_alloc_memory_pool(mr)
    assert [(m["combine"], m["query"], m["max_rows"]) for m in made] == [(False, True, BOUND)]
    assert face.engine.early_rows == {id(mr): BOUND}
    made.clear()
    face.before_alloc_memory_pool(fake.mods[MODEL_RUNNER].ModelRunner(model, is_draft_worker=True))
    fake.parallel.dcp_enabled = False
    face.before_alloc_memory_pool(mr)
    fake.parallel.dcp_enabled = True
    fake.graphs.cuda_graph_config = None
    with caplog.at_level(logging.WARNING):
        face.before_alloc_memory_pool(mr)
    assert made == [] and any("made at warm-up" in r.getMessage() for r in caplog.records)

    def boom(group, **k):
        raise RuntimeError("no peer")

    fake.graphs.cuda_graph_config = types.SimpleNamespace(decode=types.SimpleNamespace(bs=[4]))
    monkeypatch.setattr(face_step, "prepare", boom)
    with caplog.at_level(logging.ERROR):
        face.before_alloc_memory_pool(mr)
    assert any("no peer" in r.getMessage() and "tried again at warm-up" in r.getMessage() for r in caplog.records)


def test_workspaces_after_the_kv_pool_log_their_bytes_and_the_fraction(fake, monkeypatch, caplog):
    """A workspace made at warm-up (after the KV sizing) is named with its
    bytes and the --mem-fraction-static that keeps SGLang's headroom; one
    made before the pool is not."""
    from torch_sdcp.integrations import _cache
    from torch_sdcp.integrations import sglang as face

    early, late = _Recorded(), _Recorded()
    late.physical_bytes = early.physical_bytes = 2**30 // 4
    monkeypatch.setitem(_cache.CACHE, ("sglang", "output_lse", "g", (), "cpu", 0), _cache.Entry(early, 8, True))
    face.engine.early.add(id(early))
    mr = fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential())  # 80 GB before the model, fraction 0.85
    with caplog.at_level(logging.WARNING):
        face_step._log_outside_budget(mr)
    assert not caplog.records
    monkeypatch.setitem(_cache.CACHE, ("sglang", "query", "g", (), "cpu", 0), _cache.Entry(late, 8, True))
    with caplog.at_level(logging.WARNING):
        face_step._log_outside_budget(mr)
    assert [r.getMessage() for r in caplog.records] == [
        "torch_sdcp: 1 workspace(s), 268435456 bytes per rank, were made after SGLang sized its KV pool: they come "
        "out of the --mem-fraction-static headroom; to keep it, lower --mem-fraction-static by 0.0031 (0.85 -> "
        "0.8469)"]


def test_geometries_from_the_model():

    model = torch.nn.Sequential(MLA(2), MLA(2), MLA(1), torch.nn.Linear(2, 2))
    assert face_step._mla_geometries(model) == [(H_LOC, D, R)]


def test_pre_capture_follows_sglangs_settings(fake, monkeypatch, caplog):
    """fi_a2a keeps SGLang's combine, query replication makes no query
    workspace, DCP off makes nothing, and a failure never reaches SGLang."""
    from torch_sdcp.integrations import sglang as face

    made = []
    monkeypatch.setattr(face_step, "prepare", lambda group, **k: made.append(k) or {"output_lse": True, "query": True})
    runner = fake.mods[RUNNER].BaseRunner(fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential(MLA(2), MLA(2))))
    for backend, replicate, want in (("ag_rs", False, (True, True)), ("a2a", True, (True, False)),
                                     ("fi_a2a", False, (False, True)), ("fi_a2a", True, None)):
        fake.parallel.dcp_comm_backend, fake.parallel.dcp_replicate_q_proj = backend, replicate
        made.clear()
        face.after_pre_initialize(None, runner)
        if want is None:
            assert made == []
        else:
            assert [(m["combine"], m["query"]) for m in made] == [want], (backend, replicate, made)
            assert made[0]["max_rows"] == BOUND and made[0]["local_heads"] == H_LOC
    fake.parallel.dcp_comm_backend, fake.parallel.dcp_enabled = "ag_rs", False
    made.clear()
    face.after_pre_initialize(None, runner)
    assert made == []
    fake.parallel.dcp_enabled = True

    def boom(group, **k):
        raise RuntimeError("no memory")

    monkeypatch.setattr(face_step, "prepare", boom)
    with caplog.at_level(logging.ERROR):
        face.after_pre_initialize(None, runner)
    assert any("no memory" in r.getMessage() for r in caplog.records)
