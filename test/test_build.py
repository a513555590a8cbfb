"""The build: setup.py's rule for when the CUDA kernels are built, its build
folders (one per torch version and kind, reused when that torch comes back),
and the check of torch_sdcp._extension: an extension built against another
torch, or one that does not load, is one ImportError naming both torches and
the command that rebuilds it on this machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import types

import pytest
import torch

import torch_sdcp
from torch_sdcp import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REBUILD = "pip install --no-build-isolation --no-deps -e ."
RUNNING = f"torch {torch.__version__} / " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA")


@pytest.fixture
def build_info(monkeypatch):
    """Registers a fake build-info module and returns its name."""
    def make(torch_version: str, cuda_version: str | None) -> str:
        name = "sdcp_test_build_info"
        module = types.ModuleType(name)
        module.TORCH_VERSION, module.CUDA_VERSION = torch_version, cuda_version
        monkeypatch.setitem(sys.modules, name, module)
        return name
    return make


@pytest.fixture
def broken_extension(tmp_path, monkeypatch):
    """A module that fails to load as a wheel built against another torch does."""
    name = "sdcp_test_broken_extension"
    (tmp_path / f"{name}.py").write_text(
        'raise ImportError("libc10_cuda.so: cannot open shared object file: No such file or directory")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_mismatch_names_both_torches_and_the_rebuild(build_info):
    info = build_info("2.11.0+cu128", "12.8")
    with pytest.raises(ImportError) as e:
        _extension.load_extension(build_info=info)
    msg = str(e.value)
    assert "built against torch 2.11.0+cu128 / CUDA 12.8" in msg
    assert f"but this is {RUNNING}" in msg
    assert REBUILD in msg and "for a wheel, build the wheel again against this torch" in msg


def test_mismatch_of_the_cuda_version_alone(build_info):
    other = None if torch.version.cuda else "12.8"
    info = build_info(str(torch.__version__), other)
    with pytest.raises(ImportError, match=re.escape(f"but this is {RUNNING}: rebuild it")):
        _extension.load_extension(build_info=info)


def test_failed_load_names_the_error_both_torches_and_the_rebuild(build_info, broken_extension):
    info = build_info(str(torch.__version__), torch.version.cuda)
    with pytest.raises(ImportError) as e:
        _extension.load_extension(broken_extension, build_info=info)
    msg = str(e.value)
    assert f"cannot load the extension {broken_extension} (libc10_cuda.so: cannot open shared object file" in msg
    assert f"it was built against {RUNNING}, this is {RUNNING}" in msg
    assert REBUILD in msg
    assert isinstance(e.value.__cause__, ImportError)


def test_failed_load_without_build_info(broken_extension):
    with pytest.raises(ImportError, match=re.escape("built against a torch it did not record, this is " + RUNNING)):
        _extension.load_extension(broken_extension, build_info="sdcp_test_no_such_build_info")


def test_missing_extension_says_build_it():
    with pytest.raises(ImportError, match=re.escape("is not built (this is " + RUNNING + "): build it: ")) as e:
        _extension.load_extension("torch_sdcp._no_such_extension", build_info="sdcp_test_no_such_build_info")
    assert REBUILD in str(e.value)


def test_matching_build_info_loads(build_info):
    info = build_info(str(torch.__version__), torch.version.cuda)
    assert _extension.load_extension(build_info=info) is torch_sdcp._C


def test_one_version():
    from torch_sdcp import _version
    assert torch_sdcp.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch_sdcp.__version__)


def test_rebuild_command_for_a_machine_without_a_gpu():
    how = _extension.how_to_build_for("13.0", 0)
    assert f"`SDCP_NO_CUDA=1 {REBUILD}` (CPU kernels and the host backend" in how
    assert f'CUDA kernels for other machines: `TORCH_CUDA_ARCH_LIST="9.0;10.0" {REBUILD}`' in how


def test_rebuild_command_for_a_gpu_machine():
    how = _extension.how_to_build_for("13.0", 2)
    assert how.startswith(f"in the checkout, `{REBUILD}` (CUDA kernels for the visible GPUs)")
    assert "SDCP_NO_CUDA" not in how and "TORCH_CUDA_ARCH_LIST" not in how


def test_rebuild_command_for_a_cpu_build_of_torch():
    how = _extension.how_to_build_for(None, 0)
    assert f"`SDCP_NO_CUDA=1 {REBUILD}`" in how and "this torch has no CUDA" in how
    assert "TORCH_CUDA_ARCH_LIST" not in how


def test_mismatch_error_names_the_command_for_this_machine(build_info, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ImportError) as e:
        _extension.load_extension(build_info=build_info("2.11.0+cu128", "12.8"))
    assert f"rebuild it against this torch: in the checkout, `SDCP_NO_CUDA=1 {REBUILD}`" in str(e.value)
    if torch.version.cuda:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ImportError) as e:
            _extension.load_extension(build_info=build_info("2.11.0+cu128", "12.8"))
        assert f"rebuild it against this torch: in the checkout, `{REBUILD}` (CUDA kernels" in str(e.value)



def test_build_rule(setup_py):
    rule = setup_py.cuda_build_rule
    arch = {"TORCH_CUDA_ARCH_LIST": "9.0;10.0"}
    assert rule({}, "13.0", "/usr/local/cuda", 0) == (False, setup_py.NO_GPU_LINE)
    assert rule({"TORCH_CUDA_ARCH_LIST": ""}, "13.0", "/usr/local/cuda", 0)[0] is False
    assert rule(arch, "13.0", "/usr/local/cuda", 0) == (True, "TORCH_CUDA_ARCH_LIST=9.0;10.0")
    assert rule({}, "13.0", "/usr/local/cuda", 2) == (True, "2 visible GPU(s)")
    assert rule({**arch, "SDCP_NO_CUDA": "1"}, "13.0", "/usr/local/cuda", 2) == (False, "SDCP_NO_CUDA=1")
    assert rule(arch, None, "/usr/local/cuda", 2) == (False, "a CPU build of torch")
    assert rule(arch, "13.0", None, 2) == (False, "no CUDA toolkit (nvcc) found")
    line = setup_py.NO_GPU_LINE
    assert "building the CPU kernels only" in line and 'TORCH_CUDA_ARCH_LIST="9.0;10.0"' in line


def test_build_folder_per_torch_version_and_kind(setup_py):
    folder = setup_py.build_folder
    assert folder("cpu", "2.14.1+cu130") == folder("cpu", "2.14.1+cu130")  # that torch comes back: the same folder
    # The base Python's name (the suite may run in a venv: its folder has a suffix, checked below).
    base_name = os.path.basename(folder("cpu", "2.14.1+cu130", prefix="/usr", base_prefix="/usr"))
    assert base_name == f"{sys.implementation.cache_tag}-torch2.14.1+cu130-cpu"
    assert folder("cpu") == folder("cpu", str(torch.__version__), prefix=sys.prefix, base_prefix=sys.base_prefix)
    assert folder("cpu", "2.11.0+cu128") != folder("cpu", "2.14.1+cu130")
    assert folder("cuda", "2.14.1+cu130") != folder("cpu", "2.14.1+cu130")
    assert os.path.dirname(folder("cpu")) == os.path.join(ROOT, "build")
    # A virtual environment (its own include folder in the commands): its own folder, stable, one per venv.
    base = folder("cpu", "2.14.1+cu130", prefix="/usr", base_prefix="/usr")
    venv = folder("cpu", "2.14.1+cu130", prefix="/tmp/env", base_prefix="/usr")
    assert venv.startswith(base + "-venv")
    assert venv == folder("cpu", "2.14.1+cu130", prefix="/tmp/env", base_prefix="/usr")
    assert venv != folder("cpu", "2.14.1+cu130", prefix="/tmp/other", base_prefix="/usr")


def test_torch_headers_are_system_headers(setup_py):
    """Left out of the compiler's dependency lists, so a reinstalled torch (new mtimes) recompiles nothing."""
    from torch.utils import cpp_extension

    ext = cpp_extension.CppExtension("x._C", ["a.cpp"], include_dirs=["/mine"], extra_compile_args={"cxx": ["-O3"]})
    setup_py.torch_headers_as_system(ext)
    torch_dirs = cpp_extension.include_paths()
    assert ext.include_dirs == ["/mine"]
    assert ext.extra_compile_args["cxx"] == ["-O3"] + [f for d in torch_dirs for f in ("-isystem", d)]
    ext = cpp_extension.CppExtension("x._C", ["a.cpp"], extra_compile_args={"cxx": [], "nvcc": ["-O3"]})
    setup_py.torch_headers_as_system(ext)
    assert ext.extra_compile_args["nvcc"] == ["-O3"] + [f for d in torch_dirs for f in ("-isystem", d)] + ["-MMD"]


