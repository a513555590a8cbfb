"""README.md's "API at a glance" example runs as it stands: its first python
block, saved as a script and run in a fresh process (two spawned ranks on the
host backend), exits 0 and prints the text block that follows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## API at a glance"


def readme_block(lang: str) -> str:
    """The first fenced block of `lang` after the "API at a glance" heading."""
    text = (ROOT / "README.md").read_text()
    start = text.find(HEADING)
    assert start >= 0, f"README.md has no {HEADING!r} heading"
    match = re.compile(rf"^```{lang}\n(.*?)^```$", re.MULTILINE | re.DOTALL).search(text, start)
    assert match, f"README.md has no ```{lang} block after {HEADING!r}"
    return match.group(1)


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
