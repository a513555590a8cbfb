"""torch_sdcp's competitors on N virtual ranks in one process on one GPU
(``--one-gpu N``, bench/one_gpu.py), beside torch_sdcp's own cells: the
engines' peer-memory paths, reproduced in torch_sdcp.competitors (their
module docstrings say where each differs from the original), run by the same
method and checked the same way.

Each competitor's symmetric buffers (the same layout in every rank's own
allocation) lie in VirtualRegions (bench/virtual_ranks.py): rank r's buffers
are views of its own region seen through its own range, and a peer's are
found, as the competitor modules find them through torch symmetric memory,
at a fixed element offset from the own one (``element_offsets``). One rank's
call runs the competitor module's own per-call function on those buffers:

- vllm_a2a (Output/LSE): ``vllm_a2a.a2a_call`` (epoch, Triton dispatch,
  signal round, Triton combine); the signal round, torch symmetric memory's
  host-driven barrier in the multi-process bench, is competitors/_signal.py's
  device round (one release flag per peer, bounded acquire spins);
- flashinfer (Output/LSE): ``flashinfer_combine.fi_launch`` (one persistent
  kernel), its grid sized for 2 blocks per SM of the SMs the run sizes grids
  for (``--one-gpu-slice``), so that the N grids are resident together;
- vllm_direct (top-K): ``vllm_direct_topk.direct_call`` (pack, push,
  publish-and-wait, select); a wait that gives up raises a status word the
  bench checks instead of trapping (the ranks share one CUDA context).

Every spin is bounded by the run's timeout at an assumed
``SPINS_PER_SECOND`` polls a second; a round that gives up is an error in the
cell, never a figure. ``sequential`` runs the same kernels for N ranks one
after another, in the order the Triton interpreter needs (the CPU tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from torch_sdcp.bench.one_gpu_boundaries import Boundary, CheckFailed, OutputLSE
from torch_sdcp.bench.virtual_ranks import VirtualRegions

#: Polls of a peer's flag a spin is assumed to make per second (system-scope
#: atomics on HBM): the spin limit is the run's timeout at this rate.
SPINS_PER_SECOND = 1_000_000
ALIGN = 256

TensorAt = Callable[[int, int], Tensor]


class _CudaBytes:
    """``nbytes`` bytes of device memory at ``address`` (the CUDA array interface: torch.as_tensor makes a view)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def cuda_bytes(address: int, nbytes: int) -> Tensor:
    """A uint8 CUDA tensor over ``nbytes`` bytes at ``address`` (no copy, not owned)."""
    return torch.as_tensor(_CudaBytes(address, nbytes), device="cuda")


def _dims(boundary: Boundary, world: int) -> tuple[int, int]:
    """(heads per rank, values per head) of an Output/LSE boundary."""
    return boundary.geo.heads // world, cast(OutputLSE, boundary).head_dim


def spin_limit(timeout_s: float) -> int:
    return max(1000, int(timeout_s * SPINS_PER_SECOND))


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of buffers of ``sizes`` one after another (each ALIGN-aligned), and the total."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // ALIGN) * ALIGN
    return offsets, at


