"""The competitors at `python -m torch_sdcp.bench --one-gpu N`
(bench/one_gpu_competitors.py) where no GPU is needed: their symmetric
buffers on virtual ranks over the stand-in CUDA driver (one memory seen
alike through every rank's range, peers at fixed offsets), every
competitor's per-rank calls under the Triton interpreter with N simulated
ranks over that memory (the kernels run one rank after another: puts before
waits, a publish-and-wait's peers pre-set) checked as the bench checks them,
the device signal round's bounded wait, the co-residency of their waiting
grids, a failed cell kept in its cell, and the table's lines and legend; on a
GPU, runs at world 2 and 4 (sliced) by either method with every competitor
checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from _dist import run_workers
from _fake_cuda_driver import FakeDriver
from _helpers import requires_gpus

import torch_sdcp  # noqa: F401  (registers the ops)
from torch_sdcp.bench import one_gpu, one_gpu_competitors, one_gpu_report, one_gpu_timing
from torch_sdcp.bench.one_gpu_boundaries import BOUNDARY_CLASSES, CheckFailed, Geometry
from torch_sdcp.bench.one_gpu_competitors import COMPETITORS, WaitingGrid, competitors_of
from torch_sdcp.bench.virtual_ranks import VirtualRegions

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)
GEO = Geometry(heads=6, head_dim=32, rope_dim=16, k=16, query_dtype=torch.bfloat16)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")


def fake_bytes(driver: FakeDriver):
    """tensor_at over the stand-in driver: a uint8 CPU tensor sharing the mapped allocation's bytes."""
    def tensor_at(address: int, nbytes: int) -> torch.Tensor:
        memory, offset = driver._resolve(address)
        return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)
    return tensor_at


def open_competitor(driver, name: str, boundary_name: str, rows: int, world: int, spins: int = 1000,
                    grid_sms: int = 2):
    boundary = BOUNDARY_CLASSES[boundary_name](GEO, CPU)
    cls = COMPETITORS[name]
    memory = VirtualRegions(cls.region_bytes(boundary, rows, world), world, CUDA0)
    return memory, cls(boundary, rows, world, memory, spins, grid_sms, device=CPU, tensor_at=fake_bytes(driver))


# ---------------------------------------------------------------------------------------------
# the buffers on virtual ranks (stand-in driver)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, boundary", [("vllm_a2a", "output_lse"), ("flashinfer", "output_lse_up"),
                                            ("vllm_direct", "topk")])
def test_competitor_buffers_are_one_memory_seen_from_every_rank(fake_driver, name, boundary):
    driver = fake_driver()
    world = 3
    memory, ranks = open_competitor(driver, name, boundary, 4, world)
    with memory:
        assert memory.stride >= type(ranks).region_bytes(ranks.boundary, 4, world)
        assert all(o % one_gpu_competitors.ALIGN == 0 for o in ranks.offsets)
        for index, nbytes in enumerate(type(ranks).buffer_bytes(ranks.boundary, 4, world)):
            for owner in range(world):
                own = ranks.buffer(owner, index, torch.uint8, (nbytes,))
                assert set(own.tolist()) == {0}  # zeroed, the probe's words gone
                own[-1] = 0x40 + owner  # a store through the owner's range ...
                for viewer in range(world):  # ... is what every other rank sees of it through its own
                    seen = ranks.buffer(viewer, index, torch.uint8, (nbytes,), owner=owner)
                    assert int(seen[-1]) == 0x40 + owner
                    # its offset from the viewer's own buffer lands where the owner polls its own
                    offsets = ranks.peer_offsets(viewer, index, torch.uint8, (nbytes,))
                    base = ranks.buffer(viewer, index, torch.uint8, (nbytes,)).data_ptr()
                    assert base + int(offsets[owner]) == own.data_ptr()
                own[-1] = 0
    assert driver.released()


def test_a_region_smaller_than_the_buffers_is_refused(fake_driver):
    fake_driver()
    boundary = BOUNDARY_CLASSES["output_lse"](GEO, CPU)
    cls = COMPETITORS["vllm_a2a"]
    with VirtualRegions(64, 2, CUDA0) as memory:
        memory.stride = 64  # as if the granularity were 64 bytes
        with pytest.raises(ValueError, match="vllm_a2a: argument 'memory': expected regions of at least"):
            cls(boundary, 1024, 2, memory, 10, 2, device=CPU)


