"""The SGLang plugin (torch_sdcp_plugins.sglang -> torch_sdcp.integrations.sglang)
without SGLang, on the stand-in of _sglang_stand_in.py (the parts of SGLang
0.5.23 it touches; SGLang's own DCP functions in plain torch). Spawned gloo ranks on the host backend then run the
plugin's life: the entry point with SDCP_SGLANG=1, SGLang's hook registry
(its real module when SGLang's sources are on the path, else a stand-in),
workspaces at the pre-capture point, decode steps through the call site's
by-name imports (both combine backends, LSE base 2 and e, empty shards, the
two-view query gather), SGLang's own function above the bound, teardown at
shutdown. In-process: the entry imports nothing of torch_sdcp while off and
never raises, the version refusal, what stays SGLang's; the start-up line,
the require mode, a local shutdown and the command-line options. The hooks
around the calls (the per-step check, the rows bound, the workspaces before
and after the KV pool) are test_sglang_step.py's.

The stand-in follows docs/SGLANG.md; test_sglang_conformance.py checks the
seams against SGLang's sources.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _sglang_stand_in import (
    BOUND,
    COMM,
    FORWARD_MLA,
    H_LOC,
    MLA,
    MODEL_RUNNER,
    PARALLEL_STATE,
    REGISTRY,
    RUNNER,
    SERVER_ARGS,
    Coordinator,
    D,
    R,
    _real_registry,
    build_fake_sglang,
    decode_step,
    installed_fake_sglang,
    ref_all_gather_q_for_mla_decode,
    ref_cp_lse_ag_out_rs_mla,
    ref_dcp_a2a_lse_reduce,
    step_inputs,
)

from torch_sdcp.integrations import sglang_step as face_step


def _installed_in_worker():
    """A rank's fake SGLang with the plugin registered and its hooks applied:
    (the fake's namespace, the face, the DCP group)."""
    torch.set_num_threads(1)
    ns = build_fake_sglang()
    sys.modules.update(ns.mods)
    coord = Coordinator(dist.group.WORLD)
    ns.parallel.dcp_group = coord

    import torch_sdcp_plugins.sglang as entry
    from torch_sdcp.integrations import sglang as face

    entry.register()
    assert face.is_installed()
    ns.mods[REGISTRY].HookRegistry.apply_hooks()
    return ns, face, coord


def _protocol_worker(rank, world, rows_list):
    ns, face, coord = _installed_in_worker()
    fm, comm = ns.mods[FORWARD_MLA], ns.mods[COMM]
    assert fm.cp_lse_ag_out_rs_mla is comm.cp_lse_ag_out_rs_mla and fm.cp_lse_ag_out_rs_mla.__wrapped__ is not None
    assert fm.all_gather_q_for_mla_decode is comm.all_gather_q_for_mla_decode, "a by-name import was not rewritten"

    model = torch.nn.Sequential(MLA(world), MLA(world), MLA(1))
    runner = ns.mods[RUNNER].BaseRunner(ns.mods[MODEL_RUNNER].ModelRunner(model))
    face_step._WARMED_UP_ON = ("cuda", "cpu")  # the stand-in's runner is warmed up on the host
    ns.at_kv_sizing = lambda: [type(w).__name__ for w in face.workspaces()]
    runner.model_runner.alloc_memory_pool()  # the workspaces exist when SGLang sizes its KV pool
    runner._pre_initialize_fi_a2a_workspace()
    assert ns.events == [("kv-pool", ["OutputLSEWorkspace", "QueryWorkspace"]), "fi_a2a"], ns.events
    wss = face.workspaces()
    assert len(wss) == 2 and all(w.peer and w.max_rows == BOUND for w in wss), wss
    # An fp32 model's combine, prepared directly (what the hook does for a model of that dtype).
    assert face.prepare(coord, max_rows=BOUND, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R, dtype=torch.float32,
                        device="cpu", query=False) == {"output_lse": True, "query": False}

    fell_back = {}
    for backend in ("ag_rs", "a2a"):
        ns.parallel.dcp_comm_backend = backend
        for base_e in (False, True):
            for i, rows in enumerate(rows_list):
                for dtype in (torch.bfloat16, torch.float32):
                    per_rank = step_inputs(world, rows, 1000 * i + 10 * base_e + (dtype == torch.float32), dtype)
                    q_nope, q_pe, out, lse = per_rank[rank]
                    before = len(ns.calls)
                    got = runner.model_runner.forward(lambda: decode_step(ns, q_nope, q_pe, out, lse, base_e))
                    fell_back[(backend, base_e, rows, dtype)] = ns.calls[before:]
                    want_nope, want_pe = ref_all_gather_q_for_mla_decode(q_nope, q_pe, coord)
                    if backend == "a2a":
                        want = ref_dcp_a2a_lse_reduce(out, lse, coord, base_e)
                    else:
                        want = ref_cp_lse_ag_out_rs_mla(out, lse, coord, None, base_e).transpose(0, 1)
                    g_nope, g_pe, g_out = got
                    for a, b in ((g_nope, want_nope), (g_pe, want_pe)):
                        assert a.shape == b.shape and a.dtype == b.dtype and a.stride(-1) == 1
                        assert torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
                    assert g_nope.data_ptr() == g_pe.data_ptr() + R * 2, "not two views of one cat([q_pe, q_nope])"
                    assert g_out.shape == (rows, H_LOC, D) and g_out.dtype == dtype
                    assert g_out.is_contiguous() or rows > BOUND  # SGLang's own ag_rs leaves a transposed view
                    assert not torch.isnan(g_out).any()
                    if rank == 0:
                        assert (g_out[0, 0] == 0).all(), "an all-empty (row, head) must combine to 0"
                    if dtype == torch.float32:
                        torch.testing.assert_close(g_out, want, rtol=1e-5, atol=1e-5)
                    else:
                        torch.testing.assert_close(g_out, want, rtol=1.6e-2, atol=1e-2)
    ns.mods[PARALLEL_STATE].abort_distributed_environment()
    assert ns.events[-1] == "abort" and face.workspaces() == [], "not torn down before the groups go"
    return {f"{k[0]},{k[1]},{k[2]},{k[3]}": v for k, v in fell_back.items()}, ns.real_registry


def test_sglang_protocol_two_ranks():
    results = run_workers(_protocol_worker, 2, args=([1, 7, BOUND, BOUND + 1],), timeout=180,
                          env={"SDCP_SGLANG": "1"})
    for fell_back, real_registry in results:
        assert real_registry == (_real_registry() is not None)
        for key, calls in fell_back.items():
            rows = int(key.split(",")[2])
            if rows <= BOUND:
                assert calls == [], (key, calls)  # every seam on peer memory
            else:  # above the bound: SGLang's own combine and gather
                combine = "dcp_a2a_lse_reduce" if key.startswith("a2a") else "cp_lse_ag_out_rs_mla"
                assert calls == ["all_gather_q_for_mla_decode", combine], (key, calls)


# ---------------------------------------------------------------------------
# In process: the entry point, versions, what stays SGLang's
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "0", "off", "maybe"])
def test_entry_imports_nothing_while_off(value):
    code = ("import sys, torch_sdcp_plugins.sglang as e; e.register(); "
            "bad = [m for m in sys.modules if m == 'torch_sdcp' or m.startswith('torch_sdcp.')]; "
            "assert not bad, bad; "
            # SGLang's hook registry (where SGLang is installed; its package imports torch) is SGLang's own import
            "assert 'torch' not in sys.modules or 'sglang.srt.plugins.hook_registry' in sys.modules, 'torch imported'")
    env = {k: v for k, v in os.environ.items() if k != "SDCP_SGLANG"}
    if value is not None:
        env["SDCP_SGLANG"] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, timeout=120, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert ("SDCP_SGLANG" in done.stderr) == (value == "maybe"), done.stderr  # a bad value is logged


