"""How a one-GPU step is timed (``--one-gpu-method``): ``step`` (every virtual
rank's call on its own stream, forked and joined back), graph-per-rank
(``GraphPerRank``: each rank's steps in a CUDA graph of its own, replayed by
``RankGraphReplay``) and one-graph (``OneGraph``: the bench's Timer, every
rank's call a branch of one graph)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_sdcp.bench.timing import Timer

ONE_GRAPH_KS = (8, 1)
#: The head start before a graph-per-rank trial is a spin of this many cycles per
#: microsecond: at least the SM clock (an H200 runs up to 1,980 MHz), so it spins at
#: least as long as asked; its length on the GPU is measured.
SPIN_CYCLES_PER_US = 2000
MAX_HEAD_START_US = 50_000.0


def step(streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]]) -> list:
    """Every rank's call on its own stream, forked from the current stream and
    joined back (in a CUDA graph: N concurrent branches)."""
    current = torch.cuda.current_stream()
    results = []
    for stream, call in zip(streams, calls, strict=True):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            results.append(call())
    for stream in streams:
        current.wait_stream(stream)
    return results


def capture_rank_graphs(streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                        steps: int) -> list[torch.cuda.CUDAGraph]:
    """Rank r's ``steps`` calls captured in a graph of its own, on its own stream."""
    graphs = []
    for stream, call in zip(streams, calls, strict=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(steps):
                call()
        graphs.append(graph)
    return graphs


class RankGraphReplay:
    """One replay of every rank's graph: rank 0's on its own stream (the lead,
    which holds the timing events), every other rank's on its own, forked from
    the lead and joined back to it. N streams in all (a ninth, at N = 8, would
    be more than the default 8 hardware queues, CUDA_DEVICE_MAX_CONNECTIONS)."""

    def __init__(self, streams: Sequence[torch.cuda.Stream], graphs: Sequence[torch.cuda.CUDAGraph]):
        self.lead, self.others = streams[0], list(streams[1:])
        self.graphs = list(graphs)
        self.fork = torch.cuda.Event()
        self.joins = [torch.cuda.Event() for _ in self.others]

    def __call__(self) -> None:
        if self.others:
            self.fork.record(self.lead)
        with torch.cuda.stream(self.lead):
            self.graphs[0].replay()
        for stream, graph, join in zip(self.others, self.graphs[1:], self.joins, strict=True):
            stream.wait_event(self.fork)
            with torch.cuda.stream(stream):
                graph.replay()
            join.record(stream)
        for join in self.joins:
            self.lead.wait_event(join)


class GraphPerRank:
    """--one-gpu-method graph-per-rank: microseconds per step, ``steps`` steps
    per rank graph (RankGraphReplay), ``replays`` replays per trial, median
    over ``trials``. A trial starts with a spin on the lead stream (the head
    start: twice the host's time to launch a trial's replays, measured once
    before) so that the GPU runs the timed replays with every launch already
    queued; a trial whose launches took longer than its head start is counted
    (``host_late_trials``): its figure may include host time."""

    name = "graph-per-rank"

    def __init__(self, steps: int, replays: int, trials: int):
        self.steps, self.replays, self.trials = steps, replays, trials
        self.keys: tuple[str, ...] = (f"k{steps}",)

    def _launch(self, replay: RankGraphReplay) -> float:
        """Seconds the host takes to launch one trial's replays."""
        t0 = time.perf_counter()
        for _ in range(self.replays):
            replay()
        return time.perf_counter() - t0

    def measure(self, streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                after_first_replay: Callable[[], None], ks: tuple[int, ...] | None = None) -> dict:
        """``ks``: the one-graph method's figures (this method has one, its steps per graph)."""
        lead = streams[0]
        for _ in range(2):  # warm-up, eager (what capture must not do for the first time)
            step(streams, calls)
        torch.cuda.synchronize(lead.device)
        graphs = capture_rank_graphs(streams, calls, self.steps)
        replay = RankGraphReplay(streams, graphs)
        torch.cuda.synchronize(lead.device)
        replay()
        torch.cuda.synchronize(lead.device)
        after_first_replay()  # a wait that gave up is an error, not a figure
        head_start_us = min(2e6 * self._launch(replay) + 50.0, MAX_HEAD_START_US)
        torch.cuda.synchronize(lead.device)
        per_step, host_per_step, host_late = [], [], 0
        for _ in range(self.trials):
            spin, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(lead):
                spin.record()
                torch.cuda._sleep(int(head_start_us * SPIN_CYCLES_PER_US))
                start.record()
                host_s = self._launch(replay)
                end.record()
            end.synchronize()
            host_late += host_s * 1e6 > spin.elapsed_time(start) * 1e3
            per_step.append(start.elapsed_time(end) * 1e3 / (self.replays * self.steps))
            host_per_step.append(host_s * 1e6 / (self.replays * self.steps))
        return {self.keys[0]: statistics.median(per_step), "trials_us": per_step,
                "host_us_per_step": statistics.median(host_per_step), "head_start_us": head_start_us,
                "host_late_trials": host_late}


class OneGraph:
    """--one-gpu-method one-graph: the bench's Timer (k8 / k1, max over the
    one process, median over trials) over ``step``: every rank's call a branch
    of one CUDA graph."""

    name = "one-graph"
    keys = tuple(f"k{k}" for k in ONE_GRAPH_KS)

    def __init__(self, timer: Timer):
        self.timer = timer
        self.replays, self.trials = timer.replays, timer.trials

    def measure(self, streams: Sequence[torch.cuda.Stream], calls: Sequence[Callable[[], Any]],
                after_first_replay: Callable[[], None], ks: tuple[int, ...] | None = None) -> dict:
        """``ks``: the steps per graph to time (default ONE_GRAPH_KS; a path whose slot is the host's call
        parity takes (8,): one step per graph would replay a slot twice in a row)."""
        return self.timer.measure(lambda: step(streams, calls), ks or ONE_GRAPH_KS)


Method = GraphPerRank | OneGraph
