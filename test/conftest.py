"""Shared fixtures (helpers that are not fixtures live in _helpers.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist


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