def test_entry_never_raises(monkeypatch, caplog):
    import torch_sdcp_plugins.sglang as entry
    from torch_sdcp.integrations import sglang as face

    monkeypatch.setenv("SDCP_SGLANG", "1")
    monkeypatch.setattr(entry, "_logged", set())

    def boom():
        raise RuntimeError("no seam")

    monkeypatch.setattr(face, "install", boom)
    with caplog.at_level(logging.ERROR):
        entry.register()
        entry.register()
    assert [r.getMessage() for r in caplog.records].count("torch_sdcp: the SGLang plugin stays off: "
                                                          "RuntimeError: no seam") == 1


fake = pytest.fixture(installed_fake_sglang)


def test_unknown_version_refused(fake, caplog):
    from torch_sdcp.integrations import sglang as face

    fake.mods["sglang.version"].__version__ = "0.5.24"
    with caplog.at_level(logging.ERROR):
        assert not face.install()
    assert not face.is_installed() and any("0.5.24" in r.getMessage() for r in caplog.records)


def test_install_registers_every_hook_once(fake):
    from torch_sdcp.integrations import sglang as face

    registry = fake.mods[REGISTRY].HookRegistry
    registered = []
    real = registry.register
    registry.register = classmethod(lambda cls, target, hook, kind, **k: registered.append((target, kind.name)))
    try:
        assert face.install() and face.install()
    finally:
        registry.register = real
    assert registered == [(t, k) for t, k, _ in face.HOOKS]
    assert set(face.engine.originals) == {"cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "all_gather_q_for_mla_decode"}


def test_what_stays_sglangs(fake):
    """fi_a2a, fp8 outputs, non-fp32 a2a LSEs and a world of one run SGLang's
    own function, with every argument as given."""
    from torch_sdcp.integrations import sglang as face

    seen = []
    face.configure(originals={"dcp_a2a_lse_reduce": lambda *a: seen.append(a) or "own",
                              "cp_lse_ag_out_rs_mla": lambda *a: seen.append(a) or "own"})
    one = types.SimpleNamespace(cpu_group=object(), world_size=1, rank_in_group=0, unique_name="x")
    out, lse = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 4)
    assert face.dcp_a2a_lse_reduce(out, lse, one, True, None, "fi_a2a") == "own"
    assert face.dcp_a2a_lse_reduce(out, lse.double(), one) == "own"
    assert face.cp_lse_ag_out_rs_mla(out, lse, one) == "own"
    two = types.SimpleNamespace(cpu_group=object(), world_size=2, rank_in_group=0, unique_name="y")
    fp8 = out.to(torch.float8_e4m3fn)
    assert face.cp_lse_ag_out_rs_mla(fp8, lse, two, None, True) == "own"
    assert seen[-1] == (fp8, lse, two, None, True) and len(seen) == 4



