"""Run a set of tests many times at once, under load, and count what failed.

    python tools/stress.py [--rounds R] [--parallel P] [--burn K] [--timeout S]
                           [-m MARKEXPR] [-k EXPR] [--out FILE] [PATH_OR_NODE_ID ...]

Each round starts P pytest processes at the same time, each running every selected test
(R x P runs of each test in all), while K busy-looping processes keep the CPU cores loaded.
Each pytest process writes its own JUnit XML; the summary counts, per test, the runs that
passed, failed and were skipped, and splits the failures into WRONG RESULTS (the failure's
message says a result was wrong: the word "wrong", as the tests' assertions on results say it,
or torch.testing's "not close" / "not equal" / "Mismatched elements") and other failures (a
timeout, an error report that differs, a crash). A pytest process still running after
--timeout seconds is killed and counted as a hang (the tail of its output names the test).

Defaults: the tests of the failures seen with every rank on one GPU (test_rows_mismatch.py,
test_void_calls.py, test_call_tags.py, test_query_view.py, test_cuda_aborts.py) with -m gpu.
`-m ''` drops the marker expression. Exit status: 0 when tests ran and none failed, 1 on any
failure or hang, 2 when no test ran (every one skipped, or none selected: "0 ran").

    python tools/stress.py --rounds 5 --parallel 6 -m gpu          # one GPU
    python tools/stress.py -m '' -k 'not cuda' --parallel 2 --burn 2 --rounds 3   # host backend
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

DEFAULT_PATHS = [
    "test/test_rows_mismatch.py",
    "test/test_void_calls.py",
    "test/test_call_tags.py",
    "test/test_query_view.py",
    "test/test_cuda_aborts.py",
]
# A failure that reports a wrong result: the tests say "wrong" in the assertion on a result;
# torch.testing.assert_close says "not close" / "not equal" and counts "Mismatched elements".
WRONG = re.compile(r"\bwrong\b|Tensor-likes are not (close|equal)|Scalars are not (close|equal)|"
                   r"Mismatched elements", re.IGNORECASE)
# Where _dist.run_workers appends the workers' own output to its failure: not the failure itself.
WORKER_LOGS = "\n----- rank "
BURNER = "while True:\n    pass\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="pytest files or node ids (default: the shared-GPU failure tests)")
    p.add_argument("--rounds", type=positive, default=3, help="rounds, one after another (default 3)")
    p.add_argument("--parallel", type=positive, default=6, help="pytest processes at once per round (default 6)")
    p.add_argument("--burn", type=non_negative, default=0, help="busy-looping processes meanwhile (default 0)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one pytest process may run before it is killed as a hang (default 600)")
    p.add_argument("-m", dest="marker", default="gpu", help="pytest marker expression (default 'gpu'; '' for none)")
    p.add_argument("-k", dest="keyword", default="", help="pytest -k expression")
    p.add_argument("--out", default="stress.json", help="the JSON report (default stress.json)")
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    args.paths = args.paths or DEFAULT_PATHS
    return args


def positive(text: str) -> int:
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def pytest_command(args: argparse.Namespace, junit: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if args.marker:
        cmd += ["-m", args.marker]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd + list(args.paths)


def node_id(classname: str, name: str) -> str:
    """The pytest node id of a JUnit test case ("test.test_x" + "test_a[p]" -> "test/test_x.py::test_a[p]")."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(path):
            return "::".join([path, *parts[i:], name])
    return f"{classname}::{name}"


