"""Build torch_sdcp._C: CPU kernels always, CUDA kernels when a CUDA toolkit and
a CUDA build of torch are present (SDCP_NO_CUDA=1 turns them off).

CUDA architectures: TORCH_CUDA_ARCH_LIST when set, else Hopper and Blackwell
(9.0, 10.0, 12.0) as far as the toolkit's nvcc supports them."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess

from setuptools import find_packages, setup

# setuptools takes the paths given to setup() relative to the directory of
# setup.py (an sdist silently drops absolute ones): work from there, whatever
# the caller's working directory, and find every path from it.
HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)


def locate_cuda_home() -> None:
    """torch guesses CUDA_HOME from the folder above `nvcc`; when `nvcc` is a
    wrapper script elsewhere, ask the compiler driver where its toolkit is."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return
    m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.M)
    if m:
        os.environ["CUDA_HOME"] = os.path.realpath(m.group(1).strip())


locate_cuda_home()

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

CUDA_HEADERS_TORCH_NEEDS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h", "curand.h", "cufft.h")
DEFAULT_CUDA_ARCHS = ("9.0", "10.0", "12.0")  # Hopper, Blackwell data centre, Blackwell workstation


def want_cuda() -> bool:
    if os.environ.get("SDCP_NO_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def pip_cuda_include_dirs() -> list:
    """Include folders of the CUDA packages pip installs beside torch, for the
    headers torch's CUDA headers include that the toolkit may lack."""
    toolkit = os.path.join(cpp_extension.CUDA_HOME, "include")
    missing = [h for h in CUDA_HEADERS_TORCH_NEEDS if not os.path.exists(os.path.join(toolkit, h))]
    spec = importlib.util.find_spec("nvidia")
    if not missing or spec is None:
        return []
    dirs = []
    for root in spec.submodule_search_locations or []:
        for inc in sorted(glob.glob(os.path.join(root, "*", "include"))):
            if any(os.path.exists(os.path.join(inc, h)) for h in missing):
                dirs.append(inc)
    return dirs


def sources(pattern: str) -> list:
    return sorted(glob.glob(os.path.join("csrc", pattern)))


def default_cuda_arch_list() -> str:
    """DEFAULT_CUDA_ARCHS that the toolkit's nvcc lists (9.0 if it cannot say)."""
    try:
        out = subprocess.run([os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), "--list-gpu-arch"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    listed = set(re.findall(r"compute_(\d+)", out))
    return ";".join([a for a in DEFAULT_CUDA_ARCHS if a.replace(".", "") in listed] or ["9.0"])


def extension():
    # torch chooses the C++ standard its headers need (C++17 or C++20).
    cxx = ["-O3", "-ffp-contract=off"]
    if not want_cuda():
        return cpp_extension.CppExtension("torch_sdcp._C", sources("*.cpp"), extra_compile_args={"cxx": cxx})
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = default_cuda_arch_list()
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(
        "torch_sdcp._C",
        sources("*.cpp") + sources("*.cu"),
        include_dirs=pip_cuda_include_dirs(),
        extra_compile_args={"cxx": cxx + ["-DSDCP_WITH_CUDA"], "nvcc": nvcc + ["-DSDCP_WITH_CUDA"]},
    )


setup(
    name="torch_sdcp",
    version="0.1.0",
    description="Shared-DCP: peer-addressable decode data paths for Decode Context Parallelism",
    packages=find_packages(include=["torch_sdcp", "torch_sdcp.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "cuda-bindings>=12.6"],  # as requirements.txt
    # vLLM loads this in every process; it does nothing unless SDCP_VLLM=1 (docs/VLLM.md).
    entry_points={"vllm.general_plugins": ["torch_sdcp = torch_sdcp.integrations.vllm:register"]},
)
