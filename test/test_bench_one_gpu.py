"""`python -m torch_sdcp.bench --one-gpu N`: its argument errors, the
co-residency rule (PDL counted), the reference checks, the table of either
method, a replay's fork and join over stand-in streams, and the virtual
ranks' memory (creation, initialisation, teardown) over a stand-in CUDA
driver; on a GPU, short runs at world 2 by either method."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from _fake_cuda_driver import FakeDriver
from _helpers import requires_gpus

import torch_sdcp  # noqa: F401  (registers the ops)
from torch_sdcp import reference
from torch_sdcp.bench import one_gpu, one_gpu_boundaries, one_gpu_report, one_gpu_timing, parse_args
from torch_sdcp.bench.virtual_ranks import VirtualRanks
from torch_sdcp.families import WorkspaceKind

# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--one-gpu", "3"], "argument --one-gpu: expected 1, 2, 4 or 8, got 3"),
    (["--one-gpu", "two"], "argument --one-gpu: expected 1, 2, 4 or 8, got 'two'"),
    (["--one-gpu", "2", "--world-size", "2"], "argument --world-size: expected 1 or none with --one-gpu"),
    (["--one-gpu", "4", "--backend", "host"],
     "argument --backend: expected 'cuda' or 'auto' with --one-gpu, got 'host'"),
    (["--one-gpu", "2", "--boundaries", "query,decode"], "argument --boundaries: expected names from ('signal', "
                                                         "'query', 'topk', 'output_lse', 'output_lse_up') with "
                                                         "--one-gpu, got 'decode'"),
    (["--one-gpu", "4", "--heads", "6"], "argument --heads: expected a multiple of --one-gpu 4, got 6"),
    (["--one-gpu", "2", "--tag"], "argument --tag: expected only without --one-gpu"),
    (["--one-gpu", "2", "--one-gpu-timeout", "0"], "argument --one-gpu-timeout: expected a number of seconds > 0, "
                                                   "got 0"),
    (["--one-gpu", "2", "--blocks-per-sm", "0"], "argument --blocks-per-sm: expected an integer >= 1, got 0"),
    (["--blocks-per-sm", "2"], "argument --blocks-per-sm: expected only with --one-gpu, got it without"),
    (["--one-gpu-timeout", "2"], "argument --one-gpu-timeout: expected only with --one-gpu, got it without"),
    (["--one-gpu", "2", "--one-gpu-method", "graphs"],
     "argument --one-gpu-method: expected 'graph-per-rank' or 'one-graph', got 'graphs'"),
    (["--one-gpu", "2", "--one-gpu-steps", "0"], "argument --one-gpu-steps: expected an integer >= 1, got 0"),
    (["--one-gpu", "4", "--one-gpu-method", "one-graph", "--one-gpu-steps", "64"],
     "argument --one-gpu-steps: expected only with --one-gpu-method graph-per-rank, got it with one-graph"),
    (["--one-gpu-method", "one-graph"], "argument --one-gpu-method: expected only with --one-gpu, got it without"),
    (["--one-gpu-steps", "64"], "argument --one-gpu-steps: expected only with --one-gpu, got it without"),
    (["--one-gpu-slice"], "argument --one-gpu-slice: expected only with --one-gpu, got it without"),
])
def test_a_bad_one_gpu_option_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {says}" in err and err.startswith("usage: python -m torch_sdcp.bench"), err


def test_one_gpu_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--one-gpu", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("error: argument --one-gpu: expected a CUDA GPU and the CUDA kernels, got torch.cuda.is_available() "
            "False") in err, err


def test_one_gpu_under_torchrun_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args(["--one-gpu", "2"])
    assert "argument --one-gpu: expected one process, got WORLD_SIZE=2 (torchrun)" in capsys.readouterr().err


def test_one_gpu_defaults(monkeypatch):
    monkeypatch.setattr(one_gpu, "cuda_missing", lambda: None)
    args = parse_args(["--one-gpu", "4"])
    assert args.one_gpu == 4 and args.world_size == 1 and args.backend == "cuda"
    assert args.rows == [1, 32, 128] and args.boundaries == list(one_gpu.BOUNDARIES)
    assert args.one_gpu_timeout == one_gpu.DEFAULT_TIMEOUT_S and args.blocks_per_sm is None
    # each rank's 64 steps in a graph of its own; 16 replays: 1,024 steps per trial
    assert args.one_gpu_method == "graph-per-rank" and args.one_gpu_steps == 64
    assert (args.replays, args.trials) == (16, 7)
    args = parse_args(["--one-gpu", "2", "--world-size", "1", "--rows", "8", "--boundaries", "topk",
                       "--one-gpu-timeout", "1.5", "--blocks-per-sm", "3"])
    assert args.rows == [8] and args.boundaries == ["topk"] and args.one_gpu_timeout == 1.5
    assert args.blocks_per_sm == 3
    args = parse_args(["--one-gpu", "8", "--one-gpu-steps", "256"])
    assert args.one_gpu_steps == 256 and args.replays == 4
    args = parse_args(["--one-gpu", "8", "--one-gpu-steps", "4096", "--trials", "3"])
    assert args.replays == 1 and args.trials == 3
    args = parse_args(["--one-gpu", "2", "--one-gpu-steps", "32", "--replays", "5"])
    assert (args.one_gpu_steps, args.replays) == (32, 5)
    # the plain bench's Timer: k8 / k1, 100 replays
    args = parse_args(["--one-gpu", "2", "--one-gpu-method", "one-graph"])
    assert args.one_gpu_method == "one-graph" and args.one_gpu_steps is None and args.replays == 100
    assert (one_gpu_timing.GraphPerRank.name, one_gpu_timing.OneGraph.name) == one_gpu.METHODS  # the default first


def test_the_bench_without_one_gpu_is_unchanged():
    args = parse_args(["--backend", "host"])
    assert args.one_gpu is None and args.world_size >= 1 and args.rows == [1, 8, 32]


def test_a_bad_one_gpu_option_from_the_command_line_exits_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench", "--one-gpu", "3", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "argument --one-gpu: expected 1, 2, 4 or 8, got 3" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# co-residency, checks, table (no GPU needed)
# ---------------------------------------------------------------------------------------------

GLM5 = one_gpu_boundaries.Geometry(heads=64, head_dim=512, rope_dim=64, k=2048, query_dtype=torch.float8_e4m3fn)
H200_SMS = 132


@pytest.mark.parametrize("name, rows, world, blocks, pdl, fits", [
    ("signal", 1, 8, 1, False, True),
    ("output_lse", 1, 2, 4, False, True),
    ("output_lse", 32, 2, 128, False, True),
    ("output_lse", 32, 8, 32, False, True),  # 8 x 32 = 256 <= 264
    ("output_lse", 128, 2, 264, False, False),  # capped at 2 per SM: 528 > 264
    ("output_lse", 128, 1, 264, False, True),  # no peer to wait for
    ("query", 32, 4, 64, False, True),
    ("query", 128, 8, 128, False, False),
    ("topk", 32, 4, 32, False, True),  # 128 <= 132 at one block per SM
    ("topk", 32, 8, 32, False, False),
    ("topk", 128, 2, 128, False, False),
    # PDL on: every rank's next kernel counted beside its current one
    ("signal", 1, 8, 1, True, True),
    ("output_lse", 1, 8, 1, True, True),  # 2 x 8 x 1 = 16
    ("query", 1, 4, 2, True, True),
    ("output_lse", 32, 2, 128, True, False),  # 2 x 2 x 128 = 512 > 264
    ("output_lse", 32, 8, 32, True, False),  # 2 x 8 x 32 = 512 > 264
    ("query", 32, 4, 64, True, False),
    ("topk", 1, 8, 1, True, True),
    ("topk", 32, 2, 32, True, True),  # 2 x 2 x 32 = 128 <= 132
    ("topk", 32, 4, 32, True, False),  # 256 > 132
    ("output_lse", 128, 1, 264, True, True),  # world 1: no peer, whatever PDL holds
])
def test_residency_follows_the_grid_sizes_of_the_kernels(name, rows, world, blocks, pdl, fits):
    boundary = one_gpu_boundaries.BOUNDARY_CLASSES[name](GLM5, torch.device("cpu"))
    got, why = one_gpu.residency(boundary, rows, world, H200_SMS, one_gpu.ASSUMED_BLOCKS_PER_SM[name], pdl)
    assert got == blocks and (why is None) == fits, why
    if why:
        need = world * blocks * (2 if pdl else 1)
        assert f"{world} grids of {blocks} blocks" in why and f"= {need} blocks" in why and f"{H200_SMS} SMs" in why
        assert ("twice over while PDL is on" in why and "SDCP_PDL=0" in why) == pdl, why


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_a_sliced_run_fits_every_grid_at_every_row_count(world, pdl):
    fits = dict(one_gpu.ASSUMED_BLOCKS_PER_SM)
    grid_sms = one_gpu.slice_sms(H200_SMS, world, pdl, fits)
    assert grid_sms == H200_SMS // (world * (2 if pdl else 1))
    for name in one_gpu.BOUNDARIES:
        boundary = one_gpu_boundaries.BOUNDARY_CLASSES[name](GLM5, torch.device("cpu"))
        for rows in (1, 32, 128, 1024, 4096):
            blocks, why = one_gpu.residency(boundary, rows, world, H200_SMS, fits[name], pdl, grid_sms)
            assert why is None and blocks <= one_gpu.GRID_BLOCKS_PER_SM[name] * grid_sms, (name, rows, why)
    # a kernel that fits fewer blocks on an SM than it launches per SM of its grid takes a smaller slice
    half = one_gpu.slice_sms(H200_SMS, world, pdl, {**fits, "output_lse": 1})
    assert half == H200_SMS // (world * (2 if pdl else 1) * 2)


def test_the_slice_reaches_the_kernels_before_their_first_launch(monkeypatch):
    monkeypatch.delenv(one_gpu.GRID_SMS_ENV, raising=False)
    assert one_gpu.grid_sms_setting(H200_SMS, 8, True, dict(one_gpu.ASSUMED_BLOCKS_PER_SM), False) is None
    assert one_gpu.grid_sms_setting(H200_SMS, 8, True, dict(one_gpu.ASSUMED_BLOCKS_PER_SM), True) == 8
    assert os.environ[one_gpu.GRID_SMS_ENV] == "8"
    monkeypatch.setenv(one_gpu.GRID_SMS_ENV, "500")  # more than the GPU has: the kernels size for the GPU
    assert one_gpu.grid_sms_setting(H200_SMS, 2, False, dict(one_gpu.ASSUMED_BLOCKS_PER_SM), False) is None


@pytest.mark.parametrize("major, env, on", [(9, None, True), (10, None, True), (9, "0", False), (9, "1", True),
                                            (8, None, False)])
def test_pdl_is_on_as_the_kernels_decide(monkeypatch, major, env, on):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    if env is None:
        monkeypatch.delenv("SDCP_PDL", raising=False)
    else:
        monkeypatch.setenv("SDCP_PDL", env)
    assert one_gpu.pdl_on(CUDA0) is on
    assert one_gpu.grids_per_rank(on) == (2 if on else 1)


SMALL = one_gpu_boundaries.Geometry(heads=8, head_dim=64, rope_dim=16, k=16, query_dtype=torch.float8_e4m3fn)


def reference_results(boundary, inputs, rows, world):
    """What every rank must return, made by the reference (a CPU stand-in for the kernels)."""
    if boundary.name == "signal":
        return [torch.stack([x for (x,) in inputs])] * world
    if boundary.name in ("output_lse", "output_lse_up"):
        out, lse = reference.lse_combine_ref64(torch.stack([po for po, _ in inputs]),
                                               torch.stack([pl for _, pl in inputs]))
        return [tuple(t for t in reference.output_lse_shard(out.to(torch.bfloat16), lse.float(), r, world))
                for r in range(world)]
    if boundary.name == "topk":
        return [reference.topk_merge_ref(list(inputs), boundary.geo.k)] * world
    return [reference.query_gathered_layout([
        reference.query_rope_quant_ref(nope, pe, pos, boundary.cache, boundary.scale, neox=False,
                                       out_dtype=boundary.geo.query_dtype) for nope, pe, pos in inputs])] * world


def corrupt(result):
    if isinstance(result, tuple):
        return (result[0] + 1, result[1])
    if result.dtype == torch.float8_e4m3fn:
        bytes_ = result.view(torch.uint8).clone()
        bytes_[0, 0, 0] ^= 1
        return bytes_.view(result.dtype)
    bad = result.clone()
    bad.view(-1)[0] += 1
    return bad


@pytest.mark.parametrize("name", one_gpu.BOUNDARIES)
def test_the_reference_check_passes_the_reference_and_fails_a_changed_result(name):
    boundary = one_gpu_boundaries.BOUNDARY_CLASSES[name](SMALL, torch.device("cpu"))
    rows, world = 3, 2
    inputs = [boundary.check_inputs(rows, r, world) for r in range(world)]
    if name != "signal":  # the check's inputs differ between the ranks
        assert not torch.equal(inputs[0][0], inputs[1][0])
    assert boundary.params(rows, world)[0] == (64 if name == "signal" else rows)
    results = reference_results(boundary, inputs, rows, world)
    boundary.check(results, inputs, rows, world)
    results[1] = corrupt(results[1])
    with pytest.raises(one_gpu_boundaries.CheckFailed, match=f"{name}, world 2.*rank 1"):
        boundary.check(results, inputs, rows, world)


def test_the_timed_inputs_are_the_benchs():
    from torch_sdcp.bench.boundaries import output_lse_inputs, topk_inputs

    cpu = torch.device("cpu")
    po, pl = one_gpu_boundaries.OutputLSE(SMALL, cpu).timed_inputs(5, 1, 2)
    want = output_lse_inputs(torch.Generator().manual_seed(5), 5, 8, 64, cpu)
    assert torch.equal(po, want[0]) and torch.equal(pl, want[1])
    scores, ids = one_gpu_boundaries.TopK(SMALL, cpu).timed_inputs(5, 1, 2)
    assert torch.equal(ids, topk_inputs(torch.Generator().manual_seed(5 * 31 + 1), 5, 16, 1, 2, cpu)[1])


def test_the_table_says_what_the_figure_is():
    meta = {"date": "d", "one_gpu": 4, "worlds": [1, 4], "note": one_gpu.NOTE.format(n=4), "device": "gpu",
            "torch": "t", "sms": 132, "blocks_per_sm": {"output_lse": 2, "topk": 1}, "blocks_per_sm_assumed": True,
            "timeout_s": 3.0, "failures": 1, "pdl": True}
    results = {
        "output_lse": [
            {"rows": 1, "world1": {"grid_blocks": 8, "check": "ok", "k8": 2.0, "k1": 4.0},
             "world4": {"grid_blocks": 2, "check": "ok", "k8": 3.5, "k1": 5.0}},
            {"rows": 128, "world1": {"grid_blocks": 264, "check": "ok", "k8": 6.0, "k1": 8.0},
             "world4": {"grid_blocks": 256, "skipped": "not co-resident: 4 grids of 256 blocks"}}],
        "topk": [{"rows": 1, "world1": {"grid_blocks": 1, "check": "ok", "k8": 7.0, "k1": 9.0},
                  "world4": {"grid_blocks": 1, "check": "MISMATCH", "error": "topk, world 4, rows 1: rank 2"}},
                 {"rows": 32, "world1": {"grid_blocks": 32, "check": "ok", "k8": 7.2, "k1": 9.1},
                  "world4": {"grid_blocks": 32, "error": "RuntimeError: virtual rank 0 failed"}}]}
    text = one_gpu_report.tables({"meta": meta, "results": results})
    assert "one GPU, 4 virtual ranks: kernel side, HBM in place of NVLink; not a multi-GPU figure" in text
    assert "world 1 2.0 / 4.0 | world 4 3.5 / 5.0 | world 4 - world 1 +1.5 us (k8)" in text
    assert "world 4 skipped" in text and "not co-resident: 4 grids of 256 blocks" in text
    assert "world 4 MISMATCH" in text and "reference check FAILED" in text and "1 cell(s) FAILED" in text
    # an error (a wait that gave up) is not a mismatch
    assert "world 4 failed" in text and "reference check not completed (an error, below)" in text
    assert "world 1 is the floor" in text and "legend" in text and "sdcp::topk_merge" in text
    assert "PDL on (SDCP_PDL not 0)" in text and "every rank counts twice its grid" in text
    # a run without a method in its JSON (before --one-gpu-method) was one graph, k8 / k1
    assert "method one-graph: k8, 8 steps in ONE CUDA graph" in text and "branches run concurrently" in text
    meta["pdl"] = False
    assert "PDL off (SDCP_PDL=0" in one_gpu_report.tables({"meta": meta, "results": results})
    assert "grids sized for" not in text
    meta.update(grid_sms=16, sliced=True)  # --one-gpu-slice: the table says the cells are not whole-GPU ranks'
    sliced = one_gpu_report.tables({"meta": meta, "results": results})
    assert "grids sized for 16 of 132 SMs (--one-gpu-slice)" in sliced and "not a whole-GPU rank's" in sliced
    meta["sliced"] = False
    assert "(SDCP_BENCH_GRID_SMS)" in one_gpu_report.tables({"meta": meta, "results": results})


def test_the_table_gives_the_bytes_the_ranks_move_from_1024_rows():
    geo = one_gpu_boundaries.Geometry(heads=64, head_dim=512, rope_dim=64, k=8, query_dtype=torch.bfloat16)
    olse = one_gpu_boundaries.OutputLSE(geo, torch.device("cpu"))
    # 1024 rows x 64 heads x (512 bf16 + an fp32 LSE) read, a quarter of the heads written
    assert olse.rank_bytes(1024, 4) == 1024 * 64 * 1028 + 1024 * 16 * 1028
    meta = {"date": "d", "one_gpu": 4, "worlds": [1, 4], "note": "n", "device": "NVIDIA H200", "torch": "t",
            "sms": 132, "blocks_per_sm": {"output_lse": 2}, "blocks_per_sm_assumed": True, "timeout_s": 3.0,
            "failures": 0, "pdl": True}
    moved = olse.rank_bytes(1024, 4)
    results = {"output_lse": [
        {"rows": 128, "world1": {"check": "ok", "k8": 6.0, "rank_bytes": 1}, "world4": {"check": "ok", "k8": 9.0}},
        {"rows": 1024, "world1": {"check": "ok", "k8": 50.0, "rank_bytes": olse.rank_bytes(1024, 1)},
         "world4": {"check": "ok", "k8": 100.0, "rank_bytes": moved}}]}
    text = one_gpu_report.tables({"meta": meta, "results": results})
    lines = [line for line in text.splitlines() if "bytes the ranks move" in line]
    assert len(lines) == 1, text  # from 1024 rows only
    rate = 4 * moved / 100e-6
    assert f"world 4 4 x {moved / 1e6:.1f} MB, {rate / 1e12:.2f} TB/s ({rate / 4.8e12:.0%})" in lines[0]
    assert "of 4.80 TB/s, the datasheet's" in lines[0]


def test_the_table_names_the_graph_per_rank_method_and_its_figure():
    meta = {"date": "d", "one_gpu": 8, "worlds": [1, 8], "note": one_gpu.NOTE.format(n=8), "device": "gpu",
            "torch": "t", "sms": 132, "blocks_per_sm": {"query": 2}, "blocks_per_sm_assumed": True,
            "timeout_s": 3.0, "failures": 0, "pdl": False, "method": "graph-per-rank", "figure_keys": ["k64"],
            "steps_per_graph": 64, "replays": 16, "trials": 7}
    results = {"query": [
        {"rows": 1, "world1": {"grid_blocks": 8, "check": "ok", "k64": 3.25, "host_us_per_step": 0.4,
                               "host_late_trials": 0},
         "world8": {"grid_blocks": 1, "check": "ok", "k64": 10.5, "host_us_per_step": 2.5, "host_late_trials": 2}},
        {"rows": 32, "world1": {"grid_blocks": 256, "check": "ok", "k64": 4.0},
         "world8": {"grid_blocks": 32, "error": "RuntimeError: virtual rank 3 failed at the first replay of the "
                                                "rank graphs"}}]}
    text = one_gpu_report.tables({"meta": meta, "results": results})
    assert "not a multi-GPU figure" in text
    assert ("k64; method graph-per-rank: each rank's 64 steps in a CUDA graph of its own, the 8 graphs launched on "
            "8 streams") in text
    assert "16 replays" in text and "median of 7 trials" in text
    assert "waited for by its peers at its first step only" in text and "count 1/64 each" in text
    assert "world 1 3.2 | world 8 10.5 | world 8 - world 1 +7.2 us (k64)" in text, text
    assert "in 2 of 7 trials (host 2.50 us per step): the figure may include host time" in text
    assert "world 8 failed" in text and "at the first replay of the rank graphs" in text
    assert "k8" not in text and "ONE CUDA graph" not in text


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.append(f"{stream.name}: record {self.name}")


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.append(f"{self.name}: wait {event.name}")


class FakeGraph:
    def __init__(self, log, rank, current):
        self.log, self.rank, self.current = log, rank, current

    def replay(self):
        self.log.append(f"{self.current[0].name}: graph {self.rank}")


def test_a_replay_forks_every_rank_graph_from_rank_0s_stream_and_joins_it_back(monkeypatch):
    log: list[str] = []
    current: list = [None]
    events = iter(["fork", "join1", "join2", "join3", "fork"])
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log, next(events)))

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current[0] = self.stream

        def __exit__(self, *exc):
            current[0] = None

    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    streams = [FakeStream(log, f"s{r}") for r in range(4)]
    replay = one_gpu_timing.RankGraphReplay(streams, [FakeGraph(log, r, current) for r in range(4)])
    replay()
    assert log == ["s0: record fork", "s0: graph 0",
                   "s1: wait fork", "s1: graph 1", "s1: record join1",
                   "s2: wait fork", "s2: graph 2", "s2: record join2",
                   "s3: wait fork", "s3: graph 3", "s3: record join3",
                   "s0: wait join1", "s0: wait join2", "s0: wait join3"]
    log.clear()
    one_gpu_timing.RankGraphReplay(streams[:1], [FakeGraph(log, 0, current)])()  # world 1: no fork, no join
    assert log == ["s0: graph 0"]


class FakeCuda:
    """The torch.cuda calls of GraphPerRank over a clock of microseconds: a
    rank graph's replay takes 1 us per captured step, a spin its cycles at
    SPIN_CYCLES_PER_US; events read the clock."""

    def __init__(self):
        self.clock = 0.0
        self.capturing = None
        self.synchronized = 0

    class Stream:
        device = torch.device("cuda", 0)

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = fake.clock

            def elapsed_time(self, other):
                return (other.t - self.t) / 1e3

            def synchronize(self):
                pass

        class Graph:
            def __init__(self):
                self.steps = 0

            def replay(self):
                fake.clock += self.steps

        @contextlib.contextmanager
        def capture(graph, stream=None):
            fake.capturing = graph
            yield
            fake.capturing = None

        def sleep(cycles):
            fake.clock += cycles / one_gpu_timing.SPIN_CYCLES_PER_US

        def synchronize(device=None):
            fake.synchronized += 1

        current = self.Stream()
        for name, value in {"Event": Event, "CUDAGraph": Graph, "graph": capture, "_sleep": sleep,
                            "synchronize": synchronize, "current_stream": lambda: current,
                            "stream": lambda s: contextlib.nullcontext()}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def call(self, rank, counts):
        def one_call():
            if self.capturing is not None:
                self.capturing.steps += 1
            counts[rank] += 1
        return one_call


def test_graph_per_rank_warms_up_captures_checks_the_first_replay_and_times_per_step(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    counts = [0, 0]
    checked = []
    method = one_gpu_timing.GraphPerRank(steps=16, replays=4, trials=3)
    got = method.measure([FakeCuda.Stream(), FakeCuda.Stream()], [fake.call(r, counts) for r in range(2)],
                         lambda: checked.append(fake.clock))
    assert counts == [2 + 16, 2 + 16]  # two eager warm-up steps, then 16 captured
    assert checked == [2 * 16]  # after the first replay, before any timing
    assert got["k16"] == pytest.approx(2.0) and got["trials_us"] == pytest.approx([2.0] * 3)  # 2 ranks x 1 us
    assert got["head_start_us"] >= 50 and got["host_us_per_step"] > 0 and 0 <= got["host_late_trials"] <= 3
    assert method.keys == ("k16",)


def test_graph_per_rank_counts_the_trials_whose_launches_outlasted_the_head_start(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(one_gpu_timing, "MAX_HEAD_START_US", 1e-6)  # a spin of no cycles: every launch is late
    got = one_gpu_timing.GraphPerRank(steps=8, replays=2, trials=5).measure(
        [FakeCuda.Stream()], [fake.call(0, [0])], lambda: None)
    assert got["host_late_trials"] == 5 and got["k8"] == pytest.approx(1.0)  # world 1: 1 us per step


# ---------------------------------------------------------------------------------------------
# the virtual ranks' memory over a stand-in driver
# ---------------------------------------------------------------------------------------------


CUDA0 = torch.device("cuda", 0)


def test_virtual_ranks_map_every_allocation_into_every_range_and_release_everything(fake_driver):
    driver = fake_driver()
    params = [4, 8, 64, 2]  # Output/LSE: max_rows 4, 8 heads of 64 bf16
    with VirtualRanks(WorkspaceKind.OUTPUT_LSE, params, 4, CUDA0, 2.0) as ranks:
        assert len(ranks.handles) == 4 and set(ranks.handles) <= set(torch.ops.sdcp.workspace_handles())
        assert len(driver.allocations) == 4 and len(driver.ranges) == 4 and len(driver.mappings) == 16
        assert ranks.stride % FakeDriver.GRANULARITY == 0 and ranks.stride >= ranks.layout.region_bytes
        layout = ranks.layout
        for owner in range(4):  # one memory, seen alike from every range
            views = {bytes(driver._resolve(ranks.region(viewer, owner))[0]) for viewer in range(4)}
            assert len(views) == 1
            memory, _ = driver._resolve(ranks.region(owner, owner))
            data = memory[layout.data_offset:layout.data_offset + layout.slots * layout.slot_bytes]
            assert set(memory[:layout.data_offset]) == {0}  # control zeroed, the probe's words gone
            assert set(data) == {0xFF}  # Output/LSE starts sentinel-filled
            assert set(memory[layout.data_offset + len(data):]) == {0}
        handles = list(ranks.handles)
    assert ranks.closed and driver.released()
    assert not set(handles) & set(torch.ops.sdcp.workspace_handles())
    ranks.close()  # idempotent
    assert driver.calls["cuMemRelease"] == 4 and driver.calls["cuMemUnmap"] == 16


def test_the_exchange_starts_zeroed(fake_driver):
    driver = fake_driver()
    with VirtualRanks(WorkspaceKind.EXCHANGE, [64], 2, CUDA0, 2.0) as ranks:
        for owner in range(2):
            assert set(driver._resolve(ranks.region(owner, owner))[0]) == {0}
    assert driver.released()


@pytest.mark.parametrize("fail, at", [("cuMemCreate", 2), ("cuMemMap", 3), ("cuMemSetAccess", 2),
                                      ("cuMemsetD8", 1), ("cuCtxSynchronize", 1)])
def test_a_failed_creation_releases_what_it_set_up(fake_driver, fail, at):
    driver = fake_driver(fail=fail, fail_at=at)
    before = set(torch.ops.sdcp.workspace_handles())
    with pytest.raises(RuntimeError, match=f"{fail} failed: injected"):
        VirtualRanks(WorkspaceKind.TOPK, [2, 16, 16], 2, CUDA0, 2.0)
    assert driver.released() and set(torch.ops.sdcp.workspace_handles()) == before


def test_a_wrong_mapping_fails_the_probe(fake_driver):
    driver = fake_driver(swap=True)
    with pytest.raises(RuntimeError, match="write-and-verify probe: .*rank 1's word in rank 0's region"):
        VirtualRanks(WorkspaceKind.EXCHANGE, [64], 2, CUDA0, 2.0)
    assert driver.released()


def test_a_failed_teardown_step_does_not_stop_the_others(fake_driver):
    driver = fake_driver(fail="cuMemUnmap", fail_at=2)
    ranks = VirtualRanks(WorkspaceKind.QUERY, [2, 4, 32, 1], 2, CUDA0, 2.0)
    with pytest.raises(RuntimeError, match=r"teardown: cuMemUnmap\(0x[0-9a-f]+\): .*injected"):
        ranks.close()
    assert ranks.closed and not ranks.handles and driver.retained == 0 and driver.pushed == 0
    assert not driver.allocations and not driver.ranges and len(driver.mappings) == 1  # the one that failed
    ranks.close()  # nothing left to do


def test_an_error_inside_the_block_is_not_hidden_by_teardown(fake_driver):
    fake_driver(fail="cuMemUnmap", fail_at=1)
    with pytest.raises(KeyError, match="inside"), VirtualRanks(WorkspaceKind.EXCHANGE, [64], 2, CUDA0, 2.0):
        raise KeyError("inside")


# ---------------------------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------------------------


def run_one_gpu(out, *options: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench", "--one-gpu", "2", "--rows", "1", "--trials", "2",
                          *options, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["one_gpu"] == 2 and data["meta"]["worlds"] == [1, 2] and data["meta"]["multi_gpu"] is False
    assert data["meta"]["failures"] == 0
    text = (out / "tables.txt").read_text()
    assert "one GPU, 2 virtual ranks: kernel side, HBM in place of NVLink; not a multi-GPU figure" in text
    assert "reference check ok" in text and "FAILED" not in text and text in res.stdout
    return data


def figures_are_times(data: dict, keys) -> None:
    for name, rows in data["results"].items():
        assert [r["rows"] for r in rows] == [1], name
        for world in (1, 2):
            cell = rows[0][f"world{world}"]
            assert cell["check"] == "ok", (name, cell)
            assert all(isinstance(cell[k], float) and math.isfinite(cell[k]) and cell[k] > 0 for k in keys), cell


@requires_gpus(1)
def test_one_gpu_world_2_runs_checks_and_times_every_boundary(tmp_path):
    data = run_one_gpu(tmp_path / "onegpu", "--one-gpu-steps", "16", "--replays", "3")
    assert data["meta"]["method"] == "graph-per-rank" and data["meta"]["figure_keys"] == ["k16"]
    assert list(data["results"]) == list(one_gpu.BOUNDARIES)
    figures_are_times(data, ["k16"])
    cell = data["results"]["query"][0]["world2"]
    assert len(cell["trials_us"]) == 2 and cell["head_start_us"] > 0 and cell["host_us_per_step"] > 0


@requires_gpus(1)
def test_one_gpu_world_2_one_graph(tmp_path):
    data = run_one_gpu(tmp_path / "onegpu", "--one-gpu-method", "one-graph", "--replays", "3", "--boundaries",
                       "signal,output_lse")
    assert data["meta"]["method"] == "one-graph" and data["meta"]["figure_keys"] == ["k8", "k1"]
    figures_are_times(data, ["k8", "k1"])


@requires_gpus(1)
def test_one_gpu_slice_runs_the_rows_that_do_not_fit_a_whole_gpu(tmp_path):
    out = tmp_path / "sliced"
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench", "--one-gpu", "4", "--one-gpu-slice", "--rows",
                          "200", "--boundaries", "query,topk,output_lse", "--trials", "2", "--replays", "3",
                          "--one-gpu-steps", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "bench.json").read_text())
    meta = data["meta"]
    assert meta["sliced"] and meta["grid_sms"] == meta["sms"] // (4 * meta["grids_per_rank"]), meta
    for name, rows in data["results"].items():  # 200 rows: more than a slice's SMs, so the row loops run too
        for world in (1, 4):
            assert rows[0][f"world{world}"]["check"] == "ok", (name, rows[0])
    text = (out / "tables.txt").read_text()
    assert f"grids sized for {meta['grid_sms']} of {meta['sms']} SMs (--one-gpu-slice)" in text
