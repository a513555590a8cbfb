"""The main job, `python -m torch_sdcp.bench`, on the host backend: every
boundary and the decode-step demo run, agree, and leave tables, JSON and a
plot behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_sdcp.bench import main, parse_args, plot, tables
from torch_sdcp.bench.report import verdicts


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch_sdcp.bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_runs_every_boundary_on_the_host_backend(tmp_path):
    out = tmp_path / "bench"
    res = run_bench("--backend", "host", "--world-size", "2", "--rows", "1,3", "--replays", "1", "--trials", "1",
                    "--k", "64", "--requests", "2", "--context", "40", "--layers", "1", "--sparse", "--tag",
                    "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["backend"] == "host" and data["meta"]["world_size"] == 2
    assert data["meta"]["performance"] is False and "not performance" in data["meta"]["note"]
    assert list(data["results"]) == ["signal", "query", "topk", "output_lse", "output_lse_up", "decode"]
    for name in ("query", "topk", "output_lse", "output_lse_up"):
        rows = [r for r in data["results"][name] if "rows" in r]
        assert [r["rows"] for r in rows] == [1, 3], name
        for r in rows:
            assert r["sdcp"]["k8"] > 0 and r["collective"]["k8"] > 0, (name, r)
            assert r["sdcp_tagged"]["k8"] > 0, (name, r)  # --tag: the same call with a call tag
    for name, head_dim in (("output_lse", 512), ("output_lse_up", 128)):  # every path at both widths
        olse = [r for r in data["results"][name] if "rows" in r]
        for path in ("symm_mem", "vllm_a2a", "flashinfer"):  # says so instead of failing
            assert all("needs CUDA" in r[path]["error"] for r in olse), (name, path)
        assert all(r["collective"]["k8"] > 0 and r["sdcp_masked"]["k8"] > 0 for r in olse), name
        assert data["results"][name][-1]["head_dim"] == head_dim
        # The least bytes a call moves: the partials at this width (8 heads a rank, bf16 + fp32 LSE).
        assert olse[-1]["bytes"] == 3 * 16 * (head_dim * 2 + 4) + 3 * 8 * (head_dim * 2 + 4)
    text = tables(data)
    assert "are not performance" in text and "x |" not in text and "lower" not in text  # no ratio on the host
    assert "legend" in text and "sdcp::lse_correct" in text and "PR #50484" in text
    assert "torch_sdcp tagged" in text and "(--tag)" in text
    assert "\noutput_lse_up (Output/LSE after the V up-projection: head_dim 128" in text
    assert "FlashInfer fused" in text and "flashinfer-python 0.7.4" in text
    decode = data["results"]["decode"][0]
    assert decode["agree"] and decode["sparse"] and decode["sdcp"]["k1"] > 0, decode
    assert (out / "latency.png").stat().st_size > 1000
    assert "decode" in (out / "tables.txt").read_text() and "torch_sdcp" in res.stdout
    assert tables(data) in res.stdout
    # The closing lines: a verdict per boundary (none about speed on the host), then every file written.
    closing = res.stdout.rstrip("\n").split("\n")[-12:]
    assert closing == [
        "verdict (host backend: not performance, so no speed verdict)",
        "  signal: ran at row 1 (host backend: a protocol check, no speed verdict)",
        *(f"  {name}: ran at rows 1, 3 (host backend: a protocol check, no speed verdict)"
          for name in ("query", "topk", "output_lse", "output_lse_up")),
        "  decode: outputs agree: True (host backend: no speed verdict)",
        "",
        f"wrote {out}:",
        f"tables: {out / 'tables.txt'}",
        f"plot: {out / 'latency.png'}",
        f"raw numbers: {out / 'bench.json'}",
    ], closing


def test_bench_rejects_unknown_boundaries(tmp_path):
    res = run_bench("--boundaries", "query,nope", "--out", str(tmp_path / "x"), timeout=120)
    assert res.returncode == 2 and "--boundaries" in res.stderr and "'nope'" in res.stderr
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("option, value, says", [
    ("--rows", "1,x", "expected comma-separated integers >= 1, got '1,x'"),
    ("--rows", "8,0", "expected comma-separated integers >= 1, got '8,0'"),
    ("--rows", "", "expected comma-separated integers >= 1, got ''"),
    ("--world-size", "0", "expected an integer >= 1, got 0"),
    ("--world-size", "two", "expected an integer >= 1, got 'two'"),
    ("--heads", "-8", "expected an integer >= 1, got -8"),
    ("--heads", "7", "expected a multiple of --world-size 2, got 7"),
    ("--k", "0", "expected an integer >= 1, got 0"),
    ("--requests", "0", "expected an integer >= 1, got 0"),
    ("--context", "1.5", "expected an integer >= 1, got '1.5'"),
    ("--layers", "0", "expected an integer >= 1, got 0"),
    ("--replays", "0", "expected an integer >= 1, got 0"),
    ("--trials", "-1", "expected an integer >= 1, got -1"),
    ("--boundaries", ",", "expected names from ('signal', 'query', 'topk', 'output_lse', 'output_lse_up', "
                          "'decode'), got none"),
    ("--backend", "gpu", "invalid choice: 'gpu'"),
])
def test_a_bad_option_is_a_usage_error_naming_it(option, value, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "host", "--world-size", "2", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: {says}" in err and err.startswith("usage: python -m torch_sdcp.bench"), err


def test_an_unknown_option_is_reported_as_unknown(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "host", "--ranks", "2", "--batch", "8"])
    assert e.value.code == 2 and "error: unrecognized arguments: --ranks 2 --batch 8" in capsys.readouterr().err


def test_out_must_not_be_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "host", "--out", str(tmp_path / "f")])
    assert e.value.code == 2 and "error: argument --out: expected a folder, got the file" in capsys.readouterr().err


def test_a_bad_option_from_the_command_line_exits_2_without_a_traceback(tmp_path):
    res = run_bench("--rows", "1,x", "--out", str(tmp_path / "x"), timeout=120)
    assert res.returncode == 2 and "argument --rows: expected comma-separated" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("out, says", [
    ("/proc/sdcp-bench", "got '/proc/sdcp-bench': cannot make it"),
    ("/proc", "got '/proc': cannot write a file in it"),
    ("/dev/null/sdcp-bench", "got '/dev/null/sdcp-bench': cannot make it (Not a directory)"),
])
def test_out_that_cannot_be_written_is_a_usage_error(out, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--backend", "host", "--out", out])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument --out: expected a folder it can write to, {says}" in err, err


def test_unwritable_out_from_the_command_line_exits_2_without_a_traceback():
    res = run_bench("--backend", "host", "--out", "/proc/sdcp-bench", timeout=120)
    assert res.returncode == 2 and "argument --out: expected a folder it can write to" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "torch_sdcp bench:" not in res.stdout


def cuda_row(rows: int, ours: float, baselines: dict) -> dict:
    return {"rows": rows, "sdcp": {"k8": ours, "k1": ours}, **{p: {"k8": v, "k1": v} for p, v in baselines.items()}}


def test_verdict_per_boundary_against_the_strongest_baseline_of_each_row():
    data = {"meta": {"backend": "cuda"}, "results": {
        "query": [cuda_row(1, 10.0, {"collective": 20.0}), cuda_row(128, 20.0, {"collective": 24.0})],
        "topk": [cuda_row(1, 10.0, {"collective": 20.0}), cuda_row(4096, 40.0, {"collective": 30.0})],
        "output_lse": [cuda_row(8, 20.0, {"collective": 30.0, "symm_mem": 10.0})],
        "signal": [{"error": "RuntimeError: no peer memory"}],
        "decode": [{"requests": 32, "agree": True, "collective": {"k1": 100.0}, "sdcp": {"k1": 80.0}}],
    }}
    assert verdicts(data) == [
        "verdict (k8: torch_sdcp against the strongest baseline of each row; > 1x: torch_sdcp faster)",
        "  query: torch_sdcp faster than the strongest baseline at every row timed (rows 1-128, 1.20x-2.00x)",
        "  topk: torch_sdcp faster at row 1, 2.00x; slower at row 4096, 0.75x",
        "  output_lse: torch_sdcp slower than the strongest baseline at every row timed (row 8, 0.50x)",
        "  signal: could not run (RuntimeError: no peer memory)",
        "  decode: torch_sdcp's step 80.0 us against the collective path's 100.0 us, 20% lower; outputs agree: True",
    ]


def test_plot_ticks_at_measured_rows_and_says_what_k8_is(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    drawn = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.append(fig), close(fig)))
    data = {"meta": {"backend": "cuda", "world_size": 2, "device": "gpu", "date": "2026-12-07 10:00:00"},
            "results": {"query": [cuda_row(1, 10.0, {"collective": 20.0}), cuda_row(96, 20.0, {"collective": 24.0}),
                                  cuda_row(4096, 40.0, {"collective": 30.0})]}}
    assert plot(data, str(tmp_path / "latency.png")) is None and (tmp_path / "latency.png").exists()
    ax = drawn[0].axes[0]
    assert list(ax.get_xticks()) == [1, 96, 4096]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "96", "4096"]
    assert list(ax.xaxis.get_minorticklocs()) == []
    title = ax.get_legend().get_title().get_text()
    assert "k8: 8 calls captured back to back" in title and "in one CUDA graph" in title, title


def test_tables_give_ratios_against_the_strongest_baseline():
    meta = {"date": "d", "world_size": 2, "backend": "cuda", "device": "gpu", "torch": "t"}
    row = {"rows": 8, "collective": {"k8": 30.0, "k1": 31.0}, "symm_mem": {"k8": 20.0, "k1": 21.0},
           "vllm_a2a": {"k8": 16.0, "k1": 17.0}, "sdcp": {"k8": 8.0, "k1": 9.0}}
    text = tables({"meta": meta, "results": {"output_lse": [row]}})
    assert "vLLM a2a/torch_sdcp 2.00x" in text
    assert "collective/torch_sdcp" not in text and "symm-mem/torch_sdcp" not in text
    assert "output_lse / vLLM a2a:" in text and "not performance" not in text
    row["vllm_a2a"] = {"error": "RuntimeError: x"}
    assert "symm-mem/torch_sdcp 2.50x" in tables({"meta": meta, "results": {"output_lse": [row]}})
    row["flashinfer"] = {"k8": 12.0, "k1": 13.0}
    text = tables({"meta": meta, "results": {"output_lse": [row]}})
    assert "FlashInfer fused 12.0 / 13.0" in text and "FlashInfer fused/torch_sdcp 1.50x" in text
    assert "output_lse / FlashInfer fused: a reproduction in Triton" in text


@pytest.mark.parametrize("boundaries", [["output_lse", "output_lse_up"], ["output_lse_up"]])
def test_the_up_projected_table_has_its_title_and_every_path_in_the_legend(boundaries):
    """output_lse_up prints its own table, titled with its width; its legend
    line refers to output_lse's lines, which are printed once either way."""
    meta = {"date": "d", "world_size": 2, "backend": "cuda", "device": "gpu", "torch": "t"}
    row = cuda_row(8, 8.0, {"collective": 30.0, "flashinfer": 12.0})
    text = tables({"meta": meta, "results": {b: [row] for b in boundaries}})
    assert "\noutput_lse_up (Output/LSE after the V up-projection: head_dim 128, the same heads" in text
    assert "  output_lse_up / every path: the output_lse paths" in text
    assert text.count("/ FlashInfer fused: a reproduction") == 1 and text.count("sdcp::lse_correct") == 1


