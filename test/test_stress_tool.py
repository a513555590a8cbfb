"""tools/stress.py: the counts it aggregates from its pytest processes, the wrong results told
from other failures, a run where nothing ran said as such, the exit status, a hang killed."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "stress.py")

SYNTHETIC = '''
import os
import time

import pytest


def test_passes():
    assert 1 + 1 == 2


def test_wrong_result():
    assert [1, 2] == [1, 2], "unreachable"
    assert False, "the next call is wrong"


def test_other_failure():
    raise RuntimeError("rank 1 timed out waiting for rank 0")


@pytest.mark.skip(reason="needs a GPU")
def test_skipped():
    pass


@pytest.mark.slowpoke
def test_hangs():
    with open("hang.pid", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
'''


@pytest.fixture(scope="module")
def stress():
    spec = importlib.util.spec_from_file_location("sdcp_stress_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args, timeout=120):
    (tmp_path / "test_synthetic.py").write_text(SYNTHETIC)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slowpoke: sleeps\n")
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out), *args, "test_synthetic.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def test_counts_every_run_and_tells_wrong_results_from_other_failures(tmp_path):
    proc, report = _run(tmp_path, "--rounds", "2", "--parallel", "2", "-m", "not slowpoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    tests = report["tests"]
    assert tests["test_synthetic.py::test_passes"]["passed"] == 4, tests
    assert tests["test_synthetic.py::test_wrong_result"]["failed"] == 4, tests
    assert tests["test_synthetic.py::test_other_failure"]["failed"] == 4, tests
    skipped = tests["test_synthetic.py::test_skipped"]
    assert (skipped["skipped"], skipped["passed"], skipped["failed"]) == (4, 0, 0), tests
    assert "test_synthetic.py::test_hangs" not in tests  # deselected
    assert (report["ran"], report["passed"], report["failed"], report["skipped"]) == (12, 4, 8, 4), report
    assert (report["wrong_results"], report["other_failures"]) == (4, 4), report
    kinds = {(f["test"].rsplit("::", 1)[1], f["kind"]) for f in report["failures"]}
    assert kinds == {("test_wrong_result", "wrong result"), ("test_other_failure", "other")}, kinds
    assert {(f["round"], f["process"]) for f in report["failures"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert report["hangs"] == [] and report["process_errors"] == [], report
    assert "12 ran: 4 passed, 8 failed (4 WRONG RESULTS, 4 other), 4 skipped, 0 hangs" in proc.stdout, proc.stdout
    assert "FAILED (wrong result) round 0 process 0: test_synthetic.py::test_wrong_result" in proc.stdout


def test_a_run_where_every_test_is_skipped_is_not_a_pass(tmp_path):
    proc, report = _run(tmp_path, "--rounds", "1", "--parallel", "2", "-m", "", "-k", "skipped")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (report["ran"], report["skipped"], report["failed"]) == (0, 2, 0), report
    assert "NOTHING RAN: 0 ran" in proc.stdout and "0 ran: 0 passed" in proc.stdout, proc.stdout


def test_a_run_that_selects_nothing_is_not_a_pass(tmp_path):
    proc, report = _run(tmp_path, "--rounds", "1", "--parallel", "1", "-m", "", "-k", "no_such_test")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert report["ran"] == 0 and report["tests"] == {} and report["process_errors"] == [], report
    assert "0 ran" in proc.stdout


def test_a_passing_run_exits_0(tmp_path):
    proc, report = _run(tmp_path, "--rounds", "1", "--parallel", "2", "--burn", "1", "-m", "", "-k", "passes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (report["ran"], report["passed"], report["burn"]) == (2, 2, 1), report


def test_a_process_over_its_timeout_is_killed_and_counted_as_a_hang(tmp_path):
    proc, report = _run(tmp_path, "--rounds", "1", "--parallel", "1", "--timeout", "3", "-m", "slowpoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(report["hangs"]) == 1 and report["hangs"][0]["test"] == "test_synthetic.py::test_hangs", report
    assert report["hangs"][0]["seconds"] < 60, report  # killed at --timeout, not after the test's sleep
    assert "HANG round 0 process 0 killed after 3 s in test_synthetic.py::test_hangs" in proc.stdout, proc.stdout


def test_wrong_results_are_read_from_the_failure_not_from_the_workers_logs(stress):
    assert stress.is_wrong_result("AssertionError: rank 1: CALL: AssertionError: the next call within the bound "
                                  "is wrong")
    assert stress.is_wrong_result("AssertionError: Tensor-likes are not close!\n\nMismatched elements: 3 / 8")
    assert not stress.is_wrong_result("AssertionError: first error: rank 0 raised RuntimeError: timed out\n"
                                      "----- rank 0 output -----\nsomething went wrong")


def test_bad_arguments_are_usage_errors():
    for args, said in ((["--rounds", "0"], "--rounds: expected an integer >= 1, got '0'"),
                       (["--burn", "x"], "--burn: expected an integer, got 'x'"),
                       (["--timeout", "-1"], "--timeout: expected a positive number of seconds, got -1.0")):
        proc = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)


def test_ctrl_c_reports_the_rounds_that_finished_and_leaves_no_pytest_process(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SYNTHETIC)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slowpoke: sleeps\n")
    out = tmp_path / "stress.json"
    proc = subprocess.Popen([sys.executable, TOOL, "--out", str(out), "--rounds", "2", "--parallel", "1",
                             "-m", "slowpoke", "test_synthetic.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    time.sleep(3.0)  # the round's pytest process is inside test_hangs
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "INTERRUPTED" in stdout, stdout
    assert json.loads(out.read_text())["interrupted"] is True
    pid = int((tmp_path / "hang.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}"), pid  # the round's pytest process is killed (and reaped)
