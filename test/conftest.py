"""Shared fixtures (helpers that are not fixtures live in _helpers.py)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch.distributed as dist


def pytest_configure(config):
    from _dist import python_ctrl_c

    python_ctrl_c()


def pytest_collection_modifyitems(config, items):
    """Marks `gpu` every test that needs a GPU: skipped without one
    (_helpers.requires_gpus), or parametrised on a CUDA device or mode."""
    for item in items:
        skips = any("GPU" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        spec = getattr(item, "callspec", None)
        on_cuda = spec is not None and any(str(v).startswith("cuda") for v in spec.params.values())
        if skips or on_cuda:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def world1():
    """A one-rank gloo group in this process, so peer ops can run (N = 1)
    under opcheck, torch.compile and CUDA graphs without spawning."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def setup_py():
    """setup.py imported as a module (not __main__: it defines its helpers and runs no setup()),
    from the repository root, whatever the working directory."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    spec = importlib.util.spec_from_file_location("sdcp_setup_under_test", os.path.join(root, "setup.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        os.chdir(cwd)  # setup.py changes to its own folder
    return module


@pytest.fixture
def collect():
    """The records of the "vllm" logger (where the vLLM plugin logs), from INFO up
    (test_vllm_plugin.py has its own, over the "torch_sdcp" logger too)."""
    import logging

    from _engine_stand_in import Collect

    handler = Collect()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def fake_driver(monkeypatch):
    """Installs a stand-in CUDA driver (_fake_cuda_driver.FakeDriver, its
    arguments the fixture's) under torch_sdcp.bench.virtual_ranks; returns it."""
    from _fake_cuda_driver import FakeDriver

    from torch_sdcp.bench import virtual_ranks

    def install(**kw):
        driver = FakeDriver(**kw)
        monkeypatch.setattr(virtual_ranks, "cu", driver)
        return driver
    return install
