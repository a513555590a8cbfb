"""The decode step's boundaries summed from a run's cells (bench/step_figure.py):
the sum per model, the lines under the plain bench's and the one-GPU bench's
tables, and what is said when a cell is missing."""

import pytest

from torch_sdcp.bench import one_gpu_report, report
from torch_sdcp.bench.presets import PRESETS
from torch_sdcp.bench.step_figure import STEP_MODELS, step_lines, step_us


def test_every_preset_has_a_step_model():
    assert set(STEP_MODELS) == set(PRESETS)


@pytest.mark.parametrize("preset, want", [("glm-5", 78 * (2.0 + 3.0) + 21 * 5.0),
                                          ("deepseek-v3.2", 61 * (2.0 + 3.0) + 61 * 5.0)])
def test_a_step_is_layers_of_gathers_and_combines_and_the_fresh_top_k(preset, want):
    assert step_us(STEP_MODELS[preset], query=2.0, topk=5.0, output_lse=3.0) == pytest.approx(want)


def plain_row(rows, collective, sdcp):
    return {"rows": rows, "collective": {"k8": collective, "k1": collective + 1}, "sdcp": {"k8": sdcp, "k1": sdcp + 1}}


def plain_run(topk_error=False):
    results = {"query": [plain_row(1, 4.0, 2.0), plain_row(32, 5.0, 3.0)],
               "topk": [plain_row(1, 10.0, 5.0), plain_row(32, 11.0, 6.0)],
               "output_lse": [plain_row(1, 5.0, 2.0), plain_row(32, 6.0, 3.0)]}
    if topk_error:
        results["topk"][1]["sdcp"] = {"error": "boom"}
    return {"meta": {"date": "d", "world_size": 2, "backend": "cuda", "device": "NVIDIA H200", "torch": "t",
                     "args": {"preset": "glm-5"}}, "results": results}


def test_the_plain_bench_prints_the_step_of_its_preset_per_row_count():
    text = report.tables(plain_run())
    assert "one decode step's DCP boundaries, GLM-5: 78 layers" in text and "2 GPUs: the link as this machine" in text
    c1, s1 = 78 * 9 + 21 * 10, 78 * 4 + 21 * 5
    assert f"rows    1  collective {c1} us | torch_sdcp {s1} us | collective/torch_sdcp {c1 / s1:.2f}x " \
           f"({s1 - c1:+d} us)" in text


def test_a_cell_that_did_not_run_leaves_its_path_unsummed():
    text = report.tables(plain_run(topk_error=True))
    assert "rows   32  collective" in text and "torch_sdcp n/a (a cell did not run)" in text


def test_a_run_without_every_boundary_says_what_it_lacks():
    data = plain_run()
    del data["results"]["topk"]
    lines = step_lines(data["results"], "glm-5", {"collective": "collective", "sdcp": "torch_sdcp"}, "k8", "x")
    assert lines[-1] == "  not summed: the run has no topk (a step needs query, topk, output_lse)"
    assert step_lines(data["results"], "other-model", {"sdcp": "torch_sdcp"}, "k8", "x") == []


def test_the_host_backend_prints_no_step():
    data = plain_run()
    data["meta"]["backend"] = "host"
    assert "one decode step" not in report.tables(data)


def test_the_one_gpu_bench_prints_world_n_minus_world_1_per_step():
    def cell(us):
        return {"k64": us, "check": "ok", "grid_blocks": 1}
    results = {b: [{"rows": 1, "world1": cell(f), "world4": cell(f + d)}]
               for b, f, d in (("query", 2.0, 1.0), ("topk", 5.0, 8.0), ("output_lse", 2.0, 3.0))}
    skipped = {"skipped": "not co-resident", "grid_blocks": 32}
    results["topk"].append({"rows": 32, "world1": cell(6.0), "world4": skipped})
    meta = {"one_gpu": 4, "worlds": [1, 4], "note": "one GPU, 4 virtual ranks", "sms": 132, "blocks_per_sm": {},
            "blocks_per_sm_assumed": True, "timeout_s": 3.0, "pdl": True, "grids_per_rank": 2,
            "method": "graph-per-rank", "figure_keys": ["k64"], "steps_per_graph": 64, "replays": 16, "trials": 7,
            "date": "d", "device": "NVIDIA H100", "torch": "t", "args": {"preset": "deepseek-v3.2"}}
    text = one_gpu_report.tables({"meta": meta, "results": results})
    w1, w4 = 61 * 4 + 61 * 5, 61 * 8 + 61 * 13
    assert "the kernel side only, the link is not in it" in text
    assert f"rows    1  world 1 {w1} us | world 4 {w4} us | world 4 - world 1 {w4 - w1:+d} us" in text
    assert "rows   32" not in text.split("one decode step")[1]  # only the row counts every boundary ran


def test_a_run_with_the_up_projected_combine_sums_it_from_8_rows():
    data = plain_run()
    data["results"]["output_lse_up"] = [plain_row(1, 1.0, 0.5), plain_row(32, 2.0, 1.0)]
    lines = step_lines(data["results"], "glm-5", {"collective": "collective", "sdcp": "torch_sdcp"}, "k8", "x")
    at = next(i for i, line in enumerate(lines) if "after the V up-projection" in line)
    assert "from 8 rows" in lines[at]
    c32, s32 = 78 * (5 + 2) + 21 * 11, 78 * (3 + 1) + 21 * 6  # query + the up-projected combine, top-K
    assert lines[at + 1].startswith(f"  rows   32  collective {c32} us | torch_sdcp {s32} us")
    assert len(lines) == at + 2  # 1 row is below vLLM's threshold: not summed with it
    assert not any("V up-projection" in line for line in step_lines(
        plain_run()["results"], "glm-5", {"sdcp": "torch_sdcp"}, "k8", "x"))
