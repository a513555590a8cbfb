"""Helpers of the test files (fixtures live in conftest.py): the skip marker of
the GPU tests, the devices and workspace arguments of a test rank, and inputs
that several test files share."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from torch_sdcp.inputs import rope_cache  # importing torch_sdcp loads the extension that cuda_kernels_built asks


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


# World sizes of the tests whose ranks all share GPU 0 ("shared_gpu" in their
# names, `requires_gpus(1)`): the CUDA peer kernels and their failures at DCP4
# and DCP8 on a one-GPU machine. Every rank is a process with its own CUDA
# context (about 500 MB, several seconds to start): keep their cases few.
SHARED_GPU_WORLDS = (4, 8)


# Workspace arguments of the host backend.
HOST = {"backend": "host"}


def rank_workspace_args(rank: int, mode: str) -> dict:
    """A test rank's workspace arguments for `mode`: "host" (host backend),
    "cuda" (GPU `rank`) or "cuda_shared" (every rank on GPU 0, time-sliced:
    correct, slow). Makes that GPU the current device."""
    if mode == "host":
        return {"backend": "host"}
    index = 0 if mode == "cuda_shared" else rank
    torch.cuda.set_device(index)
    return {"device": torch.device("cuda", index), "backend": "cuda", "allow_shared_device": mode == "cuda_shared"}


def poisoned_partials(n: int, t: int, h: int, d: int, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                      gen: torch.Generator | None = None, lse_mean: float = 2.0):
    """Global partials [N, T, H, D] / [N, T, H] with every kind of empty shard
    (NaN, +inf and -inf LSE, each with a NaN payload that must never leak),
    a (row, head) whose shards are all empty, and one all empty as NaN."""
    g = gen if gen is not None else torch.Generator().manual_seed(seed)
    out = torch.randn(n, t, h, d, generator=g)
    lse = torch.randn(n, t, h, generator=g) * 3 + lse_mean
    u = torch.rand(n, t, h, generator=g)
    lse = torch.where(u < 0.1, math.nan, lse)
    lse = torch.where((u >= 0.1) & (u < 0.2), math.inf, lse)
    lse = torch.where((u >= 0.2) & (u < 0.3), -math.inf, lse)
    lse[:, 0, 0] = -math.inf  # every shard empty
    if h > 1:
        lse[:, -1, 1] = math.nan  # every shard empty, as NaN
    out = torch.where((u < 0.3)[..., None], math.nan, out)  # zero weight: never read
    return out.to(dtype).contiguous(), lse.contiguous()


def devices() -> list[str]:
    """Devices the local-kernel tests run on."""
    out = ["cpu"]
    if torch.cuda.is_available() and cuda_kernels_built():
        out.append("cuda")
    return out


def make_query(t, h, *, nope=512, rope=64, max_pos=4096, seed=0, cache_dtype=torch.float32, device="cpu"):
    """One rank's query inputs: ql_nope [t, h, nope] and q_pe [t, h, rope] bf16,
    positions [t] below max_pos, and the cos/sin cache [max_pos, rope]."""
    g = torch.Generator().manual_seed(seed)
    ql_nope = (torch.randn(t, h, nope, generator=g) * 3).to(torch.bfloat16)
    q_pe = (torch.randn(t, h, rope, generator=g) * 3).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    cache = rope_cache(max_pos, rope).to(cache_dtype)
    return [x.to(device) for x in (ql_nope, q_pe, positions, cache)]


# The failure tests of several files: one rank's inputs, the check that a
# workspace refuses calls after a failed one, and the check that a call fails
# (on the host backend and on CUDA alike).


def rank_partials(rows, seed, dtype=torch.bfloat16, heads=8, dim=64):
    """One rank's Output/LSE partials: out [rows, heads, dim] in dtype, lse [rows, heads] fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, dim, generator=g).to(dtype), torch.randn(rows, heads, generator=g)


def rank_candidates(rows, c, seed):
    """One rank's top-K candidates: scores [rows, c] fp32 and distinct int32 ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, c, generator=g), torch.randperm(rows * c, generator=g).view(rows, c).to(torch.int32)


def expect_poisoned(ws, call):
    """call() raises because an earlier call of ws failed and poisoned it."""
    with pytest.raises(RuntimeError, match=f"on rank {ws.rank} is poisoned: .*re-create the workspace"):
        call()


def expect_failure(ws, mode, call, match, *, within=30.0):
    """call() fails on this rank with `match` within `within` seconds and
    leaves ws poisoned: at once on the host backend (mode "host"), at the
    next check() on CUDA (the kernel records the failure and returns)."""
    t0 = time.monotonic()
    if mode != "host":
        call()
        torch.cuda.synchronize()  # the kernels end at once: nobody waits out the timeout
        with pytest.raises(RuntimeError, match=match):
            ws.check()
    else:
        with pytest.raises(RuntimeError, match=match):
            call()
    assert time.monotonic() - t0 < within
    expect_poisoned(ws, ws.check)  # check() asks the op too: a failed call of the raw op poisons as well
    assert ws.poisoned


def expect_raises(cls, fn, *args, **kwargs) -> str:
    """The message of the ``cls`` that ``fn(*args, **kwargs)`` raises (AssertionError if it raises none)."""
    try:
        fn(*args, **kwargs)
    except cls as e:
        return str(e)
    raise AssertionError(f"{fn} did not raise {cls.__name__}")


def stopped_wait(rank: int, stop: str, *, after_s: float = 0.3, timeout_s: float = 60.0) -> dict:
    """A worker step of two ranks: rank 0 calls combine() on a fresh host workspace whose peer never
    makes the call, and a thread stops its wait after ``after_s``: ``stop`` "abort" (ws.abort from
    the thread) or "sigint" (Ctrl-C: SIGINT to this process). Raises nothing of the wait's own: the
    caller asserts. Returns, on rank 0, what ended the wait (``raised``: the exception's type name, or
    None; ``message``), ``call_s`` (the call's seconds), ``after_stop_s`` (the seconds from the stop
    to the call's end) and ``poisoned``; on both ranks ``check``: what ws.check() then raised (None if
    nothing)."""
    import signal
    import threading

    import torch.distributed as dist

    import torch_sdcp

    if stop not in ("abort", "sigint"):
        raise ValueError(f"stop: expected 'abort' or 'sigint', got {stop!r}")
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.float32, backend="host", timeout_s=timeout_s)
    out: dict = {}
    if rank == 0:
        stopped: list[float] = []

        def act():
            stopped.append(time.monotonic())
            if stop == "abort":
                ws.abort("watchdog")
            else:
                os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(after_s, act)
        timer.start()
        start = time.monotonic()
        try:
            ws.combine(torch.zeros(2, 8, 64), torch.zeros(2, 8))
            out.update(raised=None, message="")
        except (RuntimeError, KeyboardInterrupt) as e:
            out.update(raised=type(e).__name__, message=str(e))
        end = time.monotonic()
        timer.join()
        out.update(call_s=end - start, after_stop_s=end - stopped[0], poisoned=ws.poisoned)
    dist.barrier()
    try:
        ws.check()
        out["check"] = None
    except RuntimeError as e:
        out["check"] = str(e)
    ws.close()
    ws.abort("after close")  # nothing once closed
    return out
