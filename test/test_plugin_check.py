"""``python -m torch_sdcp.plugin_check --gate``: the peer-memory gate run on
this node as start-up would run it (here on the host backend, which has no
GPU to need), bounded, and a failed gate turning every seam off."""

from __future__ import annotations

import subprocess
import sys
import time

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
