"""Build torch_sdcp._C: CPU kernels always; CUDA kernels when a CUDA build of
torch and a CUDA toolkit are present and there is something to build them for:
the architectures of TORCH_CUDA_ARCH_LIST when set, else those of the visible
GPUs. With neither (no GPU visible, TORCH_CUDA_ARCH_LIST unset) the build is
CPU-only and says in one line how to build CUDA kernels for other machines;
CI and wheel builds set TORCH_CUDA_ARCH_LIST. SDCP_NO_CUDA=1 always builds
CPU-only.

Objects are kept in build/ (ignored by git), one folder per torch build and
kind of build (CPU or CUDA), so that re-running the install on an unchanged
tree compiles nothing: an editable install would otherwise compile every
source again in a fresh temporary folder. torch's headers are system headers
(-isystem, and -MMD for nvcc too), so that ninja does not track them: a
reinstalled torch gives them new mtimes, which made every object of a kept
folder out of date. Beside the extension, torch_sdcp/_build_info.py records
the torch it was built against, which the package checks on import."""

import functools
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

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

import torch  # noqa: E402  (cpp_extension reads CUDA_HOME when imported)
from torch.utils import cpp_extension  # noqa: E402

CUDA_HEADERS_TORCH_NEEDS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h", "curand.h", "cufft.h")
# The architectures the hint of a CPU-only build names, and CI builds: Hopper and
# Blackwell data centre GPUs, the ones with the NVLink peer access the library is
# for (a 10.0 binary also runs on 10.3). Not 12.0: those GPUs lack the shared
# memory of the top-K kernel at k = 2048, and a third architecture makes every
# CUDA build half as long again.
CUDA_ARCHS_HINT = "9.0;10.0"
NO_GPU_LINE = ("torch_sdcp: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CPU kernels only (the host "
               "backend); to build the CUDA kernels for other machines, set their architectures, e.g. "
               f'TORCH_CUDA_ARCH_LIST="{CUDA_ARCHS_HINT}" (9.0: H100/H200, 10.0: B200)')
EXTENSION = "torch_sdcp._C"
# What the extension was built against, read by torch_sdcp/_extension.py before loading it.
BUILD_INFO = "_build_info.py"