# ---------------------------------------------------------------------------
# torch.compile: the three seams traced whole (host backend, two gloo ranks)
# ---------------------------------------------------------------------------


def _own_path_taken(*args, **kwargs):
    raise AssertionError("SGLang's own function ran: the seam left the peer path")


def _compile_worker(rank, world):
    """Each seam compiled with fullgraph=True (the workspaces' ops traced
    through their fake implementations) equals the same seam run eagerly,
    bit for bit, and SGLang's functions in plain torch within tolerance; the
    compiled query gather still returns two views of one cat([q_pe, q_nope])."""
    torch.set_num_threads(1)
    from torch_sdcp.integrations import sglang as face

    coord = Coordinator(dist.group.WORLD)
    face.configure(dcp_group=lambda: coord, originals=dict.fromkeys(
        ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "all_gather_q_for_mla_decode"), _own_path_taken))
    assert face.prepare(coord, max_rows=BOUND, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R,
                        dtype=torch.bfloat16, device="cpu") == {"output_lse": True, "query": True}
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, keeping what dynamo traced
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    ag_rs = torch.compile(face.cp_lse_ag_out_rs_mla, fullgraph=True, backend=backend)
    a2a = torch.compile(face.dcp_a2a_lse_reduce, fullgraph=True, backend=backend)
    gather = torch.compile(face.all_gather_q_for_mla_decode, fullgraph=True, backend=backend)
    for rows in (1, 5, BOUND):
        for base_e in (False, True):
            q_nope, q_pe, out, lse = step_inputs(world, rows, 7 * rows + base_e, torch.bfloat16)[rank]
            got, eager = ag_rs(out, lse, coord, None, base_e), face.cp_lse_ag_out_rs_mla(out, lse, coord, None, base_e)
            assert got.shape == (H_LOC, rows, D) and torch.equal(got, eager)
            torch.testing.assert_close(got, ref_cp_lse_ag_out_rs_mla(out, lse, coord, None, base_e), rtol=1.6e-2,
                                       atol=1e-2)
            got, eager = a2a(out, lse, coord, base_e), face.dcp_a2a_lse_reduce(out, lse, coord, base_e)
            assert got.shape == (rows, H_LOC, D) and got.is_contiguous() and torch.equal(got, eager)
            torch.testing.assert_close(got, ref_dcp_a2a_lse_reduce(out, lse, coord, base_e), rtol=1.6e-2, atol=1e-2)
        g_nope, g_pe = gather(q_nope, q_pe)
        for a, b in zip((g_nope, g_pe), ref_all_gather_q_for_mla_decode(q_nope, q_pe, coord), strict=False):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        assert g_nope.data_ptr() == g_pe.data_ptr() + R * 2, "not two views of one cat([q_pe, q_nope])"
    ops = [{str(n.target) for n in gm.graph.nodes if n.op == "call_function"} for gm in graphs]
    assert len(ops) >= 3 and all(any(t.startswith("sdcp.") for t in names) for names in ops), ops
    face.teardown()
    return True


