"""The plugin inside a real SGLang 0.5.23 (SGLang and its Python dependencies
installed, e.g. by tools/sglang_env.sh, with torch_sdcp installed so that its
entry point is registered): loaded by SGLang's own ``load_plugins`` (what
SGLang's engine, scheduler and detokenizer processes call at start-up), every
hook lands on SGLang's real functions and on the modules that imported them
by name, nothing of torch_sdcp is imported while the setting is off, and a
plugin that refuses leaves SGLang starting, logged. Then two gloo ranks run
SGLang's real ``comm.py`` functions on the CPU (its Triton kernels under
Triton's interpreter, ``TRITON_INTERPRET=1``; a real ``GroupCoordinator`` on
gloo) beside the patched ones on the host backend: equal results for both
combine functions, both LSE bases, and the query gather's two-view contract.

Each case runs in a subprocess (test_sglang_conformance.py asserts that this
process never imports SGLang). Skipped where SGLang cannot be imported; what
blocks a case on a CPU machine is in docs/SGLANG.md.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from _dist import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMM = "sglang.srt.layers.dcp.comm"
FORWARD_MLA = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla"
SEAMS = ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "all_gather_q_for_mla_decode")
H_LOC, D, R, BOUND = 2, 32, 16, 8  # local heads, kv_lora_rank, qk_rope_head_dim, rows bound


@functools.cache
def _sglang_importable() -> str | None:
    """None when SGLang's plugin loader and DCP functions import in a
    subprocess, else why not."""
    out = subprocess.run([sys.executable, "-c", f"import sglang.srt.plugins, {COMM}"], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["unknown"])[-1]


def _skip_without_sglang() -> None:
    why = _sglang_importable()
    if why is not None:
        pytest.skip(f"SGLang is not importable here ({why}); tools/sglang_env.sh builds an environment where it is")


def _env(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SDCP_SGLANG", "SGLANG_PLUGINS"))}
    full.update(env)
    return full


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    _skip_without_sglang()
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(**env),
                          timeout=600)


# The call site and the package imported the seams by name before the plugins
# load (SGLang's registry must rewrite those bindings); every hook of HOOKS is
# then chained by SGLang's registry around SGLang's own function.
HOOKS_LAND = f"""
import importlib, logging, pkgutil
logging.basicConfig(level=logging.INFO)
comm = importlib.import_module({COMM!r})
own = {{name: getattr(comm, name) for name in {SEAMS!r}}}
callers = [importlib.import_module("sglang.srt.layers.dcp")]
try:
    callers.append(importlib.import_module({FORWARD_MLA!r}))
except Exception as e:
    print("CALL-SITE-BLOCKED", type(e).__name__, e)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from torch_sdcp.integrations import sglang as p
assert p.is_installed(), "not installed"

def chained(fn):
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            pass
    return cells

for target, kind, hook in p.HOOKS:
    owner, name = target.rsplit(".", 1)
    fn = getattr(pkgutil.resolve_name(owner), name)
    assert target in HookRegistry._patched, target + " was not applied"
    assert any(c is hook for c in chained(fn)), target + ": the hook is not in SGLang's wrapper"
    print("LANDED", kind, target)
for name in {SEAMS!r}:
    wrapper = getattr(comm, name)
    assert wrapper.__wrapped__ is own[name] and p.engine.originals[name] is own[name], name
    for mod in callers:
        assert getattr(mod, name) is wrapper, mod.__name__ + "." + name + " keeps SGLang's own function"
        print("REBOUND", mod.__name__, name)