def test_build_ext_keeps_objects_per_torch(setup_py, monkeypatch):
    from setuptools import Distribution

    monkeypatch.setattr(setup_py, "want_cuda", lambda: False)
    cmd = setup_py.BuildExtension(Distribution({"name": "x", "ext_modules": []}))
    cmd.ensure_finalized()
    assert cmd.force  # torch's: ninja decides what is out of date, not setuptools' check of the sources alone
    assert cmd.build_temp == setup_py.build_folder("cpu")


def test_without_a_gpu_the_install_builds_the_cpu_kernels_and_says_so_once():
    """setup.py as the README's install runs it, with no GPU visible and no
    TORCH_CUDA_ARCH_LIST: it chooses the CPU kernels, and says so in the build
    alone (pip runs setup.py for the metadata too: `--name` says nothing)."""
    if torch.cuda.device_count() > 0:
        pytest.skip("a GPU is visible: the install builds the CUDA kernels for it")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "SDCP_NO_CUDA")}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--name"], capture_output=True, text=True,
                         env=env, timeout=300, start_new_session=True)  # no terminal for a line to go to
    assert res.returncode == 0 and res.stdout.strip() == "torch_sdcp", res.stdout + res.stderr
    assert "torch_sdcp:" not in res.stderr, res.stderr
    choose = ("import importlib.util as u; s = u.spec_from_file_location('s', 'setup.py'); m = u.module_from_spec(s); "
              "s.loader.exec_module(m); print(m.build_choice())")
    res = subprocess.run([sys.executable, "-c", choose], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300, start_new_session=True)
    assert res.returncode == 0, res.stderr
    if torch.version.cuda is not None:
        assert res.stdout.startswith("(False, 'torch_sdcp: no GPU visible") and "CPU kernels only" in res.stdout
    else:
        assert res.stdout.strip() == "(False, 'a CPU build of torch')", res.stdout