class CompetitorRanks:
    """One competitor's buffers for ``world`` virtual ranks over ``memory``
    (VirtualRegions of at least ``region_bytes``), sized for ``rows`` rows of
    ``boundary``. ``device``: where the local tensors (epochs, status words)
    live (the memory's device; CPU in the tests); ``tensor_at(address,
    nbytes)``: a uint8 tensor over memory (``cuda_bytes`` on a GPU)."""

    name: str
    #: What each virtual rank runs (the table's legend).
    runs: str
    #: The boundaries it runs at.
    boundaries: tuple[str, ...]
    #: Blocks of its waiting grid one SM is assumed to hold.
    blocks_per_sm = 1
    #: Whether its waiting kernel launches programmatically (PDL) where torch_sdcp's do.
    pdl = False
    #: Whether a CUDA graph must hold an even number of its calls (a slot chosen by the host's call parity).
    even_calls = False

    def __init__(self, boundary: Boundary, rows: int, world: int, memory: VirtualRegions, spins: int,
                 grid_sms: int, device: torch.device | None = None, tensor_at: TensorAt | None = None):
        self.boundary, self.rows, self.world, self.memory, self.spins = boundary, rows, world, memory, spins
        self.grid_sms = grid_sms
        self.device = device or memory.device
        self.tensor_at = tensor_at or cuda_bytes
        self.offsets, total = _layout(self.buffer_bytes(boundary, rows, world))
        if total > memory.stride:
            raise ValueError(f"{self.name}: argument 'memory': expected regions of at least {total} bytes, "
                             f"got {memory.stride}")
        self.setup()

    @classmethod
    def buffer_bytes(cls, boundary: Boundary, rows: int, world: int) -> list[int]:
        """The bytes of each symmetric buffer of one rank, in order."""
        raise NotImplementedError

    @classmethod
    def region_bytes(cls, boundary: Boundary, rows: int, world: int) -> int:
        return _layout(cls.buffer_bytes(boundary, rows, world))[1]

    def buffer(self, rank: int, index: int, dtype: torch.dtype, shape: Sequence[int], owner: int | None = None
               ) -> Tensor:
        """Buffer ``index`` of rank ``owner`` (default ``rank``) seen through rank ``rank``'s range."""
        nbytes = self.buffer_bytes(self.boundary, self.rows, self.world)[index]
        address = self.memory.region(rank, rank if owner is None else owner) + self.offsets[index]
        return self.tensor_at(address, nbytes).view(dtype).view(*shape)

    def peer_offsets(self, rank: int, index: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
        """int64 [N] element offsets of every rank's buffer ``index`` from rank ``rank``'s (its range)."""
        from torch_sdcp.competitors._symm import element_offsets

        peers = [self.buffer(rank, index, dtype, shape, owner=p) for p in range(self.world)]
        return element_offsets(peers, peers[rank], self.device)

    def setup(self) -> None:
        raise NotImplementedError

    @classmethod
    def grid(cls, boundary: Boundary, rows: int, world: int, sms: int) -> int:
        """Blocks of one rank's waiting grid at ``boundary`` (the grid that must be resident beside its
        peers'; the others wait for none), its grid sized for ``sms`` SMs."""
        return 1

    def call(self, rank: int, inputs: tuple) -> Any:
        """Rank ``rank``'s call, the competitor module's own per-call function."""
        raise NotImplementedError

    def sequential(self, inputs: Sequence[tuple]) -> list:
        """Every rank's call with the same kernels, one rank after another (the interpreter's order)."""
        raise NotImplementedError

    def health(self) -> None:
        """Raise a RuntimeError if a rank's wait gave up (synchronizes)."""
        raise NotImplementedError

    def check(self, results: Sequence[Any], inputs: Sequence[tuple], rows: int, world: int) -> None:
        try:
            self.boundary.check(results, inputs, rows, world)
        except CheckFailed as e:
            raise CheckFailed(f"{self.name}: {e}") from None


class VllmA2ARanks(CompetitorRanks):
    name, boundaries = "vllm_a2a", ("output_lse", "output_lse_up")
    runs = ("vllm_a2a.a2a_call: device epoch, a Triton dispatch kernel into every rank's slot epoch % 2, a signal "
            "round (here a device kernel: one release flag per peer, bounded acquire spins, vLLM's structure; "
            "the multi-process bench runs torch symmetric memory's barrier), a Triton combine kernel (fp32)")

    @classmethod
    def buffer_bytes(cls, boundary, rows, world):
        hl, d = _dims(boundary, world)
        return [2 * world * rows * hl * d * 2, 2 * world * rows * hl * 4, world * 8]

    def setup(self):
        n, (hl, d) = self.world, _dims(self.boundary, self.world)
        shapes = [(2, n, self.rows, hl, d), (2, n, self.rows, hl), (n,)]
        dtypes = [torch.bfloat16, torch.float32, torch.int64]
        self.inbox, self.inbox_lse, self.flags = ([self.buffer(r, i, dtypes[i], shapes[i]) for r in range(n)]
                                                  for i in range(3))
        self.out_offs, self.lse_offs, self.flag_offs = ([self.peer_offsets(r, i, dtypes[i], shapes[i])
                                                         for r in range(n)] for i in range(3))
        self.epoch = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(n)]
        self.status = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(n)]

    def _signal(self, rank: int, phase: str = "round") -> None:
        from torch_sdcp.competitors._signal import signal_round

        signal_round(self.flags[rank], self.flag_offs[rank], self.epoch[rank], self.status[rank], rank, self.spins,
                     phase)

    def call(self, rank, inputs):
        from torch_sdcp.competitors.vllm_a2a import a2a_call

        po, pl = inputs
        return a2a_call(po, pl, self.inbox[rank], self.inbox_lse[rank], self.out_offs[rank], self.lse_offs[rank],
                        self.epoch[rank], rank, functools.partial(self._signal, rank))

    def sequential(self, inputs):
        from torch_sdcp.competitors.vllm_a2a import a2a_combine, a2a_dispatch

        for r, (po, pl) in enumerate(inputs):  # what a2a_call runs, split where a rank waits for its peers
            self.epoch[r].add_(1)
            a2a_dispatch(po.contiguous(), pl.contiguous(), self.inbox[r], self.inbox_lse[r], self.out_offs[r],
                         self.lse_offs[r], self.epoch[r], r)
            self._signal(r, "publish")
        results = []
        for r, (po, _) in enumerate(inputs):
            self._signal(r, "wait")
            results.append(a2a_combine(self.inbox[r], self.inbox_lse[r], self.epoch[r], po.size(0), False))
        return results

    def health(self):
        from torch_sdcp.competitors._signal import check_status

        for r, status in enumerate(self.status):
            check_status(status, r, "vLLM a2a")