"""


def test_loaded_by_sglang_and_hooks_land():
    out = _run(HOOKS_LAND, SDCP_SGLANG="1")
    assert out.returncode == 0, out.stdout + out.stderr
    landed = [line for line in out.stdout.splitlines() if line.startswith("LANDED")]
    from torch_sdcp.integrations import sglang as face

    assert len(landed) == len(face.HOOKS), out.stdout
    assert "CALL-SITE-BLOCKED" not in out.stdout, "forward_mla does not import here: " + out.stdout
    rebound = [line for line in out.stdout.splitlines() if line.startswith("REBOUND")]
    assert len(rebound) == 6, out.stdout  # three seams in the package and in forward_mla


def test_off_loads_nothing_of_ours():
    code = (f"import sys, {COMM} as comm; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "assert not [m for m in sys.modules if m.startswith('torch_sdcp.') or m == 'torch_sdcp'], 'imported'; "
            "assert 'torch_sdcp_plugins.sglang' in sys.modules, 'the entry point was not run'; "
            f"assert not [n for n in {SEAMS!r} if hasattr(getattr(comm, n), '__wrapped__')], 'wrapped'; "
            "print('off')")
    out = _run(code)
    assert out.returncode == 0 and "off" in out.stdout, out.stdout + out.stderr


# Off: the options still land in SGLang's parser (prepare_server_args is what
# `sglang serve` and `python -m sglang.launch_server` parse with), and an
# option given is written into its variable for the processes started next.
OPTIONS = """
import argparse, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs, prepare_server_args
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
text = " ".join(parser.format_help().split())
assert "--sdcp-seams SEAMS" in text and "SDCP_SGLANG_SEAMS" in text, text
args = prepare_server_args(["--model-path", "unused", "--sdcp", "on", "--sdcp-seams", "query"])
assert not hasattr(args, "sdcp"), "an option became a ServerArgs field"
assert (os.environ["SDCP_SGLANG"], os.environ["SDCP_SGLANG_SEAMS"]) == ("on", "query"), os.environ
assert not [m for m in sys.modules if m == "torch_sdcp" or m.startswith("torch_sdcp.")], "imported while off"
print("options")
"""


def test_options_through_sglangs_parser():
    out = _run(OPTIONS)
    assert out.returncode == 0 and "options" in out.stdout, out.stdout + out.stderr


STARTS = (f"import logging; logging.basicConfig(level=logging.INFO); {{before}}; "
          f"import {COMM} as comm; from sglang.srt.plugins import load_plugins; load_plugins(); "
          f"assert not [n for n in {SEAMS!r} if hasattr(getattr(comm, n), '__wrapped__')], 'wrapped'; "
          "print('started')")


@pytest.mark.parametrize("case", ["bad-setting", "unknown-version"])
def test_a_refusing_plugin_leaves_sglang_starting(case):
    if case == "bad-setting":
        out = _run(STARTS.format(before="pass"), SDCP_SGLANG="maybe")
        logged = "SDCP_SGLANG='maybe' is not one of"
    else:  # a release the plugin was not checked against
        out = _run(STARTS.format(before="import sglang.version as v; v.__version__ = '0.5.99'"), SDCP_SGLANG="1")
        logged = "SGLang 0.5.99 is not a version this plugin knows"
    assert out.returncode == 0 and "started" in out.stdout, out.stdout + out.stderr
    assert logged in out.stderr, "the refusal must be logged: " + out.stderr


# ---------------------------------------------------------------------------
# Two ranks: SGLang's real functions against the patched ones
# ---------------------------------------------------------------------------


def _coordinator(rank, world):
    """SGLang's own GroupCoordinator over the workers' gloo world, published as
    the DCP group (what SGLang's initialize_model_parallel does on a GPU)."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    coord = GroupCoordinator([list(range(world))], rank, dist.get_backend(), use_pynccl=False, use_mscclpp=False,
                             use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                             use_hpu_communicator=False, use_xpu_communicator=False, group_name="dcp")
    get_parallel()._stamp["dcp_group"] = coord  # the one process-wide handle both paths read
    return coord