def test_seams_compile_fullgraph_two_ranks():
    assert run_workers(_compile_worker, 2, timeout=300) == [True, True]


# ---------------------------------------------------------------------------
# Operability: the start-up line, the require mode, versions, a local shutdown
# ---------------------------------------------------------------------------


def test_startup_line_on_sglangs_defaults_names_the_flags(fake, monkeypatch, caplog):
    """fi_a2a (Blackwell's default) and a replicated query projection (the
    DSA default) leave no seam: the warm-up says so, with the flags that
    turn each seam on; in the require mode start-up fails with that line."""
    from torch_sdcp.integrations import sglang as face

    monkeypatch.setattr(face_step, "prepare", lambda group, **k: pytest.fail("nothing to prepare"))
    fake.parallel.dcp_group = types.SimpleNamespace(unique_name="dcp:7", world_size=2)
    fake.parallel.dcp_comm_backend, fake.parallel.dcp_replicate_q_proj = "fi_a2a", True
    runner = fake.mods[RUNNER].BaseRunner(fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential(MLA(2))))
    with caplog.at_level(logging.INFO):
        face.after_pre_initialize(None, runner)
    lines = [r.getMessage() for r in caplog.records if "DCP group dcp:7" in r.getMessage()]
    assert len(lines) == 1, caplog.records
    assert "combine off" in lines[0] and "--dcp-comm-backend ag_rs or a2a" in lines[0], lines
    assert "query off" in lines[0] and "--dcp-replicate-q-proj" in lines[0], lines
    face.face.forget()
    monkeypatch.setenv("SDCP_SGLANG", "require")
    with pytest.raises(RuntimeError, match="SDCP_SGLANG=require.*combine, query"):
        face.after_pre_initialize(None, runner)
    monkeypatch.setenv("SDCP_SGLANG_SEAMS", "query")  # the combine not asked for: only the query refuses
    with pytest.raises(RuntimeError, match=r"seam\(s\) query cannot"):
        face.after_pre_initialize(None, runner)


def test_startup_line_when_dcp_is_off(fake, caplog):
    from torch_sdcp.integrations import sglang as face

    fake.parallel.dcp_enabled = False
    runner = fake.mods[RUNNER].BaseRunner(fake.mods[MODEL_RUNNER].ModelRunner(torch.nn.Sequential()))
    with caplog.at_level(logging.INFO):
        face.after_pre_initialize(None, runner)
    fake.parallel.dcp_enabled = True
    assert any("without DCP" in r.getMessage() for r in caplog.records), caplog.records


@pytest.mark.parametrize("version,accepted", [("0.5.23", True), ("0.5.23.post1", True), ("0.5.23+cu130", True),
                                              ("0.5.23.post2+cu130", True), ("0.5.24", False), ("0.5.23rc1", False),
                                              ("0.5.2", False)])
def test_version_policy(version, accepted):
    from torch_sdcp.integrations import sglang as face
    from torch_sdcp.integrations._engine import accepted_version

    assert accepted_version(version, face.SUPPORTED_SGLANG_VERSIONS) is accepted