def test_build_lines_say_what_is_compiled_and_how_far(setup_py):
    start = setup_py.start_line(3, 12, "C++ only", "build/x-cpu")
    assert start.startswith("torch_sdcp: compiling 3 of 12 sources (C++ only) against torch "), start
    assert start.endswith("in build/x-cpu"), start
    assert setup_py.start_line(0, 12, "C++ only", "build/x-cpu") == (
        "torch_sdcp: nothing to compile: the 12 objects in build/x-cpu are up to date (linking only)")
    assert "compiling up to 12 sources" in setup_py.start_line(None, 12, "C++ only", "build/x-cpu")
    line = f"[2/3] c++ -MMD -MF build/a.o.d -c -c {ROOT}/csrc/checks.cpp -o build/checks.o -O3".encode()
    assert setup_py.step_line(line, time.monotonic() - 65) == "torch_sdcp: [2/3] csrc/checks.cpp (1:05)"
    assert setup_py.step_line(b"ninja: no work to do.", 0.0) is None


def test_ninja_run_reports_once_then_nothing_to_compile(setup_py, tmp_path, capfd):
    """torch's ninja run as the build wraps it, on a build.ninja of two steps,
    without a terminal: the start line and the last one on stderr (the steps
    are ninja's own lines on stdout); the second run compiles nothing, and
    says so."""
    if shutil.which("ninja") is None:
        pytest.skip("no ninja")
    for name in ("a", "b"):
        (tmp_path / f"{name}.cpp").write_text(name)
    (tmp_path / "build.ninja").write_text("rule cp\n  command = cp $in $out\n"
                                          f"build a.o: cp {tmp_path}/a.cpp\nbuild b.o: cp {tmp_path}/b.cpp\n")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(setup_py, "report", lambda line, terminal_only=False: None if terminal_only else
                   print(line, file=sys.stderr))
    try:
        setup_py.run_ninja_with_progress(str(tmp_path), True, "error", what="C++ only", total=2)
        first = capfd.readouterr()
        setup_py.run_ninja_with_progress(str(tmp_path), True, "error", what="C++ only", total=2)
        second = capfd.readouterr()
    finally:
        monkey.undo()
    lines = first.err.splitlines()
    assert len(lines) == 2 and "compiling 2 of 2 sources (C++ only)" in lines[0], first.err
    assert lines[1].startswith("torch_sdcp: compiled 2 sources in 0:0"), first.err
    assert "[2/2] cp " in first.out  # ninja's -v lines, on stdout as torch's run leaves them
    assert second.err.splitlines() == [f"torch_sdcp: nothing to compile: the 2 objects in "
                                       f"{os.path.relpath(tmp_path, ROOT)} are up to date (linking only)"]



def test_a_clone_folder_named_torch_sdcp_does_not_shadow_the_install(tmp_path):
    """`git clone` makes a folder torch_sdcp (no __init__.py); run from the folder
    above it, the installed package must still be the one imported, not that
    folder as an empty namespace package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    find = "import importlib.util as u; s = u.find_spec('torch_sdcp'); print(s.origin if s else None)"
    (tmp_path / "elsewhere").mkdir()
    res = subprocess.run([sys.executable, "-c", find], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                         text=True, timeout=120)
    installed = res.stdout.strip()
    ours = os.path.join(ROOT, "torch_sdcp", "__init__.py")
    if installed == "None" or os.path.realpath(installed) != os.path.realpath(ours):
        pytest.skip(f"the torch_sdcp installed is not this checkout's (found {installed}): `{REBUILD}` here first")
    (tmp_path / "torch_sdcp" / "docs").mkdir(parents=True)  # the clone, as the folder above it sees it
    res = subprocess.run([sys.executable, "-c", "import torch_sdcp; torch_sdcp.OutputLSEWorkspace; "
                          "print(torch_sdcp.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.realpath(res.stdout.strip()) == os.path.realpath(ours), res.stdout