class FlashInferRanks(CompetitorRanks):
    name, boundaries = "flashinfer", ("output_lse", "output_lse_up")
    runs = ("flashinfer_combine.fi_launch: one persistent Triton kernel (device epoch, puts into every rank's slot "
            "epoch % 2, a release flag per peer, bounded acquire waits, grid barriers, the merge in fp32); its "
            "grid of at most 2 blocks per SM of the SMs grids are sized for (--one-gpu-slice), so that the N "
            "grids are resident together")
    blocks_per_sm = 2  # flashinfer_combine.SAFE_BLOCKS_PER_SM: any kernel of 4 warps

    @classmethod
    def buffer_bytes(cls, boundary, rows, world):
        from torch_sdcp.competitors.flashinfer_combine import workspace_bytes

        hl, d = _dims(boundary, world)
        return [workspace_bytes(rows * hl, world, d, torch.bfloat16)]

    def setup(self):
        from torch_sdcp.competitors.flashinfer_combine import SYNC_WORDS, workspace_views

        n, (hl, d) = self.world, _dims(self.boundary, self.world)
        nbytes = self.buffer_bytes(self.boundary, self.rows, n)[0]
        self.views = [workspace_views(self.buffer(r, 0, torch.uint8, (nbytes,)), n, self.rows * hl, d,
                                      torch.bfloat16) for r in range(n)]
        self.peer_bytes = [self.peer_offsets(r, 0, torch.uint8, (nbytes,)) for r in range(n)]
        self.sync = [torch.zeros(SYNC_WORDS, dtype=torch.int32, device=self.device) for _ in range(n)]

    def grid_cap(self) -> int:
        from torch_sdcp.competitors.flashinfer_combine import SAFE_BLOCKS_PER_SM

        return SAFE_BLOCKS_PER_SM * self.grid_sms

    @classmethod
    def grid(cls, boundary, rows, world, sms):  # fi_launch's grid at grid_cap()
        from torch_sdcp.competitors.flashinfer_combine import SAFE_BLOCKS_PER_SM

        return max(1, min(max(rows * (boundary.geo.heads // world), world), SAFE_BLOCKS_PER_SM * sms))

    def _launch(self, rank: int, inputs: tuple, phase: str, grid_cap: int) -> tuple:
        from torch_sdcp.competitors.flashinfer_combine import fi_launch

        po, pl = inputs
        out, lse, _ = fi_launch(po, pl, self.views[rank], self.peer_bytes[rank], self.sync[rank], rank, False,
                                grid_cap, phase, self.spins)
        return out, lse

    def call(self, rank, inputs):
        return self._launch(rank, inputs, "fused", self.grid_cap())

    def sequential(self, inputs):
        if self.world == 1:  # no peer to wait for: the fused launch, on one program (its barrier has no peer)
            return [self._launch(0, inputs[0], "fused", 1)]
        for r, x in enumerate(inputs):
            self._launch(r, x, "put", self.grid_cap())
        return [self._launch(r, x, "merge", self.grid_cap()) for r, x in enumerate(inputs)]

    def health(self):
        from torch_sdcp.competitors.flashinfer_combine import check_status

        for r, sync in enumerate(self.sync):
            check_status(sync, r)


class VllmDirectRanks(CompetitorRanks):
    name, boundaries = "vllm_direct", ("topk",)
    runs = ("vllm_direct_topk.direct_call: pack, a Triton push into every rank's slot (the host's call parity), "
            "the publish-and-wait kernel (release add, bounded acquire spins; a wait that gives up raises a status "
            "word the bench checks, where vLLM traps), sdcp::topk_select; checked against vLLM's own selection "
            "(direct_topk_spec); an even number of calls per graph")
    pdl = True  # vllm_direct_topk launches its push and publish kernels with PDL on SM90+
    even_calls = True

    @classmethod
    def buffer_bytes(cls, boundary, rows, world):
        c = boundary.geo.k
        return [2 * 2 * rows * world * c * 4, 16]

    def setup(self):
        n, c = self.world, self.boundary.geo.k
        shape = (2, 2, self.rows, n, c)
        self.inbox = [self.buffer(r, 0, torch.float32, shape) for r in range(n)]
        self.inbox_offs = [self.peer_offsets(r, 0, torch.float32, shape) for r in range(n)]
        self.signal = [self.buffer(r, 1, torch.int64, (2,)) for r in range(n)]
        self.signal_offs = [self.peer_offsets(r, 1, torch.int64, (2,)) for r in range(n)]
        self.packed = [torch.empty(2 * self.rows * c, dtype=torch.float32, device=self.device) for _ in range(n)]
        self.status = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(n)]
        self.calls = [0] * n

    def _slot(self, rank: int) -> int:
        slot = self.calls[rank] & 1
        self.calls[rank] += 1
        return slot

    def call(self, rank, inputs):
        from torch_sdcp.competitors.vllm_direct_topk import direct_call

        scores, ids = inputs
        return direct_call(scores, ids, self.packed[rank], self.inbox[rank], self.inbox_offs[rank],
                           self.signal[rank][:1], self.signal_offs[rank], self.status[rank], self._slot(rank), rank,
                           self.boundary.geo.k, max_spins=self.spins, trap=False)

    def sequential(self, inputs):
        from torch_sdcp.competitors import vllm_direct_topk as vd

        slots = [self._slot(r) for r in range(self.world)]
        for r, (scores, ids) in enumerate(inputs):
            vd.pack_candidates(scores.contiguous(), ids.contiguous(), self.packed[r])
            vd.push_candidates(self.packed[r], self.inbox[r], self.inbox_offs[r], slots[r], r, scores.size(0))
        epoch = int(self.signal[0][0])
        for r in range(self.world):  # publish and wait is one kernel: its peers' epochs pre-set, as if published
            for p in range(self.world):
                self.signal[p][0] = epoch + 1 if p != r else epoch
            vd.publish_and_wait(self.signal[r][:1], self.signal_offs[r], self.status[r], self.spins, trap=False)
        return [vd.select_from_inbox(self.inbox[r], slots[r], x[0].size(0), self.boundary.geo.k)
                for r, x in enumerate(inputs)]

    def health(self):
        for r, status in enumerate(self.status):
            if int(status[0]):
                raise RuntimeError(f"vLLM direct: rank {r} gave up waiting for a peer's publish after its spin "
                                   "limit (on one GPU: the ranks' grids were not all resident)")

    def check(self, results, inputs, rows, world):
        from torch_sdcp.competitors.vllm_direct_topk import direct_topk_spec

        want = direct_topk_spec(torch.cat([s.cpu() for s, _ in inputs], dim=1),
                                torch.cat([i.cpu() for _, i in inputs], dim=1), self.boundary.geo.k)
        for r, got in enumerate(results):
            if not torch.equal(got.cpu(), want):
                bad = int((got.cpu() != want).sum())
                raise CheckFailed(f"{self.name}: topk, world {world}, rows {rows}: rank {r}: {bad} of "
                                  f"{want.numel()} ids differ from vLLM's selection (direct_topk_spec)")


class WaitingGrid:
    """Competitor ``cls``'s waiting grid at ``boundary``, for one_gpu.residency."""

    def __init__(self, cls: type[CompetitorRanks], boundary: Boundary):
        self.cls, self.boundary = cls, boundary

    def grid(self, rows: int, world: int, sms: int) -> int:
        return self.cls.grid(self.boundary, rows, world, sms)


COMPETITORS: dict[str, type[CompetitorRanks]] = {c.name: c for c in (VllmA2ARanks, FlashInferRanks, VllmDirectRanks)}


def competitors_of(boundary: str) -> list[type[CompetitorRanks]]:
    return [c for c in COMPETITORS.values() if boundary in c.boundaries]


@contextlib.contextmanager
def open_ranks(cls: type[CompetitorRanks], boundary: Boundary, rows: int, world: int, timeout_s: float,
               grid_sms: int) -> Iterator[CompetitorRanks]:
    """``cls``'s buffers for ``world`` virtual ranks on the boundary's device, released after."""
    with VirtualRegions(cls.region_bytes(boundary, rows, world), world, boundary.device) as memory:
        ranks = cls(boundary, rows, world, memory, spin_limit(timeout_s), grid_sms)
        try:
            yield ranks
        finally:
            torch.cuda.synchronize(boundary.device)  # nothing in flight on the memory about to go


def run_competitor_cell(cls: type[CompetitorRanks], boundary: Boundary, rows: int, world: int, method,
                        timeout_s: float, grid_sms: int) -> dict:
    """As one_gpu.run_cell, for competitor ``cls``: check one step, then time it."""
    from torch_sdcp.bench.one_gpu_timing import GraphPerRank, step

    if cls.even_calls and isinstance(method, GraphPerRank) and method.steps % 2:
        return {"skipped": f"{method.steps} steps per rank graph: an odd number replays a slot twice in a row "
                           "(the slot is the host's call parity; --one-gpu-steps even)"}
    device = boundary.device
    with open_ranks(cls, boundary, rows, world, timeout_s, grid_sms) as ranks:
        streams = [torch.cuda.Stream(device) for _ in range(world)]
        inputs = [boundary.check_inputs(rows, r, world) for r in range(world)]
        torch.cuda.synchronize(device)
        results = step(streams, [functools.partial(ranks.call, r, x) for r, x in enumerate(inputs)])
        torch.cuda.synchronize(device)
        ranks.health()  # a wait that gave up is not a mismatch
        ranks.check(results, inputs, rows, world)
        del results, inputs
        timed = [boundary.timed_inputs(rows, r, world) for r in range(world)]
        calls = [functools.partial(ranks.call, r, x) for r, x in enumerate(timed)]
        torch.cuda.synchronize(device)
        ks = {"ks": (8,)} if cls.even_calls else {}
        cell: dict = {"check": "ok", **method.measure(streams, calls, ranks.health, **ks)}
        torch.cuda.synchronize(device)
        ranks.health()  # a wait that gave up in the timed replays would read as a fast figure
    return cell