def test_settings_refused_at_register(monkeypatch, caplog):
    import torch_sdcp_plugins.sglang as entry

    monkeypatch.setenv("SDCP_SGLANG", "1")
    monkeypatch.setenv("SDCP_SGLANG_SEAMS", "combine,bogus")
    entry._logged.clear()
    with caplog.at_level(logging.ERROR):
        entry.register()
    entry._logged.clear()
    assert any("SDCP_SGLANG_SEAMS" in r.getMessage() and "bogus" in r.getMessage() for r in caplog.records)


def _layer_tag_worker(rank, world):
    """Each seam runs inside the SGLang method that calls it, with the layer's
    ``layer_id`` as its call tag: the same layer on both ranks gives SGLang's
    result; rank r in layer 3 + r is named on every rank, for the query
    gather and the combine."""
    import types

    from torch_sdcp.integrations.sglang_calls import LAYER

    ns, face, coord = _installed_in_worker()
    mixin = ns.mods[FORWARD_MLA].DeepseekMLAForwardMixin
    assert face.prepare(coord, max_rows=BOUND, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R, dtype=torch.bfloat16,
                        device="cpu") == {"output_lse": True, "query": True}
    q_nope, q_pe, out, lse = step_inputs(world, 3, 7, torch.bfloat16)[rank]
    same = decode_step(ns, q_nope, q_pe, out, lse, True, layer=types.SimpleNamespace(layer_id=5))
    assert torch.equal(same[0], ref_all_gather_q_for_mla_decode(q_nope, q_pe, coord)[0])
    assert LAYER.tag is None, "the layer's tag outlived its method"
    layer = types.SimpleNamespace(layer_id=3 + rank)
    named = "rank 0 called with call tag 3, rank 1 with call tag 4"
    with pytest.raises(RuntimeError, match=named):
        mixin.forward_absorb_prepare(layer, None, None, lambda: ns.mods[FORWARD_MLA].all_gather_q_for_mla_decode(
            q_nope_out=q_nope, q_pe=q_pe), None)
    ns.parallel.dcp_comm_backend = "a2a"
    with pytest.raises(RuntimeError, match=named):
        mixin.forward_absorb_core(layer, None, None, None, None, lambda: ns.mods[FORWARD_MLA].dcp_a2a_lse_reduce(
            out.view(-1, H_LOC * world, D).contiguous(), lse.contiguous(), coord, is_lse_base_on_e=True), None, None,
            None, None)
    face.teardown()
    return True


def test_sglang_layers_carry_their_index_as_call_tag():
    assert run_workers(_layer_tag_worker, 2, timeout=120, env={"SDCP_SGLANG": "1"}) == [True, True]


def _local_shutdown_worker(rank, world):
    """Rank 0 runs SGLang's local abort while rank 1 is alive and not shutting
    down: rank 0 returns at once (no barrier), rank 1's next call raises (the
    abort reached it) instead of waiting out the timeout."""
    import time

    torch.set_num_threads(1)
    from torch_sdcp.integrations import sglang as face

    coord = Coordinator(dist.group.WORLD)
    assert face.prepare(coord, max_rows=8, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R, dtype=torch.float32,
                        device="cpu", query=False) == {"output_lse": True, "query": False}
    (ws,) = face.workspaces()
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        face.before_shutdown()
        elapsed = time.monotonic() - start
        face.before_shutdown()  # idempotent
        assert face.workspaces() == [] and ws.closed
        dist.barrier()
        return elapsed
    time.sleep(2.0)  # alive, not shutting down
    out, lse = torch.zeros(2, H_LOC * world, D), torch.zeros(2, H_LOC * world)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        ws.combine(out, lse)
    raised_after = time.monotonic() - start
    face.before_shutdown()
    dist.barrier()
    return raised_after


def test_local_shutdown_never_waits_on_a_peer():
    elapsed, raised_after = run_workers(_local_shutdown_worker, 2, timeout=120,
                                        env={"SDCP_SGLANG_TIMEOUT_S": "20"})
    assert elapsed < 1.0, f"the local release took {elapsed:.2f} s"
    assert raised_after < 5.0, f"the peer's call waited {raised_after:.2f} s"


