"""README.md runs as written. The "API at a glance" example: its first python
block, saved as a script and run in a fresh process (two spawned ranks on the
host backend), exits 0 and prints the text block that follows it. The two
commands of "Set-up" (main job and tests): CI (.ci/run) runs the test command
verbatim; their install is the set-up table's, which on a machine without a GPU
builds the CPU kernels (test/test_build.py runs setup.py's choice); and the main
job's last step, `python -m torch_sdcp.bench` as written, runs on the host
backend and leaves what the README says where it says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## API at a glance"
SETUP = "## Set-up"
INSTALL = "pip install -r requirements.txt && pip install --no-build-isolation --no-deps -e ."


def readme_block(lang: str, heading: str = HEADING, after: str = "") -> str:
    """The first fenced block of `lang` after `heading` (and after the text `after` below it)."""
    text = (ROOT / "README.md").read_text()
    start = text.find(heading)
    assert start >= 0, f"README.md has no {heading!r} heading"
    start = text.find(after, start)
    assert start >= 0, f"README.md has no {after!r} below {heading!r}"
    match = re.compile(rf"^```{lang}\n(.*?)^```$", re.MULTILINE | re.DOTALL).search(text, start)
    assert match, f"README.md has no ```{lang} block after {heading!r}"
    return match.group(1)


def readme_commands() -> tuple:
    """The main job's and the tests' commands of "Set-up", one line each."""
    main = readme_block("bash", SETUP, "Main job:").strip()
    tests = readme_block("bash", SETUP, "Tests:").strip()
    assert "\n" not in main and "\n" not in tests, (main, tests)
    return main, tests


def test_readme_commands_are_the_install_then_one_step_and_ci_runs_the_tests_verbatim():
    main, tests = readme_commands()
    assert main == f"{INSTALL} && python -m torch_sdcp.bench"
    assert tests == f"{INSTALL} && python -m pytest -q test"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command is not a line of .ci/run"
    # CI sets the architectures it builds before it (no GPU there), and nothing else in front of it.
    before = [line for line in ci[:ci.index(tests)] if line and not line.startswith("#")]
    assert before[-1] == 'export TORCH_CUDA_ARCH_LIST="9.0;10.0"', before[-1]
    text = (ROOT / "README.md").read_text()
    assert f"| `{INSTALL}` |" in text, "the set-up table's command is not the commands' install"


def test_ci_runs_the_test_command_in_a_fresh_venv_too():
    """A newcomer runs the test command inside a virtual environment (its own
    build folder, its own site-packages): CI runs it there as well, after
    TORCH_CUDA_ARCH_LIST is unset, in a venv that reuses the installed torch."""
    tests = readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    where = [i for i, line in enumerate(ci) if line == tests]
    assert len(where) == 2, f"expected the test command twice in .ci/run, got {len(where)}"
    before = [line for line in ci[where[0] + 1:where[1]] if line and not line.startswith("#")]
    assert "unset TORCH_CUDA_ARCH_LIST" in before, before
    made = [line for line in before if "python -m venv" in line]
    assert len(made) == 1 and "--system-site-packages" in made[0], made
    venv = made[0].split()[-1].strip('"')
    assert f'source "{venv}/bin/activate"' in before, before


def test_readme_main_job_runs_as_written_on_the_host_backend(tmp_path):
    """`python -m torch_sdcp.bench`, no option, as the README's main job ends (the
    install is the one this test suite runs on): a folder sdcp-bench-<date>-<time>/
    in the working directory with the tables, the JSON marked as not performance, the plot."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("GPUs visible: the main job runs the CUDA backend (tools/gpu_suite.sh bench)")
    step = readme_commands()[0].rsplit(" && ", 1)[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run(step.split(), check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    folders = [p.name for p in tmp_path.iterdir()]
    assert len(folders) == 1 and re.fullmatch(r"sdcp-bench-\d{8}-\d{6}", folders[0]), folders
    out = tmp_path / folders[0]
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "latency.png", "tables.txt"]
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["backend"] == "host" and meta["performance"] is False, meta
    assert "not performance" in res.stdout and f"raw numbers: {out / 'bench.json'}" in res.stdout


def test_readme_names_the_bench_options_that_exist():
    """Every `--option` the README gives for the bench is in its --help."""
    res = subprocess.run([sys.executable, "-m", "torch_sdcp.bench", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    text = (ROOT / "README.md").read_text()
    start = text.find("`python -m torch_sdcp.bench --help` lists the options")
    assert start >= 0
    paragraph = text[start:text.find("\n\n", start)]
    named = set(re.findall(r"`(--[a-z-]+)`", paragraph))
    assert {"--replays", "--trials", "--out", "--rows", "--world-size"} <= named, named
    missing = [o for o in named if o not in res.stdout and o != "--help"]
    assert not missing, missing


def test_readme_example_runs_and_prints_what_it_shows(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(readme_block("python"))
    # A file, not `python -c`: spawned ranks import the main module by path. The package under test is the
    # one this checkout holds, whatever the working directory.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == readme_block("text"), res.stdout + res.stderr
