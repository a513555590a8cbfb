"""``python -m torch_sdcp.plugin_check --gate``: the peer-memory gate run on
this node as start-up would run it (here on the host backend, which has no
GPU to need), bounded, and a failed gate turning every seam off; every bad
option a usage error naming it (exit 2, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from torch_sdcp import plugin_check

ARGS = ["--engine", "sglang", "--dcp-size", "2", "--dcp-comm-backend", "a2a", "--num-heads", "64", "--rows", "64"]


def test_gate_passes_on_two_host_ranks(monkeypatch):
    monkeypatch.setenv("SDCP_SGLANG", "require")
    status, text = plugin_check.report([*ARGS, "--gate", "--gate-backend", "host"])
    assert status == 0, text
    assert "peer-memory gate: passed on 2 host ranks" in text, text
    assert "combine ON (peer memory (the gate passed on 2 host ranks))" in text, text
    assert "Output/LSE workspace:" in text and "query workspace:" in text, text


def test_gate_that_does_not_finish_turns_every_seam_off(monkeypatch):
    """A gate bounded below what two processes need to start: reported with
    the ranks it waited for, every seam off, and the require mode refuses."""
    monkeypatch.setenv("SDCP_SGLANG", "require")
    t0 = time.monotonic()
    status, text = plugin_check.report([*ARGS, "--gate", "--gate-backend", "host", "--gate-timeout-s", "0.3"])
    assert time.monotonic() - t0 < 15, "the gate's bound was not kept"
    assert status == 1, text
    assert "peer-memory gate: failed on 2 host ranks: rank(s) [0, 1] did not finish within 0.3 s" in text, text
    assert "combine off (the peer-memory gate failed)" in text and "query off (the peer-memory gate failed)" in text
    assert "SDCP_SGLANG=require: start-up would stop" in text and "total per rank: 0 bytes" in text, text


def test_gate_needs_a_gpu_per_rank():
    status, text = plugin_check.report(["--engine", "vllm", "--dcp-size", "2", "--num-heads", "64", "--gate"])
    if "passed on 2 GPUs" in text:  # a node with two GPUs that map each other's memory
        return
    assert status == 0 and "combine off (the peer-memory gate failed)" in text, text
    assert "peer-memory gate: failed on 2 GPUs:" in text, text


def test_gate_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "torch_sdcp.plugin_check", *ARGS, "--gate", "--gate-backend", "host"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "peer-memory gate: passed on 2 host ranks" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("argv, says", [
    (["--engine", "vllm", "--rows", "0"], "argument --rows: expected an integer >= 1, got 0"),
    (["--engine", "vllm", "--rows", "-1"], "argument --rows: expected an integer >= 1, got -1"),
    (["--rows", "0"], "argument --rows: expected an integer >= 1, got 0"),
    (["--engine", "vllm", "-dcp", "0"],
     "argument --decode-context-parallel-size/--dcp-size/-dcp: expected an integer >= 1, got 0"),
    (["--engine", "sglang", "--dcp-size", "-2"],
     "argument --decode-context-parallel-size/--dcp-size/-dcp: expected an integer >= 1, got -2"),
    (["--engine", "vllm", "--num-heads", "0"], "argument --num-heads: expected an integer >= 1, got 0"),
    (["--engine", "vllm", "-dcp", "3", "--num-heads", "64"],
     "argument --num-heads: expected a multiple of the DCP size 3 (--decode-context-parallel-size), got 64"),
    (["--engine", "vllm", "--num-ubatches", "0"], "argument --num-ubatches: expected an integer >= 1, got 0"),
    (["--engine", "vllm", "--kv-lora-rank", "x"], "argument --kv-lora-rank: expected an integer >= 1, got 'x'"),
    (["--engine", "vllm", "--index-topk", "0"], "argument --index-topk: expected an integer >= 1, got 0"),
    (["--engine", "vllm", "--dcp-comm-backend", "fi_a2a"],
     "argument --dcp-comm-backend: expected one of ag_rs, a2a with --engine vllm, got 'fi_a2a'"),
    (["--engine", "vllm", "--gate-timeout-s", "nan"], "argument --gate-timeout-s: expected a number of seconds > 0"),
    (["--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
    (["--rows-bound", "8"],
     "unrecognized arguments: --rows-bound 8 (and the required --engine vllm|sglang is missing)"),
    (["--engine", "vllm", "--nope"], "unrecognized arguments: --nope"),
    ([], "argument --engine: expected vllm or sglang, got none"),
    (["--gate"], "argument --engine: expected vllm or sglang, got none (--gate runs the peer-memory gate of that "
                 "engine's DCP group: it needs --engine)"),
])
def test_a_bad_option_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        plugin_check.report(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torch_sdcp.plugin_check") and f"error: {says}" in err, err


def test_a_bad_option_from_the_command_line_exits_2_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "torch_sdcp.plugin_check", "--engine", "vllm", "--rows", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "argument --rows: expected an integer >= 1, got 0" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_the_engines_own_options_and_a_bad_switch(monkeypatch):
    """SGLang's --sdcp options are taken as SGLang takes them (they win over
    the variables); a bad switch value exits 1, as the docstring says."""
    from torch_sdcp import plugin_check

    monkeypatch.delenv("SDCP_SGLANG", raising=False)
    base = ["--engine", "sglang", "--dcp-size", "2", "--num-heads", "16", "--dcp-replicate-q-proj"]
    status, text = plugin_check.report(base + ["--sdcp", "require"])
    assert status == 1 and "SDCP_SGLANG=require: start-up would stop" in text, text
    assert "SDCP_SGLANG" not in os.environ, "the option leaked into the environment"
    status, text = plugin_check.report(base + ["--sdcp", "on", "--sdcp-seams", "combine"])
    assert status == 0 and "query" not in text.split("\n")[0].split("seams selected:")[1].split(";")[0], text
    monkeypatch.setenv("SDCP_SGLANG", "bogus")
    status, text = plugin_check.report(base)
    assert status == 1 and "'bogus'" in text and "SDCP_SGLANG" in text, text
    with pytest.raises(SystemExit) as e:
        plugin_check.report(["--engine", "vllm", "--sdcp", "on"])
    assert e.value.code == 2


VLLM_ARGS = ["--engine", "vllm", "--decode-context-parallel-size", "2", "--dcp-comm-backend", "a2a",
             "--num-heads", "64", "--rows", "64"]


@pytest.mark.parametrize("plugins,left_out", [(None, False), ("torch_sdcp", False), ("other,torch_sdcp", False),
                                              ("", True), ("other", True), ("other, torch_sdcp", True)])
def test_vllm_plugins_that_leave_the_plugin_out(plugins, left_out, monkeypatch):
    """vLLM loads only the names of VLLM_PLUGINS (split on ',', unstripped):
    one that leaves the plugin out is said, and the require mode exits 1,
    since a plugin vLLM does not load can stop nothing."""
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    for mode, status in (("1", 0), ("require", 1 if left_out else 0)):
        monkeypatch.setenv("SDCP_VLLM", mode)
        got, text = plugin_check.report(VLLM_ARGS)
        assert ("leaves the plugin out" in text) == left_out, text
        assert got == status, (mode, text)
        assert ("the engine would run without the plugin" in text) == (left_out and mode == "require"), text


def test_the_plugin_name_is_setups_entry_point_in_both_engines():
    from pathlib import Path

    from torch_sdcp.plugin_check_env import PLUGIN_NAME

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"vllm.general_plugins": ["{PLUGIN_NAME} = ' in setup
    assert f'"sglang.srt.plugins": ["{PLUGIN_NAME} = ' in setup


SGLANG_ARGS = ["--engine", "sglang", "--dcp-size", "2", "--num-heads", "64", "--rows", "64"]


@pytest.mark.parametrize("plugins,left_out", [(None, False), ("", False), ("torch_sdcp", False),
                                              ("other, torch_sdcp", False), (" , ", False), ("other", True)])
def test_sglang_plugins_that_leave_the_plugin_out(plugins, left_out, monkeypatch):
    """SGLang strips each name of SGLANG_PLUGINS and loads every plugin when
    none is named: a list that leaves the plugin out is said, and the require
    mode exits 1."""
    if plugins is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", plugins)
    for mode, status in (("1", 0), ("require", 1 if left_out else 0)):
        monkeypatch.setenv("SDCP_SGLANG", mode)
        got, text = plugin_check.report(SGLANG_ARGS)
        assert ("SGLANG_PLUGINS=" in text and "leaves the plugin out" in text) == left_out, text
        assert got == status, (mode, text)


@pytest.mark.parametrize("engine,version,refused", [
    ("vllm", "0.33.0", False), ("vllm", "0.34.0", False), ("vllm", "0.32.1", True), ("vllm", "0.35.0", True),
    ("sglang", "0.5.23", False), ("sglang", "0.5.22", True), ("sglang", "0.6.0", True)])
def test_an_installed_engine_the_plugin_refuses(engine, version, refused, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == engine else real(name))
    monkeypatch.delenv(f"{engine.upper()}_PLUGINS", raising=False)
    monkeypatch.setenv(f"SDCP_{engine.upper()}", "require")
    status, text = plugin_check.report(VLLM_ARGS if engine == "vllm" else SGLANG_ARGS)
    name = "vLLM" if engine == "vllm" else "SGLang"
    assert f"{name} {version} is installed" in text, text
    assert ("the plugin would refuse it" in text) == refused, text
    assert status == (1 if refused else 0), text
