"""Timing of the benchmark: per-call microseconds of a path, max over ranks,
median over trials; a path that cannot run here says why."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


class Timer:
    """Per-call microseconds of `fn`, max over ranks, median over trials."""

    def __init__(self, device: torch.device, replays: int, trials: int):
        self.device, self.replays, self.trials = device, replays, trials

    def _trials_cuda(self, fn: Callable[[], object], calls: int) -> list[float]:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on the capture stream
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(self.trials):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.replays):
                graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3 / (self.replays * calls))
        return out

    def _trials_host(self, fn: Callable[[], object], calls: int) -> list[float]:
        fn()
        out = []
        for _ in range(self.trials):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(self.replays):
                for _ in range(calls):
                    fn()
            out.append((time.perf_counter() - t0) * 1e6 / (self.replays * calls))
        return out

    def per_call_us(self, fn: Callable[[], object], calls: int) -> float:
        run = self._trials_cuda if self.device.type == "cuda" else self._trials_host
        mine = run(fn, calls)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return statistics.median(max(r[i] for r in every) for i in range(len(mine)))

    def measure(self, fn: Callable[[], object], ks=(8, 1)) -> dict:
        return {f"k{k}": self.per_call_us(fn, k) for k in ks}


def guarded(timer: Timer, fn_factory: Callable[[], Callable[[], object]], ks=(8, 1)) -> dict:
    """A path that cannot run here says why instead of failing the run. Every
    rank agrees on the verdict, so no rank is left waiting in a collective."""
    try:
        fn, err = fn_factory(), None
    except Exception as e:
        fn, err = None, f"{type(e).__name__}: {e}".splitlines()[0][:160]
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    first = next((e for e in errs if e), None)
    if first or fn is None:
        return {"error": first}
    return timer.measure(fn, ks)
