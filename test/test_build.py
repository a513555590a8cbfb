"""The check of torch_sdcp._extension: an extension built against another torch,
or one that does not load, is one ImportError naming both torches and the
command that rebuilds it."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

import torch_sdcp
from torch_sdcp import _extension

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
