"""Build torch_sdcp._C: CPU kernels always, CUDA kernels when a CUDA toolkit and
a CUDA build of torch are present (SDCP_NO_CUDA=1 turns them off)."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess

from setuptools import find_packages, setup


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

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_HEADERS_TORCH_NEEDS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h", "curand.h", "cufft.h")


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


def extension():
    # torch chooses the C++ standard its headers need (C++17 or C++20).
    cxx = ["-O3", "-ffp-contract=off"]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not want_cuda():
        return cpp_extension.CppExtension("torch_sdcp._C", sources, extra_compile_args={"cxx": cxx})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(
        "torch_sdcp._C",
        sources + sorted(glob.glob(os.path.join("csrc", "*.cu"))),
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
    install_requires=["torch", "cuda-python"],
    # vLLM loads this in every process; it does nothing unless SDCP_VLLM=1 (docs/VLLM.md).
    entry_points={"vllm.general_plugins": ["torch_sdcp = torch_sdcp.integrations.vllm:register"]},
)
