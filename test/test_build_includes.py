"""setup.py's CUDA include path in an environment where pip installed CUDA
headers newer than the toolkit (vLLM 0.33.0 pulls CUDA 13.5 headers into
site-packages/nvidia/cu13/include beside a 13.0 toolkit): pip's headers are
used only where the toolkit lacks them, so the toolkit's own crt headers
always win. The last test compiles a .cu file with nvcc (skipped without)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def tree(tmp_path):
    """A toolkit include folder with cuda_runtime.h and crt/host_runtime.h; a
    pip root whose cu13 package has a newer crt/host_runtime.h (poisoned),
    cusparse.h (which the toolkit lacks) and a header below a subfolder."""
    toolkit = tmp_path / "toolkit" / "include"
    _write(str(toolkit / "cuda_runtime.h"), "/* toolkit */\n")
    _write(str(toolkit / "crt" / "host_runtime.h"), "/* toolkit */\n")
    pip_root = tmp_path / "site-packages" / "nvidia"
    inc = pip_root / "cu13" / "include"
    _write(str(inc / "crt" / "host_runtime.h"), "#error pip's newer crt/host_runtime.h was used\n")
    _write(str(inc / "cuda_runtime.h"), "#error pip's cuda_runtime.h was used\n")
    _write(str(inc / "cusparse.h"), "#define SDCP_PIP_CUSPARSE 1\n")
    _write(str(inc / "cccl" / "extra.h"), "#define SDCP_PIP_EXTRA 1\n")
    return str(toolkit), [str(pip_root)], str(tmp_path / "overlay")


def test_only_headers_the_toolkit_lacks(setup_py, tree):
    toolkit, roots, overlay = tree
    lacking = setup_py.headers_toolkit_lacks(toolkit, roots)
    assert sorted(lacking) == [os.path.join("cccl", "extra.h"), "cusparse.h"], lacking
    dirs = setup_py.pip_cuda_include_dirs(toolkit, roots, overlay, needed=("cusparse.h",))
    assert dirs == [overlay]
    found = sorted(os.path.relpath(os.path.join(d, f), overlay) for d, _, fs in os.walk(overlay) for f in fs)
    assert found == [os.path.join("cccl", "extra.h"), "cusparse.h"], found
    assert not os.path.exists(os.path.join(overlay, "crt")), "pip's crt headers must never be on the path"
    assert os.path.realpath(os.path.join(overlay, "cusparse.h")) == os.path.realpath(lacking["cusparse.h"])


def test_nothing_when_the_toolkit_has_what_torch_needs(setup_py, tree):
    toolkit, roots, overlay = tree
    _write(os.path.join(toolkit, "cusparse.h"), "/* toolkit */\n")
    assert setup_py.pip_cuda_include_dirs(toolkit, roots, overlay, needed=("cusparse.h",)) == []
    assert not os.path.exists(overlay)


def test_overlay_rebuilt_each_time(setup_py, tree):
    toolkit, roots, overlay = tree
    _write(os.path.join(overlay, "stale.h"), "stale\n")
    setup_py.pip_cuda_include_dirs(toolkit, roots, overlay, needed=("cusparse.h",))
    assert not os.path.exists(os.path.join(overlay, "stale.h"))


def _nvcc_toolkit():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=120)
    for line in (out.stderr + out.stdout).splitlines():
        if line.startswith("#$ TOP="):
            return nvcc, os.path.join(os.path.realpath(line.split("=", 1)[1].strip()), "include")
    pytest.skip("nvcc does not say where its toolkit is")


def test_nvcc_compiles_with_pip_headers_newer_than_the_toolkit(setup_py, tmp_path):
    """A pip folder with a poisoned crt/host_runtime.h and cuda_runtime.h
    beside the real toolkit: with the overlay the .cu file compiles (and
    sees the pip-only header); pip's folder first on the path (the old
    flags) picks the poisoned header and fails."""
    nvcc, toolkit = _nvcc_toolkit()
    if not os.path.exists(os.path.join(toolkit, "crt", "host_runtime.h")):
        pytest.skip(f"{toolkit} has no crt/host_runtime.h")
    inc = tmp_path / "site-packages" / "nvidia" / "cu13" / "include"
    _write(str(inc / "crt" / "host_runtime.h"), "#error pip's newer crt/host_runtime.h was used\n")
    _write(str(inc / "cuda_runtime.h"), "#error pip's cuda_runtime.h was used\n")
    _write(str(inc / "sdcp_pip_only.h"), "#define SDCP_PIP_ONLY 7\n")
    src = tmp_path / "probe.cu"
    _write(str(src), '#include <cuda_runtime.h>\n#include "sdcp_pip_only.h"\n'
                     "static_assert(SDCP_PIP_ONLY == 7, \"pip-only header\");\n"
                     "__global__ void probe(int* x) { x[threadIdx.x] = SDCP_PIP_ONLY; }\n"
                     "int main() { probe<<<1, 1>>>(nullptr); return 0; }\n")
    dirs = setup_py.pip_cuda_include_dirs(toolkit, [str(tmp_path / "site-packages" / "nvidia")],
                                          str(tmp_path / "overlay"), needed=("sdcp_pip_only.h",))
    assert dirs == [str(tmp_path / "overlay")]
    flags = ["-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "probe.o")]
    good = subprocess.run([nvcc, *[f"-I{d}" for d in dirs], *flags], capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr
    bad = subprocess.run([nvcc, f"-I{inc}", *flags], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "was used" in bad.stderr, bad.stderr