def read_junit(path: str) -> list[dict]:
    """One record per test case: its id, outcome (passed, failed, skipped), seconds and failure message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        record = {"test": node_id(case.get("classname", ""), case.get("name", "")),
                  "seconds": float(case.get("time") or 0.0), "outcome": "passed", "message": ""}
        for child in case:
            if child.tag in ("failure", "error"):
                record["outcome"] = "failed"
                record["message"] = child.get("message") or (child.text or "")
                break
            if child.tag == "skipped":
                record["outcome"] = "skipped"
        cases.append(record)
    return cases


def is_wrong_result(message: str) -> bool:
    return WRONG.search(message.split(WORKER_LOGS, 1)[0]) is not None


def hung_test(log: str) -> str:
    """The test a killed pytest -v process was in: its last line that names a test without an outcome."""
    for line in reversed(log.splitlines()):
        if "::" in line and not re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", line):
            return line.split()[0]
    return "(none started)"


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_round(args: argparse.Namespace, workdir: str, round_no: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Runs P pytest processes at once; returns their test cases, hangs and process errors."""
    procs = []
    for i in range(args.parallel):
        junit = os.path.join(workdir, f"r{round_no}p{i}.xml")
        log_path = os.path.join(workdir, f"r{round_no}p{i}.log")
        with open(log_path, "w") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(pytest_command(args, junit), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group: a hang is killed with its ranks
        procs.append((i, proc, junit, log_path, time.monotonic()))
    deadline = time.monotonic() + args.timeout
    cases, hangs, errors = [], [], []
    for i, proc, junit, log_path, started in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
        except BaseException:  # Ctrl-C: no pytest process of this round outlives the run
            for _, other, *_ in procs:
                kill_group(other)
            raise
        seconds = time.monotonic() - started
        with open(log_path, errors="replace") as f:
            log = f.read()
        where = {"round": round_no, "process": i}
        if proc.returncode == -signal.SIGKILL:
            hangs.append({**where, "seconds": round(seconds, 1), "test": hung_test(log), "tail": log[-2000:]})
            continue
        if os.path.exists(junit):
            cases += [{**case, **where} for case in read_junit(junit)]
        # 0: passed; 1: tests failed (in the XML); 5: nothing collected. Anything else is the process's own.
        if proc.returncode not in (0, 1, 5) or not os.path.exists(junit):
            errors.append({**where, "exit": proc.returncode, "tail": log[-2000:]})
    return cases, hangs, errors


def summarize(cases: list[dict], hangs: list[dict], errors: list[dict]) -> dict:
    tests: dict[str, dict] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "max_s": 0.0, "total_s": 0.0})
    failures = []
    for case in cases:
        t = tests[case["test"]]
        t[case["outcome"]] += 1
        if case["outcome"] != "skipped":
            t["max_s"] = round(max(t["max_s"], case["seconds"]), 3)
            t["total_s"] = round(t["total_s"] + case["seconds"], 3)
        if case["outcome"] == "failed":
            kind = "wrong result" if is_wrong_result(case["message"]) else "other"
            failures.append({"test": case["test"], "round": case["round"], "process": case["process"],
                             "kind": kind, "message": case["message"][:4000]})
    ran = sum(t["passed"] + t["failed"] for t in tests.values())
    wrong = sum(f["kind"] == "wrong result" for f in failures)
    return {"tests": dict(sorted(tests.items())), "ran": ran,
            "passed": sum(t["passed"] for t in tests.values()), "failed": len(failures),
            "skipped": sum(t["skipped"] for t in tests.values()), "wrong_results": wrong,
            "other_failures": len(failures) - wrong, "hangs": hangs, "process_errors": errors,
            "failures": failures}


def exit_status(report: dict) -> int:
    if report["failed"] or report["hangs"] or report["process_errors"]:
        return 1
    return 2 if report["ran"] == 0 else 0


def render(report: dict) -> str:
    lines = [f"{name}: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, "
             f"max {t['max_s']:.1f} s" for name, t in report["tests"].items()]
    lines.append("")
    for f in report["failures"]:
        first = f["message"].split(WORKER_LOGS, 1)[0].strip().splitlines()[:3]
        lines.append(f"FAILED ({f['kind']}) round {f['round']} process {f['process']}: {f['test']}")
        lines += [f"    {line[:200]}" for line in first]
    for h in report["hangs"]:
        lines.append(f"HANG round {h['round']} process {h['process']} killed after {h['seconds']:.0f} s in {h['test']}")
    for e in report["process_errors"]:
        tail = e["tail"].strip().splitlines()[-3:]
        lines.append(f"PROCESS ERROR round {e['round']} process {e['process']}: exit {e['exit']}")
        lines += [f"    {line[:200]}" for line in tail]
    if report["interrupted"]:
        lines.append("INTERRUPTED: only the rounds that finished are counted")
    if report["ran"] == 0:
        lines.append("NOTHING RAN: 0 ran (every selected test was skipped, or none was selected)")
    lines.append(f"{report['ran']} ran: {report['passed']} passed, {report['failed']} failed "
                 f"({report['wrong_results']} WRONG RESULTS, {report['other_failures']} other), "
                 f"{report['skipped']} skipped, {len(report['hangs'])} hangs, "
                 f"{len(report['process_errors'])} process errors; "
                 f"{report['rounds']} rounds x {report['parallel']} processes, {report['burn']} burners, "
                 f"{report['wall_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER], start_new_session=True) for _ in range(args.burn)]
    start = time.monotonic()
    cases, hangs, errors = [], [], []
    interrupted = False
    try:
        with tempfile.TemporaryDirectory(prefix="sdcp-stress-") as workdir:
            for r in range(args.rounds):
                got = run_round(args, workdir, r)
                cases += got[0]
                hangs += got[1]
                errors += got[2]
                print(f"round {r + 1}/{args.rounds}: {sum(c['outcome'] != 'skipped' for c in got[0])} ran, "
                      f"{sum(c['outcome'] == 'failed' for c in got[0])} failed, {len(got[1])} hangs "
                      f"({time.monotonic() - start:.0f} s)", flush=True)
    except KeyboardInterrupt:  # the rounds that finished are still reported
        interrupted = True
    finally:
        for b in burners:
            kill_group(b)
    report = summarize(cases, hangs, errors)
    report.update(command=pytest_command(args, "JUNIT")[1:], rounds=args.rounds, parallel=args.parallel,
                  burn=args.burn, timeout_s=args.timeout, wall_s=round(time.monotonic() - start, 1))
    report["interrupted"] = interrupted
    report["exit"] = 1 if interrupted else exit_status(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(render(report))
    return report["exit"]


if __name__ == "__main__":
    sys.exit(main())