def test_plugin_check_on_sglangs_defaults(monkeypatch):
    from torch_sdcp import plugin_check

    monkeypatch.setenv("SDCP_SGLANG", "require")
    status, text = plugin_check.report(["--engine", "sglang", "--dcp-size", "8", "--dcp-comm-backend", "fi_a2a",
                                        "--dcp-replicate-q-proj", "--num-heads", "128", "--rows", "512"])
    assert status == 1 and "--dcp-comm-backend ag_rs or a2a" in text and "--dcp-replicate-q-proj" in text, text
    assert "total per rank: 0 bytes" in text, text
    monkeypatch.setenv("SDCP_SGLANG", "1")
    status, text = plugin_check.report(["--engine", "sglang", "--dcp-size", "8", "--dcp-comm-backend", "a2a",
                                        "--num-heads", "128", "--rows", "512"])
    assert status == 0 and "combine ON" in text and "query ON" in text, text
    assert "Output/LSE workspace:" in text and "query workspace:" in text, text


# ---------------------------------------------------------------------------
# Command-line options, through SGLang's ServerArgs hooks
# ---------------------------------------------------------------------------


@pytest.fixture
def cli(fake, monkeypatch):
    """The stand-in's ServerArgs with the entry point's CLI hooks applied by
    SGLang's registry, the plugin off (every SDCP_SGLANG* variable unset,
    restored afterwards)."""
    import torch_sdcp_plugins.sglang as entry
    from torch_sdcp_settings import SGLANG

    for name in SGLANG.names():
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(entry, "_cli_registered", [])
    entry._logged.clear()
    entry.register()
    fake.mods[REGISTRY].HookRegistry.apply_hooks()
    yield fake.mods[SERVER_ARGS].ServerArgs
    entry._logged.clear()


def _parse(server_args, argv):
    import argparse

    parser = argparse.ArgumentParser(prog="sglang serve")
    server_args.add_cli_args(parser)
    return parser, server_args.from_cli_args(parser.parse_args(argv))


def test_cli_options_in_help_registered_while_off(cli):
    """Off, the entry point registers the options and nothing else: --help
    shows them (with their variables), SGLang's functions stay its own."""
    import torch_sdcp_plugins.sglang as entry
    from torch_sdcp.integrations import sglang as face

    assert not face.is_installed() and entry._cli_registered
    parser, _ = _parse(cli, [])
    text = " ".join(parser.format_help().split())
    for option, env in (("--sdcp {", "SDCP_SGLANG (unset: off)"), ("--sdcp-seams", "SDCP_SGLANG_SEAMS"),
                        ("--sdcp-max-rows", "SDCP_SGLANG_MAX_ROWS"), ("--sdcp-timeout-s", "SDCP_SGLANG_TIMEOUT_S")):
        assert option in text and env in text, (option, text)
    assert "{off,on,require}" in text and "wins over its environment variable" in text


def test_cli_options_while_off_import_nothing_of_torch_sdcp():
    """In a fresh process with the stand-in: off, the entry point's options
    land in SGLang's parser and nothing of torch_sdcp is imported."""
    code = ("import sys, argparse; sys.path.insert(0, 'test'); "
            "from _sglang_stand_in import build_fake_sglang; ns = build_fake_sglang(); sys.modules.update(ns.mods); "
            "import torch_sdcp_plugins.sglang as e; e.register(); "
            f"ns.mods[{REGISTRY!r}].HookRegistry.apply_hooks(); p = argparse.ArgumentParser(); "
            f"ns.mods[{SERVER_ARGS!r}].ServerArgs.add_cli_args(p); assert '--sdcp-seams' in p.format_help(); "
            "bad = [m for m in sys.modules if m == 'torch_sdcp' or m.startswith('torch_sdcp.')]; "
            "assert not bad, bad; print('off')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCP_SGLANG")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stdout + out.stderr


