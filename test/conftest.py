"""Shared fixtures and skip markers."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import torch_sdcp  # noqa: F401  (loads the extension)


def cuda_kernels_built() -> bool:
    """True when the extension has CUDA kernels registered."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("sdcp::lse_combine", "CUDA")


# World size of the boundary GPU tests: 2 by default, 4 or 8 on machines with
# that many GPUs (tools/gpu_suite.sh with SDCP_GPU_WORLD=4 or 8).
GPU_WORLD = int(os.environ.get("SDCP_GPU_WORLD", "2"))


def requires_gpus(n: int):
    """Skip unless n CUDA devices are visible and the CUDA kernels are built."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n or not cuda_kernels_built(),
                              reason=f"needs {n} GPU(s) and the CUDA kernels (found {count} GPU(s))")


def devices() -> list[str]:
    """Devices the local-kernel tests run on."""
    out = ["cpu"]
    if torch.cuda.is_available() and cuda_kernels_built():
        out.append("cuda")
    return out


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
