"""Aborts found on the host that reach a CUDA peer through its kernel (two
ranks sharing GPU 0; docs/PROTOCOL.md "Failure behaviour"). On CUDA a peer's
abort word lands in device memory: the peer learns of it when a kernel of
its next call (or the one waiting) meets it, and its host raises at
``check()`` once that kernel completed, naming the aborting rank and its note.

- a call from a second stream while the first still runs one: refused on
  that rank, which aborts the workspace on every rank;
- a workspace dropped without ``close()`` (garbage-collected) while the peer
  waits in a call: the peer's kernel gives up at once, naming "left".
"""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_workers
from _helpers import rank_workspace_args, requires_gpus

pytestmark = [pytest.mark.gpu, requires_gpus(1)]


def _paired(rank):
    """A workspace on GPU 0 and this rank's inputs, after one call that paired."""
    import torch_sdcp

    where = rank_workspace_args(rank, "cuda_shared")
    ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 128, timeout_s=60, **where)
    g = torch.Generator().manual_seed(rank)
    out = torch.randn(4, 8, 128, generator=g).to(where["device"], torch.bfloat16)
    lse = torch.randn(4, 8, generator=g).to(where["device"])
    ws.combine(out, lse)
    torch.cuda.synchronize()
    return ws, out, lse


def _second_stream_worker(rank, world):
    import torch.distributed as dist

    ws, out, lse = _paired(rank)
    if rank == 0:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the side stream still runs the next call when the third comes
            ws.combine(out, lse)
        with pytest.raises(RuntimeError, match="still runs an earlier call on it.*aborted on every rank"):
            ws.combine(out, lse)
        side.synchronize()
        assert ws.poisoned
        dist.barrier()
        dist.barrier()  # the peer has read this rank's note
        ws.close()
        return 0.0
    t0 = time.monotonic()
    ws.combine(out, lse)  # pairs with rank 0's call on its side stream, or meets its abort word first
    torch.cuda.synchronize()
    dist.barrier()  # rank 0 has aborted
    with pytest.raises(RuntimeError, match=r"peer 0 aborted.*\[rank 0: RuntimeError: .*still runs an earlier call"):
        ws.combine(out, lse)  # raises here when the last kernel met the abort word, else its own kernel does
        torch.cuda.synchronize()
        ws.check()
    assert ws.poisoned
    dist.barrier()
    ws.close()
    return time.monotonic() - t0


def test_a_second_stream_aborts_the_cuda_peer():
    waited = run_workers(_second_stream_worker, 2, timeout=300)[1]
    assert waited < 10, f"{waited:.1f} s (timeout_s = 60)"


def _dropped_worker(rank, world):
    import gc

    import torch.distributed as dist

    ws, out, lse = _paired(rank)
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)  # the peer's kernel waits in its next call by now
        del ws
        gc.collect()
        return 0.0
    t0 = time.monotonic()
    ws.combine(out, lse)  # waits for rank 0's call header, until rank 0's abort word lands
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    with pytest.raises(RuntimeError, match=r"peer 0 aborted.*\[rank 0: left: its OutputLSEWorkspace was dropped "
                                           r"without close\(\)"):
        ws.check()
    ws.close()  # no barrier with a peer that left
    return waited


def test_a_dropped_workspace_tells_the_cuda_peer():
    waited = run_workers(_dropped_worker, 2, timeout=300)[1]
    assert waited < 10, f"{waited:.1f} s (timeout_s = 60)"