def test_competitors_by_boundary():
    assert [c.name for c in competitors_of("output_lse")] == ["vllm_a2a", "flashinfer"]
    assert [c.name for c in competitors_of("output_lse_up")] == ["vllm_a2a", "flashinfer"]
    assert [c.name for c in competitors_of("topk")] == ["vllm_direct"]
    assert competitors_of("query") == [] and competitors_of("signal") == []


# ---------------------------------------------------------------------------------------------
# the per-rank calls under the Triton interpreter
# ---------------------------------------------------------------------------------------------


def _interpreted(rank, world, name, boundary_name, n, max_rows, calls):
    # Runs with TRITON_INTERPRET=1: the kernels execute on CPU tensors over the stand-in driver's memory.
    from torch_sdcp.bench import virtual_ranks

    driver = FakeDriver()
    virtual_ranks.cu = driver
    memory, ranks = open_competitor(driver, name, boundary_name, max_rows, n)
    done = 0
    with memory:
        for call in range(calls):  # both slots, and a change of rows
            rows = (max_rows, 1, max_rows - 1)[call % 3]
            inputs = [ranks.boundary.check_inputs(rows + call, r, n) for r in range(n)]
            inputs = [tuple(t[:rows] for t in x) for x in inputs]
            results = ranks.sequential(inputs)
            ranks.health()
            ranks.check(results, inputs, rows, n)  # the bench's check
            bad = list(results)
            bad[n - 1] = (bad[n - 1][0] + 1, bad[n - 1][1]) if isinstance(bad[n - 1], tuple) else bad[n - 1].flip(1)
            with pytest.raises(CheckFailed, match=f"{name}: .*rank {n - 1}"):
                ranks.check(bad, inputs, rows, n)
            done += 1
    assert driver.released()
    # World 1: the bench's own per-rank call (no peer to wait for; FlashInfer's on one program).
    memory, ranks = open_competitor(driver, name, boundary_name, max_rows, 1, grid_sms=1)
    with memory:
        for _ in range(2):
            x = ranks.boundary.check_inputs(max_rows, 0, 1)
            got = ranks.sequential([x]) if name == "flashinfer" else [ranks.call(0, x)]
            ranks.health()
            ranks.check(got, [x], max_rows, 1)
            done += 1
    return done


@needs_triton
@pytest.mark.parametrize("name, boundary", [("vllm_a2a", "output_lse"), ("vllm_a2a", "output_lse_up"),
                                            ("flashinfer", "output_lse"), ("vllm_direct", "topk")])
def test_competitor_calls_on_virtual_ranks_under_the_triton_interpreter(name, boundary):
    res = run_workers(_interpreted, 1, args=(name, boundary, 3, 9, 4), env={"TRITON_INTERPRET": "1"}, timeout=300)
    assert res == [4 + 2]


def _signal_gives_up(rank, world):
    from torch_sdcp.competitors import _signal, _symm

    flags = [torch.zeros(3, dtype=torch.int64) for _ in range(3)]
    offsets = [_symm.element_offsets(flags, f, "cpu") for f in flags]
    epoch, status = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    for r in (0, 1):  # rank 2 never signals
        _signal.signal_round(flags[r], offsets[r], epoch, status, r, 5, "publish")
    assert [f.tolist() for f in flags] == [[1, 1, 0]] * 3  # each rank's word in every rank's array
    _signal.signal_round(flags[0], offsets[0], epoch, status, 0, 5, "wait")
    with pytest.raises(RuntimeError, match="vLLM a2a: rank 0's signal round gave up after its spin limit"):
        _signal.check_status(status, 0, "vLLM a2a")
    _signal.signal_round(flags[2], offsets[2], epoch, status, 2, 5)  # it comes late: the status stays raised
    _signal.signal_round(flags[0], offsets[0], epoch, status, 0, 5, "wait")
    assert int(status[0]) == 1
    with pytest.raises(ValueError, match="argument 'phase'"):
        _signal.signal_round(flags[0], offsets[0], epoch, status, 0, 5, "both")
    return 1


@needs_triton
def test_the_signal_round_is_bounded_and_its_status_sticky():
    assert run_workers(_signal_gives_up, 1, env={"TRITON_INTERPRET": "1"}, timeout=240) == [1]


# ---------------------------------------------------------------------------------------------
# co-residency, failed cells, odd steps (no GPU)
# ---------------------------------------------------------------------------------------------

GLM5 = Geometry(heads=64, head_dim=512, rope_dim=64, k=2048, query_dtype=torch.float8_e4m3fn)
H200_SMS = 132