def _pre_capture(coord):
    """SGLang's real BaseRunner._pre_initialize_fi_a2a_workspace, as wrapped
    by its registry, on a runner whose model has DCP MLA layers: SGLang's body
    returns (the backend is not fi_a2a), the plugin's AFTER hook prepares the
    workspaces. The DCP settings are stamped where initialize_model_parallel
    writes them; the runner carries only what the hook reads."""
    import types

    import torch
    from sglang.srt.model_executor.runner.base_runner import BaseRunner
    from sglang.srt.runtime_context import get_parallel

    get_parallel()._stamp.update(dcp_enabled=True, dcp_comm_backend="a2a", dcp_replicate_q_proj=False)
    layers = []
    for _ in range(2):
        layer = torch.nn.Module()
        layer.dcp_size, layer.num_local_heads, layer.kv_lora_rank, layer.qk_rope_head_dim = 2, H_LOC, D, R
        layers.append(layer)
    model_runner = types.SimpleNamespace(model=torch.nn.Sequential(*layers), device="cpu",
                                         model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    runner = types.SimpleNamespace(model_runner=model_runner, _widest_decode_rows=lambda: BOUND)
    assert BaseRunner._pre_initialize_fi_a2a_workspace(runner) is None
    assert get_parallel().dcp_group is coord


def _own_path_taken(*args, **kwargs):
    raise AssertionError("the patched function fell back to SGLang's own")


def _cpu_collectives():
    """SGLang registers its collective custom ops (``sglang::reg_*``) for the
    CUDA dispatch key only on any machine that is not NPU, XPU or MUSA; their
    bodies call the group's own methods. The same bodies for CPU tensors (the
    library object keeps the registration alive)."""
    import torch
    from sglang.srt.distributed import parallel_state as ps

    def reduce_scatter(output, input_, group_name):
        ps._groups[group_name]()._reduce_scatter_tensor(output, input_)

    def all_to_all(output, input_, group_name):
        ps._groups[group_name]()._all_to_all_single(output, input_)

    lib = torch.library.Library("sglang", "IMPL")
    lib.impl("reg_reduce_scatter_tensor", reduce_scatter, "CPU")
    lib.impl("reg_all_to_all_single", all_to_all, "CPU")
    return lib


def _real_worker(rank, world, rows_list):
    import torch
    from _sglang_stand_in import step_inputs  # the same inputs as the stand-in protocol test
    from sglang.srt.plugins import load_plugins

    torch.set_num_threads(1)
    load_plugins()
    import sglang.srt.layers.dcp.comm as comm

    from torch_sdcp.integrations import sglang as face

    assert face.is_installed()
    own = {name: getattr(comm, name).__wrapped__ for name in SEAMS}
    face.configure(originals=dict.fromkeys(SEAMS, _own_path_taken))  # the patched calls must stay on peer memory
    coord, lib = _coordinator(rank, world), _cpu_collectives()
    _pre_capture(coord)
    assert [type(w).__name__ for w in face.workspaces()] == ["OutputLSEWorkspace", "QueryWorkspace"]
    # An fp32 model's combine, prepared directly (what the hook does for a model of that dtype).
    done = face.prepare(coord, max_rows=BOUND, local_heads=H_LOC, kv_lora_rank=D, rope_dim=R, dtype=torch.float32,
                        device="cpu", query=False)
    assert done == {"output_lse": True, "query": False}, done
    tol = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}
    compared = []
    for i, rows in enumerate(rows_list):
        for dtype in (torch.bfloat16, torch.float32):
            for base_e in (False, True):
                q_nope, q_pe, out, lse = step_inputs(world, rows, 100 * i + 10 * base_e + (dtype == torch.float32),
                                                 dtype)[rank]
                got = comm.cp_lse_ag_out_rs_mla(out, lse, coord, None, base_e)
                want = own["cp_lse_ag_out_rs_mla"](out, lse, coord, None, base_e)
                assert got.shape == want.shape == (H_LOC, rows, D) and got.dtype == want.dtype == dtype
                torch.testing.assert_close(got, want, **tol[dtype])
                got = comm.dcp_a2a_lse_reduce(out, lse, coord, base_e)
                want = own["dcp_a2a_lse_reduce"](out, lse, coord, base_e)
                assert got.shape == want.shape == (rows, H_LOC, D) and got.dtype == want.dtype == dtype
                torch.testing.assert_close(got, want, **tol[dtype])
                if rank == 0:
                    assert (got[0, 0] == 0).all() and (want[0, 0] == 0).all(), "an all-empty (row, head) is 0"
                compared.append(("ag_rs+a2a", rows, str(dtype), base_e))
        got = comm.all_gather_q_for_mla_decode(q_nope, q_pe)
        want = own["all_gather_q_for_mla_decode"](q_nope, q_pe)
        for a, b in zip(got, want, strict=False):
            assert a.shape == b.shape and a.dtype == b.dtype and a.stride(-1) == b.stride(-1) == 1
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "the gather is not bit-exact"
        assert got[0].shape == (rows, world * H_LOC, D) and got[1].shape == (rows, world * H_LOC, R)
        assert got[0].data_ptr() == got[1].data_ptr() + R * 2, "not two views of one cat([q_pe, q_nope])"
        compared.append(("query", rows))
    face.teardown()
    del lib
    return compared


def test_real_functions_equal_the_patched_ones_two_ranks():
    _skip_without_sglang()
    rows_list = [1, 5, BOUND]
    results = run_workers(_real_worker, 2, args=(rows_list,), timeout=600,
                          env={"SDCP_SGLANG": "1", "TRITON_INTERPRET": "1"})
    assert results[0] == results[1] and len(results[0]) == len(rows_list) * 5, results