def test_cli_options_reach_the_environment_and_the_dump(cli):
    """from_cli_args (which keeps ServerArgs fields only) writes each option
    given into its variable; the dump shows the values in effect; a process
    started afterwards (SGLang's schedulers) reads them."""
    from torch_sdcp_settings import SGLANG

    _, args = _parse(cli, ["--model-path", "m", "--sdcp", "require", "--sdcp-seams", "QUERY",
                           "--sdcp-max-rows", "64", "--sdcp-timeout-s", "30"])
    assert not hasattr(args, "sdcp") and args.model_path == "m"
    assert (os.environ["SDCP_SGLANG"], os.environ["SDCP_SGLANG_SEAMS"], os.environ["SDCP_SGLANG_MAX_ROWS"],
            os.environ["SDCP_SGLANG_TIMEOUT_S"]) == ("require", "query", "64", "30")
    dump = args.resolved_dict()
    assert dump["model_path"] == "m"
    assert {k: dump[k] for k in ("sdcp", "sdcp_seams", "sdcp_max_rows", "sdcp_timeout_s")} == \
        {"sdcp": "require", "sdcp_seams": "query", "sdcp_max_rows": 64, "sdcp_timeout_s": 30.0}
    child = subprocess.run([sys.executable, "-c", "from torch_sdcp_settings import SGLANG as s; "
                            "print(s.mode()[0], s.seams(), s.max_rows_cap(), s.timeout_s())"],
                           capture_output=True, text=True, timeout=120)
    assert child.stdout.split() == ["require", "('query',)", "64", "30.0"], child.stdout + child.stderr
    assert SGLANG.required()


def test_cli_option_wins_over_the_environment(cli, monkeypatch, caplog):
    monkeypatch.setenv("SDCP_SGLANG", "1")
    monkeypatch.setenv("SDCP_SGLANG_SEAMS", "combine")
    with caplog.at_level(logging.WARNING):
        _, args = _parse(cli, ["--sdcp", "off"])
    assert os.environ["SDCP_SGLANG"] == "off" and os.environ["SDCP_SGLANG_SEAMS"] == "combine"
    assert args.resolved_dict()["sdcp"] == "off" and args.resolved_dict()["sdcp_seams"] == "combine"
    assert [r.getMessage() for r in caplog.records] == ["torch_sdcp: --sdcp off wins over SDCP_SGLANG='1' (the "
                                                        "command line overrides the environment)"]


def test_cli_not_given_leaves_the_environment(cli, monkeypatch):
    monkeypatch.setenv("SDCP_SGLANG", "1")
    _, args = _parse(cli, [])
    assert os.environ["SDCP_SGLANG"] == "1" and "SDCP_SGLANG_SEAMS" not in os.environ
    dump = args.resolved_dict()
    assert (dump["sdcp"], dump["sdcp_seams"], dump["sdcp_max_rows"], dump["sdcp_timeout_s"]) == \
        ("on", "combine,query", None, 600.0)


@pytest.mark.parametrize("argv,words", [(["--sdcp", "yes"], ["invalid choice: 'yes'"]),
                                        (["--sdcp-seams", "combine,topk"], ["--sdcp-seams", "unknown: topk"]),
                                        (["--sdcp-max-rows", "0"], ["--sdcp-max-rows", "positive int", "'0'"]),
                                        (["--sdcp-timeout-s", "soon"], ["--sdcp-timeout-s", "'soon'"])])