@pytest.mark.parametrize("pdl", [False, True])
def test_the_competitors_waiting_grids_obey_the_co_residency_rule(pdl):
    olse = BOUNDARY_CLASSES["output_lse"](GLM5, CPU)
    fi = COMPETITORS["flashinfer"]
    # FlashInfer's persistent grid: max(entries, N) blocks, at most 2 per SM of the SMs it is sized for
    assert WaitingGrid(fi, olse).grid(1, 8, H200_SMS) == 8
    blocks, why = one_gpu.residency(WaitingGrid(fi, olse), 128, 8, H200_SMS, fi.blocks_per_sm, pdl and fi.pdl)
    assert blocks == 264 and why is not None and "8 grids of 264 blocks" in why
    assert "twice over" not in why  # FlashInfer's kernel is not launched programmatically
    grid_sms = one_gpu.slice_sms(H200_SMS, 8, pdl, dict(one_gpu.ASSUMED_BLOCKS_PER_SM))
    for rows in (1, 32, 128, 4096):  # sized for the slice, every row count fits
        blocks, why = one_gpu.residency(WaitingGrid(fi, olse), rows, 8, H200_SMS, fi.blocks_per_sm, pdl, grid_sms)
        assert why is None and blocks <= 2 * grid_sms, (rows, why)
    for name, boundary in (("vllm_a2a", "output_lse"), ("vllm_direct", "topk")):  # one waiting program a rank
        b = BOUNDARY_CLASSES[boundary](GLM5, CPU)
        assert one_gpu.residency(WaitingGrid(COMPETITORS[name], b), 4096, 8, H200_SMS, 1, pdl) == (1, None)


def test_a_competitor_that_fails_stays_in_its_cell(monkeypatch, capsys):
    olse = BOUNDARY_CLASSES["output_lse"](GLM5, CPU)
    outcomes = iter([CheckFailed("vllm_a2a: output_lse, world 4, rows 1: rank 2: differs"),
                     RuntimeError("no Triton\nsecond line")])

    def cell(cls, boundary, rows, world, method, timeout_s, grid_sms):
        if world == 1:
            return {"check": "ok", "k64": 3.0}
        raise next(outcomes)

    monkeypatch.setattr(one_gpu, "run_competitor_cell", cell)
    cells, failed = one_gpu.competitor_cells(COMPETITORS["vllm_a2a"], olse, 1, [1, 4], H200_SMS, True, None,
                                             None, 1.0)
    assert failed == 1 and cells["world1"] == {"grid_blocks": 1, "check": "ok", "k64": 3.0}
    assert cells["world4"]["check"] == "MISMATCH" and "rank 2" in cells["world4"]["error"]
    cells, failed = one_gpu.competitor_cells(COMPETITORS["vllm_a2a"], olse, 1, [4], H200_SMS, True, None, None, 1.0)
    assert failed == 1 and cells["world4"]["error"] == "RuntimeError: no Triton"
    cells, failed = one_gpu.competitor_cells(COMPETITORS["flashinfer"], olse, 128, [4], H200_SMS, False, None,
                                             None, 1.0)
    assert failed == 0 and "not co-resident" in cells["world4"]["skipped"]  # never run


def test_vllm_direct_is_skipped_at_an_odd_number_of_steps_per_graph():
    topk = BOUNDARY_CLASSES["topk"](GEO, CPU)
    cell = one_gpu_competitors.run_competitor_cell(COMPETITORS["vllm_direct"], topk, 4, 2,
                                                   one_gpu_timing.GraphPerRank(63, 1, 1), 1.0, 8)
    assert "63 steps per rank graph: an odd number replays a slot twice in a row" in cell["skipped"]


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