@pytest.mark.parametrize("device, share", [("NVIDIA H200", "(50%) (of 4.80 TB/s, NVIDIA H200's datasheet)"),
                                           ("NVIDIA H100 80GB HBM3", "(72%) (of 3.35 TB/s, NVIDIA H100 80GB HBM3's"),
                                           ("NVIDIA H100 NVL", "(62%) (of 3.90 TB/s"),
                                           ("Some GPU", "(Some GPU: no datasheet bandwidth known)")])
def test_bandwidth_share_is_of_the_gpu_the_bench_ran_on(device, share):
    meta = {"date": "d", "world_size": 1, "backend": "cuda", "device": device, "torch": "t"}
    row = {"rows": 1024, "bytes": 240_000_000, "collective": {"k8": 200.0, "k1": 201.0},
           "sdcp": {"k8": 100.0, "k1": 101.0}}
    text = tables({"meta": meta, "results": {"output_lse": [row]}})
    assert "bytes moved per rank 240.0 MB; by them (k8): collective 1.20 TB/s" in text
    assert f"torch_sdcp 2.40 TB/s {share}" in text


def test_bench_times_the_topk_ordering_step_per_distribution(tmp_path):
    out = tmp_path / "bench"
    res = run_bench("--backend", "host", "--world-size", "2", "--rows", "1,2", "--replays", "1", "--trials", "1",
                    "--k", "64", "--boundaries", "topk", "--topk-distributions", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [r for r in json.loads((out / "bench.json").read_text())["results"]["topk"] if "rows" in r]
    assert [r["rows"] for r in rows] == [1, 2]
    for r in rows:
        for kind in ("uniform", "normal", "tied80", "equal"):
            assert r["kernels"][f"sort_{kind}"]["k8"] > 0, r
    assert "sort_tied80" in res.stdout and "kernel alone (k8)" in res.stdout
    assert "--topk-distributions" in run_bench("--help").stdout


def test_kernel_check_runs_every_family_on_the_host_backend():
    # The script run under compute-sanitizer on a GPU machine, here on the host
    # backend: every family's cases agree with the references, and a name it
    # does not know is refused.
    env = dict(os.environ, SDCP_CHECK_BACKEND="host")
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench.kernel_check"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for line in ("exchange 13 bytes off a word: ok", "output_lse rows 2100", "query float8_e4m3fn neox rows 300: ok",
                 "topk rows 200: ok", "kernel_check: all ok"):
        assert line in res.stdout, res.stdout
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench.kernel_check", "signal"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 2 and "argument 'checks'" in res.stderr and "'signal'" in res.stderr, res.stderr
