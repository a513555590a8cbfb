"""Loading of the compiled extension, torch_sdcp._C, with the check that it
was built against the torch that runs.

A C++ extension works only with the torch build it was compiled against (its
C++ ABI, its libc10_cuda.so). Loaded beside another torch it fails with an
unexplained missing library or undefined symbol, or loads and misbehaves; so
setup.py records the torch of the build (torch_sdcp/_build_info.py) and a
mismatch or a failed load is one ImportError that names both and the fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

EXTENSION = "torch_sdcp._C"
BUILD_INFO = "torch_sdcp._build_info"
INSTALL = "pip install --no-build-isolation --no-deps -e ."
CUDA_ARCHS_HINT = "9.0;10.0"  # setup.py's CUDA_ARCHS_HINT


def how_to_build_for(torch_cuda: str | None, visible_gpus: int) -> str:
    """The rebuild command for a machine: with a GPU, the install builds the CUDA
    kernels for it; without one (or with a CPU build of torch), the CPU kernels,
    said explicitly, and how to add CUDA kernels for other GPUs."""
    if torch_cuda and visible_gpus > 0:
        how = f"in the checkout, `{INSTALL}` (CUDA kernels for the visible GPUs)"
    else:
        how = f"in the checkout, `SDCP_NO_CUDA=1 {INSTALL}` (CPU kernels and the host backend"
        how += (f"; CUDA kernels for other machines: `TORCH_CUDA_ARCH_LIST=\"{CUDA_ARCHS_HINT}\" {INSTALL}`)"
                if torch_cuda else ": this torch has no CUDA)")
    return how + "; for a wheel, build the wheel again against this torch"


def how_to_build() -> str:
    """The rebuild command for the machine this runs on (asked only when an error is raised)."""
    return how_to_build_for(torch.version.cuda, torch.cuda.device_count() if torch.version.cuda else 0)


def describe(torch_version: str, cuda_version: str | None) -> str:
    return f"torch {torch_version} / " + (f"CUDA {cuda_version}" if cuda_version else "no CUDA")


def running_torch() -> tuple[str, str | None]:
    return str(torch.__version__), torch.version.cuda


def built_torch(build_info: str = BUILD_INFO) -> tuple[str, str | None] | None:
    """(torch version, CUDA version) the extension was built against, or None
    for a build that did not record them."""
    try:
        info = importlib.import_module(build_info)
    except ImportError:
        return None
    return str(info.TORCH_VERSION), info.CUDA_VERSION


def load_extension(extension: str = EXTENSION, build_info: str = BUILD_INFO) -> ModuleType:
    """Import the extension (which registers every torch.ops.sdcp operator),
    or raise ImportError naming the torch it was built against, the torch
    that runs, and the command that rebuilds it."""
    built, running = built_torch(build_info), running_torch()
    if built is not None and built != running:
        raise ImportError(f"torch_sdcp: the extension {extension} was built against {describe(*built)}, "
                          f"but this is {describe(*running)}: rebuild it against this torch: {how_to_build()}")
    try:
        return importlib.import_module(extension)
    except ModuleNotFoundError as e:
        if e.name != extension:
            raise
        raise ImportError(f"torch_sdcp: the extension {extension} is not built (this is {describe(*running)}): "
                          f"build it: {how_to_build()}") from e
    except ImportError as e:
        was = describe(*built) if built is not None else "a torch it did not record"
        raise ImportError(f"torch_sdcp: cannot load the extension {extension} ({e}); it was built against {was}, "
                          f"this is {describe(*running)}: rebuild it against this torch: {how_to_build()}") from e


_C = load_extension()
