"""The plugin inside a real vLLM 0.33 or 0.34 (vLLM and its Python dependencies
installed, e.g. by tools/vllm_env.sh, with torch_sdcp installed so that its
entry point is registered): loaded by vLLM's own ``load_general_plugins``,
every patch lands on vLLM's real classes and functions, and a plugin that
fails leaves vLLM starting. Each case runs in a subprocess (the conformance
test asserts that this process never imports vLLM). Skipped where vLLM cannot
be imported."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _vllm_importable() -> str | None:
    """None when ``import vllm.plugins`` works in a subprocess, else why not."""
    out = subprocess.run([sys.executable, "-c", "import vllm.plugins, vllm.v1.attention.ops.dcp"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["unknown"])[-1]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    why = _vllm_importable()
    if why is not None:
        pytest.skip(f"vLLM is not importable here ({why}); tools/vllm_env.sh builds an environment where it is")
    full = {k: v for k, v in os.environ.items() if not k.startswith("SDCP_VLLM")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=full,
                          timeout=600)


PATCHES_LAND = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from torch_sdcp.integrations import vllm as p
import vllm.distributed, vllm.model_executor.layers.sparse_attn_indexer as idx, vllm.v1.attention.ops.dcp as dcp
assert p.is_installed(), "not installed"
assert dcp.MLADCPManager._init_combine is p._manager_init_combine
assert dcp.MLADCPManager._init_query_gather is p._manager_init_query_gather
assert dcp.MLADCPManager.__init__ is p._manager_init
assert idx._merge_dcp_topk_global is p.merge_dcp_topk_global
assert vllm.distributed.destroy_model_parallel is p.destroy_model_parallel
print("patched")
"""


def test_loaded_by_vllm_and_patches_land():
    out = _run(PATCHES_LAND, SDCP_VLLM="1")
    assert out.returncode == 0 and "patched" in out.stdout, out.stdout + out.stderr


LAYERS_WRAPPED = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from torch_sdcp.integrations import vllm as p
import vllm.model_executor.layers.attention.mla_attention as mla
kimi = "vllm.models.kimi_k3.nvidia.mla"
mla_init = mla.MLAAttention.__init__
assert mla_init.__wrapped__.__module__ == mla.__name__, "MLAAttention not wrapped"
assert kimi not in sys.modules, "the plugin imported Kimi-K3's module"
import vllm.models.kimi_k3.nvidia.mla as k
kimi_init = k.MultiHeadLatentAttention.__init__
assert kimi_init.__wrapped__.__module__ == kimi, "Kimi-K3's layer not wrapped on import"
p.uninstall()
assert mla.MLAAttention.__init__ is mla_init.__wrapped__, "MLAAttention not restored"
assert k.MultiHeadLatentAttention.__init__ is kimi_init.__wrapped__, "Kimi-K3's layer not restored"
print("wrapped")
"""


def test_layer_constructors_wrapped_and_kimi_k3_on_import():
    """vLLM's real MLAAttention is wrapped at install; Kimi-K3's real layer
    module is not imported by the plugin, and is wrapped when imported (by
    the finder); uninstall() restores both."""
    out = _run(LAYERS_WRAPPED, SDCP_VLLM="1")
    assert out.returncode == 0 and "wrapped" in out.stdout, out.stdout + out.stderr


def test_off_loads_nothing_of_ours():
    code = ("import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "assert not [m for m in sys.modules if m.startswith('torch_sdcp.') or m == 'torch_sdcp'], 'imported'; "
            "print('off')")
    out = _run(code)
    assert out.returncode == 0 and "off" in out.stdout, out.stdout + out.stderr


def test_a_failing_plugin_leaves_vllm_starting():
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "import vllm.v1.attention.ops.dcp as dcp; "
            "assert dcp.MLADCPManager._init_combine.__module__ == dcp.__name__; print('started')")
    out = _run(code, SDCP_VLLM="1", SDCP_VLLM_SEAMS="combine,bogus")
    assert out.returncode == 0 and "started" in out.stdout, out.stdout + out.stderr
    assert "SDCP_VLLM_SEAMS" in out.stderr + out.stdout, "the refusal must be logged"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_manager_seams_equal_vllms_own():
    """Two ranks on vLLM's own gloo DCP group: a real MLADCPManager per
    backend, the patched combine, query gather and top-K merge against vLLM's
    functions (test/_vllm_real_ranks.py says what is compared)."""
    why = _vllm_importable()
    if why is not None:
        pytest.skip(f"vLLM is not importable here ({why}); tools/vllm_env.sh builds an environment where it is")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCP_VLLM")}
    env.update(SDCP_VLLM="1", WORLD_SIZE="2", MASTER_PORT=str(_free_port()), SDCP_VLLM_TIMEOUT_S="120")
    script = os.path.join(ROOT, "test", "_vllm_real_ranks.py")
    ranks = [subprocess.Popen([sys.executable, script], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    try:
        for p in ranks:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in ranks:
            p.kill()
    for r, (p, out) in enumerate(zip(ranks, outs, strict=False)):
        assert p.returncode == 0 and f"rank {r}: " in out and "checks passed" in out, f"rank {r}:\n{out[-6000:]}"