def test_the_table_prints_the_competitors_beside_torch_sdcp():
    meta = {"date": "d", "one_gpu": 4, "worlds": [1, 4], "note": one_gpu.NOTE.format(n=4), "device": "gpu",
            "torch": "t", "sms": 132, "blocks_per_sm": {"output_lse": 2, "topk": 1}, "blocks_per_sm_assumed": True,
            "timeout_s": 3.0, "failures": 0, "competitor_failures": 1, "pdl": True, "method": "graph-per-rank",
            "figure_keys": ["k64"], "steps_per_graph": 64, "replays": 16, "trials": 7}
    ok = {"check": "ok"}
    results = {
        "output_lse": [{"rows": 32, "world1": {**ok, "grid_blocks": 48, "k64": 2.0},
                        "world4": {**ok, "grid_blocks": 12, "k64": 4.0},
                        "competitors": {
                            "vllm_a2a": {"world1": {**ok, "grid_blocks": 1, "k64": 5.0},
                                         "world4": {**ok, "grid_blocks": 1, "k64": 9.0}},
                            "flashinfer": {"world1": {**ok, "grid_blocks": 48, "k64": 3.0},
                                           "world4": {"grid_blocks": 264, "skipped": "not co-resident: 4 grids"}}}}],
        "topk": [{"rows": 1, "world1": {**ok, "k64": 7.0}, "world4": {**ok, "k64": 8.0},
                  "competitors": {"vllm_direct": {
                      "world1": {**ok, "grid_blocks": 1, "k64": 6.0},
                      "world4": {"grid_blocks": 1, "check": "MISMATCH",
                                 "error": "vllm_direct: topk, world 4, rows 1: rank 2: 3 of 16 ids differ"}}}}],
        "query": [{"rows": 1, "world1": {**ok, "k64": 1.0}, "world4": {**ok, "k64": 2.0}}]}
    text = one_gpu_report.tables({"meta": meta, "results": results})
    lines = text.splitlines()
    ours = next(line for line in lines if "rows   32  torch_sdcp: world 1 2.0 | world 4 4.0" in line)
    at = lines.index(ours)
    assert "world 4 - world 1 +2.0 us (k64)" in ours
    a2a, fi = lines[at + 1], lines[at + 2]
    assert a2a.strip().startswith("vLLM a2a:") and "world 1 5.0 | world 4 9.0 | world 4 - world 1 +4.0 us (k64)" in a2a
    assert "/ torch_sdcp at world 4 2.25x" in a2a and "check ok" in a2a and "waiting grid blocks" in a2a
    assert fi.strip().startswith("FlashInfer fused:") and "world 4 skipped" in fi and "world 4 - world 1" not in fi
    assert "world 4: not co-resident: 4 grids" in lines[at + 3]
    direct = next(line for line in lines if line.strip().startswith("vLLM direct:"))
    assert "world 1 6.0 | world 4 MISMATCH" in direct and "check FAILED" in direct
    assert "rows    1  world 1 1.0 | world 4 2.0" in text  # a boundary with no competitor: no label
    assert "1 competitor cell(s) FAILED (not counted in the exit status)" in text
    legend = text[text.index("\nlegend"):]
    for boundary, name, what in (("output_lse", "vLLM a2a", "vllm_a2a.a2a_call"),
                                 ("output_lse", "FlashInfer fused", "flashinfer_combine.fi_launch"),
                                 ("topk", "vLLM direct", "vllm_direct_topk.direct_call")):
        assert f"  {boundary} / {name}: {what}" in legend
    assert "release flag per peer, bounded acquire spins" in legend and "direct_topk_spec" in legend
    assert "the competitors' figures are reproductions" in legend and "docstring says where it differs" in legend
    del results["output_lse"], results["topk"]  # no competitor ran: no competitor legend
    assert "reproductions" not in one_gpu_report.tables({"meta": meta, "results": results})


# ---------------------------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------------------------


@requires_gpus(1)
@pytest.mark.parametrize("world, options", [(2, ()), (4, ("--one-gpu-slice",)),
                                            (2, ("--one-gpu-method", "one-graph"))])
def test_the_competitors_run_beside_torch_sdcp_on_one_gpu(tmp_path, world, options):
    out = tmp_path / "onegpu"
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench", "--one-gpu", str(world), "--rows", "1,40",
                          "--boundaries", "topk,output_lse,output_lse_up", "--trials", "2", "--replays", "3",
                          *(("--one-gpu-steps", "8") if "one-graph" not in options else ()), *options,
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["competitor_failures"] == 0, res.stdout + res.stderr
    for name, rows in data["results"].items():
        for row in rows:
            assert set(row["competitors"]) == {c.name for c in competitors_of(name)}, (name, row)
            for comp, cells in row["competitors"].items():
                for w in (1, world):
                    cell = cells[f"world{w}"]
                    if "skipped" in cell:  # FlashInfer's grid at 40 rows, unsliced
                        assert comp == "flashinfer" and "--one-gpu-slice" not in options, cell
                        continue
                    key = data["meta"]["figure_keys"][0]
                    assert cell["check"] == "ok" and cell[key] > 0, (name, comp, w, cell)
    text = (out / "tables.txt").read_text()
    assert "vLLM a2a:" in text and "FlashInfer fused:" in text and "vLLM direct:" in text
    assert "the competitors' figures are reproductions" in text and "FAILED" not in text