def test_cli_bad_value_is_a_usage_error(cli, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        _parse(cli, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err
    assert "SDCP_SGLANG" not in os.environ


def test_cli_hook_that_fails_leaves_sglangs_parsing_alone(cli, monkeypatch, caplog):
    """Registered on or off, an option hook that raises never breaks
    SGLang's parsing: SGLang's result is kept and the failure logged once."""
    import torch_sdcp_plugins.sglang as entry

    monkeypatch.setattr(entry, "SGLANG", None)  # every hook's first read of the settings raises
    with caplog.at_level(logging.ERROR):
        parser, args = _parse(cli, [])
    assert isinstance(args, cli) and "--sdcp" not in parser.format_help()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("add_cli_args hook failed (AttributeError" in m for m in lines) == 1, lines
    assert sum("from_cli_args hook failed (AttributeError" in m for m in lines) == 1, lines


# ---------------------------------------------------------------------------
# Operability in SGLang's real start-up
# ---------------------------------------------------------------------------


def test_require_ends_the_process_when_the_plugin_cannot_install(fake, monkeypatch):
    """SGLang's loader (``load_plugins``) catches every Exception a plugin
    raises and goes on with rc 0: in the require mode the entry raises
    SystemExit, which it does not catch, for each way install can fail."""
    import torch_sdcp_plugins.sglang as entry

    monkeypatch.setattr(entry, "_logged", set())
    monkeypatch.setenv("SDCP_SGLANG", "require")
    fake.mods["sglang.version"].__version__ = "0.5.99"  # a version outside the table
    with pytest.raises(SystemExit, match="SDCP_SGLANG=require"):
        entry.register()
    monkeypatch.setenv("SDCP_SGLANG_SEAMS", "combine,bogus")  # a bad setting
    with pytest.raises(SystemExit, match="bogus"):
        entry.register()
    monkeypatch.setenv("SDCP_SGLANG", "1")  # on: logged, the process goes on
    entry.register()


def test_a_selected_seam_left_to_sglang_is_a_warning(fake, caplog):
    """With the plugin on, a selected seam that stays SGLang's (a replicated
    query projection) is logged at WARNING, seen at --log-level warning."""
    from torch_sdcp.integrations import sglang as face

    fake.parallel.dcp_group = types.SimpleNamespace(unique_name="dcp:8", world_size=2)
    fake.parallel.dcp_comm_backend, fake.parallel.dcp_replicate_q_proj = "a2a", True
    plan = face.seam_plan(fake.parallel, fake.parallel.dcp_group)
    plan.decide("combine", True, "peer memory")  # the other seam is taken: still a warning
    levels = []
    plan.emit(lambda level, text: levels.append(level))
    assert levels == ["warning"], levels


def test_startup_lines_survive_a_cached_info_once(monkeypatch, caplog):
    """transformers installs a cached ``info_once`` on logging.Logger; the
    face logs through the plain methods with its own once-set, so a line
    logged again after forget() (a new DCP group, a new test) is not dropped."""
    from torch_sdcp.integrations import sglang as face

    monkeypatch.setattr(logging.Logger, "info_once", lambda self, *a, **k: None, raising=False)
    face.face.forget()
    with caplog.at_level(logging.INFO):
        face.face.log_once("info", "probe", "torch_sdcp: probe line %d", 1)
    face.face.forget()
    assert [r.getMessage() for r in caplog.records] == ["torch_sdcp: probe line 1"]


def _sglang_on_path(tmp_path, importable):
    """A package named sglang on sys.path: importable (a hook registry), or
    one whose import fails halfway (a dependency missing), leaving its
    namespace subpackage in sys.modules as SGLang's real __init__ does."""
    pkg = tmp_path / "sglang"
    (pkg / "srt" / "plugins").mkdir(parents=True)
    if importable:
        (pkg / "__init__.py").write_text("")
        (pkg / "srt" / "__init__.py").write_text("")
        (pkg / "srt" / "plugins" / "__init__.py").write_text("")
        (pkg / "srt" / "plugins" / "hook_registry.py").write_text(
            "import enum\nclass HookType(enum.Enum):\n    BEFORE, AFTER, REPLACE, AROUND = 1, 2, 3, 4\n"
            "class HookRegistry:\n    hooks = []\n    @classmethod\n"
            "    def register(cls, target, hook, kind):\n        cls.hooks.append(target)\n")
    else:
        (pkg / "__init__.py").write_text("import sglang.srt.environ\n")
        (pkg / "srt" / "environ.py").write_text("import a_dependency_that_is_not_installed\n")


@pytest.mark.parametrize("importable", [True, False], ids=["importable", "half-imported"])
def test_entry_with_sglang_on_the_path(tmp_path, monkeypatch, caplog, importable):
    """The entry never raises whether SGLang imports or fails halfway (the
    second import of a half-imported package raises KeyError, not
    ImportError); a bad setting is still named."""
    import torch_sdcp_plugins.sglang as entry

    _sglang_on_path(tmp_path, importable)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(entry, "_logged", set())
    monkeypatch.setattr(entry, "_cli_registered", [])
    monkeypatch.setenv("SDCP_SGLANG", "1")
    monkeypatch.setenv("SDCP_SGLANG_SEAMS", "combine,bogus")
    try:
        with caplog.at_level(logging.ERROR):
            entry.register()
            entry.register()
        assert any("SDCP_SGLANG_SEAMS" in r.getMessage() and "bogus" in r.getMessage() for r in caplog.records)
        assert entry._cli_registered == ([True] if importable else [])
    finally:
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]