def read_version() -> str:
    """The version from torch_sdcp/_version.py, without importing the package (it needs the extension)."""
    with open(os.path.join("torch_sdcp", "_version.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if m is None:
        raise RuntimeError("torch_sdcp/_version.py: expected a line __version__ = \"X.Y.Z\"")
    return m.group(1)


def cuda_build_rule(env, torch_cuda: str | None, cuda_home: str | None, visible_gpus: int) -> tuple:
    """(build the CUDA kernels?, why): the one rule, from the environment,
    torch's CUDA version, the toolkit found and the number of visible GPUs."""
    if env.get("SDCP_NO_CUDA", "0") == "1":
        return False, "SDCP_NO_CUDA=1"
    if torch_cuda is None:
        return False, "a CPU build of torch"
    if cuda_home is None:
        return False, "no CUDA toolkit (nvcc) found"
    if env.get("TORCH_CUDA_ARCH_LIST"):
        return True, f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']}"
    if visible_gpus > 0:
        return True, f"{visible_gpus} visible GPU(s)"
    return False, NO_GPU_LINE


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.version.cuda is not None else 0


@functools.cache
def build_choice() -> tuple:
    """The rule for this build, asked once (the GPU probe): (CUDA kernels?, why)."""
    return cuda_build_rule(os.environ, torch.version.cuda, cpp_extension.CUDA_HOME, visible_gpus())


def want_cuda() -> bool:
    return build_choice()[0]


def build_folder(kind: str, torch_version: str = str(torch.__version__), prefix: str = sys.prefix,
                 base_prefix: str = sys.base_prefix) -> str:
    """The objects' folder of one torch build and one kind ("cpu" or "cuda"): a
    torch that comes back finds its objects again; CPU and CUDA objects (other
    flags) never share a ninja log. A virtual environment gets its own folder:
    its compile commands name its own include folder (distutils adds
    ``sys.exec_prefix/include``), so sharing a ninja log with the base Python
    would recompile everything at each switch."""
    venv = "" if prefix == base_prefix else "-venv" + hashlib.sha256(prefix.encode()).hexdigest()[:8]
    return os.path.join(HERE, "build", f"{sys.implementation.cache_tag}-torch{torch_version}-{kind}{venv}")


def torch_headers_as_system(ext) -> None:
    """torch's include folders as -isystem rather than -I: the compilers'
    dependency lists (-MMD) then leave them out, so ninja decides on our own
    sources and headers, and a reinstall of the same torch (new mtimes, the same
    headers; the folder is per torch version) recompiles nothing. For nvcc,
    whose rule torch writes with -MD (every header), a later -MMD does the same."""
    torch_dirs = [d for d in ext.include_dirs if d in cpp_extension.include_paths()]
    ext.include_dirs = [d for d in ext.include_dirs if d not in torch_dirs]
    flags = [f for d in torch_dirs for f in ("-isystem", d)]
    for compiler in ext.extra_compile_args:
        extra = ["-MMD"] if compiler == "nvcc" else []
        ext.extra_compile_args[compiler] = ext.extra_compile_args[compiler] + flags + extra


def pip_cuda_roots() -> list:
    """The ``nvidia`` namespace folders of the CUDA packages pip installs beside torch."""
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations or []) if spec is not None else []


def headers_toolkit_lacks(toolkit_include: str, pip_roots: list) -> dict:
    """Every header in pip's ``nvidia/*/include`` folders that the toolkit's
    include folder lacks: path relative to the include folder -> file (the
    first package that has it wins)."""
    found: dict = {}
    for root in pip_roots:
        for inc in sorted(glob.glob(os.path.join(root, "*", "include"))):
            for dirpath, _, files in os.walk(inc):
                for name in files:
                    rel = os.path.relpath(os.path.join(dirpath, name), inc)
                    if rel not in found and not os.path.exists(os.path.join(toolkit_include, rel)):
                        found[rel] = os.path.join(dirpath, name)
    return found


def pip_cuda_include_dirs(toolkit_include: str | None = None, pip_roots: list | None = None,
                          overlay: str | None = None, needed: tuple = CUDA_HEADERS_TORCH_NEEDS) -> list:
    """Where torch's CUDA headers include a header the toolkit lacks (cuSPARSE,
    cuBLAS, ... come from pip beside torch): one folder of links to just the
    headers the toolkit lacks, so that pip's headers never shadow the
    toolkit's own (a newer pip ``crt/host_runtime.h`` breaks an older nvcc:
    ``macro "__cudaLaunch" passed 2 arguments``). [] when nothing is missing."""
    if toolkit_include is None:
        toolkit_include = os.path.join(cpp_extension.CUDA_HOME, "include")
    if not any(not os.path.exists(os.path.join(toolkit_include, h)) for h in needed):
        return []
    lacking = headers_toolkit_lacks(toolkit_include, pip_cuda_roots() if pip_roots is None else pip_roots)
    if not lacking:
        return []
    overlay = overlay or os.path.join(HERE, "build", "pip-cuda-include")
    shutil.rmtree(overlay, ignore_errors=True)
    for rel, path in lacking.items():
        link = os.path.join(overlay, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(path, link)
    return [overlay]


def sources(pattern: str) -> list:
    return sorted(glob.glob(os.path.join("csrc", pattern)))


def cuda_targets() -> str:
    """What nvcc will be asked to build, as torch turns the architectures into flags: sm_90, compute_100 (PTX)."""
    try:
        flags = cpp_extension._get_cuda_arch_flags()
    except Exception:  # a private helper of torch: if it changes, say what was asked for instead
        return os.environ.get("TORCH_CUDA_ARCH_LIST", "the visible GPUs")
    codes = {c for flag in flags for m in re.findall(r",code=\[?([\w,]+)\]?", flag) for c in m.split(",")}
    ordered = sorted(codes, key=lambda c: (int(re.sub(r"\D", "", c) or 0), c.startswith("compute_")))
    return ", ".join(c if c.startswith("sm_") else f"{c} (PTX)" for c in ordered)


def extension():
    # torch chooses the C++ standard its headers need (C++17 or C++20).
    cxx = ["-O3", "-ffp-contract=off"]
    if not want_cuda():
        ext = cpp_extension.CppExtension(EXTENSION, sources("*.cpp"), extra_compile_args={"cxx": cxx})
    else:
        nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
        ext = cpp_extension.CUDAExtension(
            EXTENSION,
            sources("*.cpp") + sources("*.cu"),
            include_dirs=pip_cuda_include_dirs(),
            extra_compile_args={"cxx": cxx + ["-DSDCP_WITH_CUDA"], "nvcc": nvcc + ["-DSDCP_WITH_CUDA"]},
        )
    torch_headers_as_system(ext)
    return ext


def describe_torch() -> str:
    return f"torch {torch.__version__} / " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA")


def report(line: str, terminal_only: bool = False) -> None:
    """pip keeps a build's output (stdout and stderr) to itself unless -v or the
    build fails: a line goes to the terminal when there is one (once, whatever
    pip's verbosity), else to stderr (shown with -v, in CI's log); with
    `terminal_only`, nowhere without a terminal (ninja's own lines carry it)."""
    if not sys.stderr.isatty():
        try:
            with open("/dev/tty", "w") as tty:
                # The first line below pip's status line; each later one over pip's spinner character.
                tty.write(("\r" if TERMINAL_LINES else "\n") + f"{line}\n")
            TERMINAL_LINES.append(line)
            return
        except OSError:  # no terminal (CI, a pipe)
            pass
    if not terminal_only or sys.stderr.isatty():
        print(line, file=sys.stderr, flush=True)


TERMINAL_LINES: list = []  # the lines this process wrote to the terminal
NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\] ")
SOURCE = re.compile(rb"(\S+\.(?:cpp|cu))(?=\s|$)")


def objects_out_of_date(build_directory: str) -> int | None:
    """How many objects ninja would compile in `build_directory` (a dry run:
    -n), or None when the dry run fails (the build then says less)."""
    try:
        out = subprocess.run(["ninja", "-n"], cwd=build_directory, capture_output=True, timeout=120,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.splitlines() if NINJA_STEP.match(line))


def start_line(stale: int | None, total: int, what: str, folder: str) -> str:
    """What the build is about to compile, and where, or that nothing needs it."""
    if stale == 0:
        return f"torch_sdcp: nothing to compile: the {total} objects in {folder} are up to date (linking only)"
    jobs = os.environ.get("MAX_JOBS") or "unset (ninja's default)"
    count = f"{stale} of {total}" if stale is not None else f"up to {total}"
    return (f"torch_sdcp: compiling {count} sources ({what}) against {describe_torch()}, "
            f"MAX_JOBS={jobs}, in {folder}")


def step_line(line: bytes, started: float) -> str | None:
    """A progress line for one of ninja's `[k/N] command` lines: the step, the
    source it compiled and the time since the compile started."""
    m = NINJA_STEP.match(line)
    if m is None:
        return None
    source = SOURCE.search(line)
    name = os.path.relpath(source.group(1).decode(), HERE) if source else "a step"
    elapsed = int(time.monotonic() - started)
    return f"torch_sdcp: [{int(m.group(1))}/{int(m.group(2))}] {name} ({elapsed // 60}:{elapsed % 60:02d})"


def run_ninja_with_progress(build_directory: str, verbose: bool, error_prefix: str, what: str = "",
                            total: int = 0) -> None:
    """torch's ninja run (the same command, its output on stdout as before),
    with one line before it (what is compiled, or that nothing is) and, on a
    terminal, one line per compiled source, so that the build shows how far it
    is without pip's -v."""
    stale = objects_out_of_date(build_directory)
    report(start_line(stale, total, what, os.path.relpath(build_directory, HERE)))
    command = ["ninja", "-v"]
    workers = getattr(cpp_extension, "_get_num_workers", lambda verbose: None)(verbose)  # MAX_JOBS, as torch reads it
    if workers is not None:
        command += ["-j", str(workers)]
    started, tail = time.monotonic(), []
    sys.stdout.flush()
    with subprocess.Popen(command, cwd=build_directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            os.write(1, line)  # fd 1, as torch writes it (setuptools may detach sys.stdout)
            tail = (tail + [line])[-200:]
            step = step_line(line, started)
            if step is not None:
                report(step, terminal_only=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{error_prefix}: {b''.join(tail).decode(errors='replace')}")
    if stale != 0:
        elapsed = int(time.monotonic() - started)
        count = "the sources" if stale is None else f"{stale} source{'s' if stale > 1 else ''}"
        report(f"torch_sdcp: compiled {count} in {elapsed // 60}:{elapsed % 60:02d}")


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build_ext with objects kept in build/, a progress line, and the
    torch the extension was built against written beside it."""

    def finalize_options(self) -> None:
        super().finalize_options()
        # A per-build folder, not pip's temporary one: ninja then finds its
        # objects again and recompiles only what changed.
        self.build_temp = build_folder("cuda" if want_cuda() else "cpu")

    def build_extensions(self) -> None:
        cuda, why = build_choice()
        if why == NO_GPU_LINE:  # said by the build alone: pip runs setup.py once more for the metadata
            report(NO_GPU_LINE)
        ext = self.extensions[0]
        what = f"CUDA for {cuda_targets()}" if cuda else "C++ only"
        # torch's ninja run, with the lines that say what is compiled and how far it is (torch looks the
        # function up when it calls it; were that to change, the build would run as before, silent).
        original = getattr(cpp_extension, "_run_ninja_build", None)
        if original is None or sys.platform == "win32":  # torch runs ninja otherwise there
            super().build_extensions()
            return
        cpp_extension._run_ninja_build = functools.partial(run_ninja_with_progress, what=what,
                                                           total=len(ext.sources))
        try:
            super().build_extensions()
        finally:
            cpp_extension._run_ninja_build = original

    def run(self) -> None:
        super().run()
        # Beside each copy of the extension: in build_lib, and in the source
        # tree for an in-place or editable build.
        folders = {os.path.dirname(os.path.join(self.build_lib, self.get_ext_filename(EXTENSION)))}
        if self.inplace:
            folders.add(os.path.join(HERE, "torch_sdcp"))
        for folder in folders:
            write_build_info(os.path.join(folder, BUILD_INFO))


def write_build_info(path: str) -> None:
    text = (f'"""What torch_sdcp._C was built against (written by setup.py; not in git)."""\n\n'
            f"TORCH_VERSION = {str(torch.__version__)!r}\n"
            f"CUDA_VERSION = {torch.version.cuda!r}\n"
            f"CUDA_TARGETS = {cuda_targets() if want_cuda() else None!r}  # None: no CUDA kernels\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# The extension works with the torch release it was compiled against only.
TORCH_REQUIREMENT = f"torch=={torch.__version__.split('+')[0]}"

# Run as a script (pip and setuptools run it so); imported, it only defines the helpers above (the tests).
if __name__ == "__main__":
    setup(
        name="torch_sdcp",
        version=read_version(),
        description="Shared-DCP: peer-addressable decode data paths for Decode Context Parallelism",
        packages=find_packages(include=["torch_sdcp", "torch_sdcp.*", "torch_sdcp_plugins", "torch_sdcp_settings"]),
        # The packages' root, named: an editable install then puts this folder on sys.path (a .pth file)
        # rather than adding an import hook behind every sys.path entry, which a folder named torch_sdcp
        # in the working directory (a clone, run from the folder above it) shadowed as a namespace package.
        package_dir={"": "."},
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension},
        python_requires=">=3.10",
        install_requires=[TORCH_REQUIREMENT, "cuda-bindings>=12.6"],  # and requirements.txt
        # The engines load these in every process: each imports nothing of torch_sdcp unless its setting
        # (SDCP_VLLM=1, SDCP_SGLANG=1) is on, and never raises (docs/VLLM.md, docs/SGLANG.md).
        entry_points={
            "vllm.general_plugins": ["torch_sdcp = torch_sdcp_plugins.vllm:register"],
            "sglang.srt.plugins": ["torch_sdcp = torch_sdcp_plugins.sglang:register"],
        },
    )
