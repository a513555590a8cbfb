"""The main job, `python -m torch_sdcp.bench`, on the host backend: every
boundary and the decode-step demo run, agree, and leave tables, JSON and a
plot behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torch_sdcp.bench import tables


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch_sdcp.bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_runs_every_boundary_on_the_host_backend(tmp_path):
    out = tmp_path / "bench"
    res = run_bench("--backend", "host", "--world-size", "2", "--rows", "1,3", "--replays", "1", "--trials", "1",
                    "--k", "64", "--requests", "2", "--context", "40", "--layers", "1", "--sparse", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["backend"] == "host" and data["meta"]["world_size"] == 2
    assert list(data["results"]) == ["signal", "query", "topk", "output_lse", "decode"]
    for name in ("query", "topk", "output_lse"):
        rows = [r for r in data["results"][name] if "rows" in r]
        assert [r["rows"] for r in rows] == [1, 3], name
        for r in rows:
            assert r["sdcp"]["k8"] > 0 and r["collective"]["k8"] > 0, (name, r)
    olse = [r for r in data["results"]["output_lse"] if "rows" in r]
    assert all("needs CUDA" in r["symm_mem"]["error"] for r in olse)  # says so instead of failing
    decode = data["results"]["decode"][0]
    assert decode["agree"] and decode["sparse"] and decode["sdcp"]["k1"] > 0, decode
    assert (out / "latency.png").stat().st_size > 1000
    assert "decode" in (out / "tables.txt").read_text() and "torch_sdcp" in res.stdout
    assert tables(data) in res.stdout


def test_bench_rejects_unknown_boundaries(tmp_path):
    res = run_bench("--boundaries", "query,nope", "--out", str(tmp_path / "x"), timeout=120)
    assert res.returncode == 2 and "--boundaries" in res.stderr and "'nope'" in res.stderr
    assert not os.path.exists(tmp_path / "x")
