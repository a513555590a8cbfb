"""close() on one rank while a peer is inside a call of that workspace
(docs/PROTOCOL.md "Failure behaviour"): the closing rank leaves "left" on
the group's store and aborts the workspace before its close barrier, so the
peer's call fails within a second naming it (not after timeout_s), and so
does a peer that enters a call while the close barrier waits; both
closes return, and the group stays usable: a new workspace on it pairs and
is right. Host backend, spawned gloo ranks; the close during a call also with
both ranks on GPU 0 (a kernel's wait ends at the abort; the error is raised by
check())."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import rank_partials, rank_workspace_args, requires_gpus

TIMEOUT_S = 20


def _family(name, rank, mode="host"):
    """(make() -> a workspace, call(ws) -> its result, on the host once the call is over) of the
    family ``name`` (``mode``: rank_workspace_args's; on CUDA, the call synchronises and checks)."""
    import torch_sdcp

    where = rank_workspace_args(rank, mode)
    device = where.get("device", torch.device("cpu"))
    x = torch.full((4,), float(rank), device=device)
    po, pl = (t.to(device) for t in rank_partials(2, seed=rank))

    def make():
        if name == "exchange":  # its header is tagged words, read apart from the others'
            return torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=TIMEOUT_S, **where)
        return torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=TIMEOUT_S, **where)

    def call(ws):
        got = ws.all_gather(x) if name == "exchange" else ws.combine(po, pl)
        if device.type == "cuda":  # the kernel's wait ends at the abort; check() raises its error
            torch.cuda.synchronize()
            ws.check()
        return got.cpu()

    return make, call


def _close_during_call_worker(rank, world, late, family="output_lse", mode="host"):
    """Without ``late``, rank 1 is inside its call when rank 0 closes; with it, rank 1 enters its
    call while rank 0's close barrier waits (after rank 0 looked for a peer in a call)."""
    wrong = []
    make, call = _family(family, rank, mode)
    ws = make()
    dist.barrier()
    t0 = time.monotonic()
    if rank == 0:
        if not late:
            time.sleep(0.5)  # the peer is inside its call by now
        ws.close()
    else:
        if late:
            time.sleep(0.5)  # rank 0 is waiting in its close barrier by now
        try:
            call(ws)
            wrong.append("the call returned although the peer closed the workspace")
        except RuntimeError as e:
            if "left" not in str(e):
                wrong.append(f"the error does not say that the peer left: {e}")
        ws.close()
    waited = time.monotonic() - t0
    if waited > TIMEOUT_S / 4:
        wrong.append(f"rank {rank}: the call and the close took {waited:.1f} s")
    ws = make()
    got = call(ws)
    if not torch.isfinite(got.float()).all():
        wrong.append(f"rank {rank}: the next workspace's call is wrong")
    ws.close()
    return wrong


LATE = pytest.mark.parametrize("late", [False, True], ids=["in_a_call", "enters_during_the_close"])
FAMILY = pytest.mark.parametrize("family", ["output_lse", "exchange"])


@LATE
@FAMILY
def test_close_during_a_peers_call_fails_that_call_at_once(late, family):
    results = run_workers(_close_during_call_worker, 2, args=(late, family), timeout=180)
    assert results == [[], []], "\n".join(results[0] + results[1])


@pytest.mark.gpu
@requires_gpus(1)
@LATE
@FAMILY
def test_close_during_a_peers_call_fails_that_call_at_once_cuda_shared_gpu(late, family):
    results = run_workers(_close_during_call_worker, 2, args=(late, family, "cuda_shared"), timeout=240)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _resize_during_call_worker(rank, world):
    """resize() on rank 0 while rank 1 is inside a call of the workspace: rank 1's call fails within
    seconds naming rank 0's leaving (not after timeout_s), then rank 1 resizes too, the creation
    pairs, and the resized workspace is usable."""
    import torch_sdcp

    wrong = []
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=TIMEOUT_S, backend="host")
    po, pl = rank_partials(2, seed=rank)
    dist.barrier()
    t0 = time.monotonic()
    if rank == 1:
        try:
            ws.combine(po, pl)
            wrong.append("the call returned although the peer resized the workspace")
        except RuntimeError as e:
            if "left" not in str(e):
                wrong.append(f"the error does not say that the peer left: {e}")
        waited = time.monotonic() - t0
        if waited > TIMEOUT_S / 4:
            wrong.append(f"rank 1: the call failed after {waited:.1f} s")
    else:
        time.sleep(0.5)  # the peer is inside its call by now
    ws.resize(8)
    got = ws.combine(po, pl)
    if not torch.isfinite(got.float()).all():
        wrong.append(f"rank {rank}: the resized workspace's call is wrong")
    ws.close()
    return wrong


def test_resize_during_a_peers_call_fails_that_call_at_once():
    results = run_workers(_resize_during_call_worker, 2, timeout=180)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _resize_against_close_worker(rank, world, first):
    """Rank 0 resizes the workspace while the others close it, ``first`` ("resize" or "close")
    half a second before the other: the resize fails at once naming the closing ranks and
    closes the workspace on rank 0 too, every close returns, the store keeps no key of it, and
    the group stays usable (the next workspace pairs)."""
    import torch_sdcp
    from torch_sdcp.peer.groups import group_store

    wrong = []
    store = group_store(dist.group.WORLD)
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=TIMEOUT_S, backend="host")
    dist.barrier()
    keys0 = store.num_keys()
    t0 = time.monotonic()
    if (rank == 0) != (first == "resize"):
        time.sleep(0.5)  # the other side waits by now
    if rank == 0:
        try:
            ws.resize(8)
            wrong.append("the resize returned although the peers closed the workspace")
        except RuntimeError as e:
            closers = ", ".join(map(str, range(1, world)))
            if f"rank(s) {closers} closed the workspace instead of resizing it" not in str(e):
                wrong.append(f"the resize's error does not name the closing ranks: {e}")
        if not ws.closed:
            wrong.append("the workspace is still open on the resizing rank")
    else:
        ws.close()
    waited = time.monotonic() - t0
    if waited > TIMEOUT_S / 4:
        wrong.append(f"rank {rank}: the resize or the close took {waited:.1f} s")
    dist.barrier()
    deadline = time.monotonic() + 2.0
    while store.num_keys() > keys0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if store.num_keys() > keys0:
        wrong.append(f"rank {rank}: the store grew: {keys0} -> {store.num_keys()} keys")
    dist.barrier()  # every rank has counted before any creates the next workspace
    po, pl = rank_partials(2, seed=rank)
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=TIMEOUT_S, backend="host")
    if not torch.isfinite(ws.combine(po, pl).float()).all():
        wrong.append(f"rank {rank}: the next workspace's call is wrong")
    ws.close()
    return wrong


@pytest.mark.parametrize("world, first", [(2, "resize"), (2, "close"), (4, "resize")])
def test_a_resize_against_a_close_fails_the_resize_at_once_and_closes_it(world, first):
    results = run_workers(_resize_against_close_worker, world, args=(first,), timeout=180)
    assert results == [[]] * world, "\n".join(w for r in results for w in r)
