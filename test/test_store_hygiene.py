"""What a workspace leaves on its group's c10d store, and what its peers learn
without waiting out their timeout (docs/PROTOCOL.md "Failure behaviour"):

- store hygiene: every key a workspace writes (the agreements of creation, the
  collective path and close, the notes of void calls and aborts, the order of
  the collective path, the verdicts of agreements given up) is gone once
  every rank closed it; cycles of create, void call, collective-path call,
  abort (or a dropped workspace) and close leave the store as found;
- a workspace garbage-collected without close() tells its peers: a peer
  waiting in a call fails at once, naming the rank that left;
- creation never waits for an error it could name: a local argument error on
  one rank reaches every rank in the first creation step, and the group stays
  usable; a rank killed in that step is found by its pid; a rank interrupted
  (Ctrl-C) in a creation agreement refuses the group itself, so its retry
  fails at once;
- messages: a close barrier given up because the peer exited says so, inbox
  after close() and a meta ``partial_out`` name what is wrong, and a
  workspace dropped after its own failure leaves the note of that failure.

``SDCP_HYGIENE_CYCLES`` sets the number of cycles (default 60, to keep the
test short on a loaded machine; 1,000 were run as well)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import HOST, rank_partials

CYCLES = int(os.environ.get("SDCP_HYGIENE_CYCLES", "60"))


def _cycles_worker(rank, world, cycles):
    import gc

    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp.peer.groups import group_store

    store = group_store(dist.group.WORLD)
    po, pl = rank_partials(2, seed=rank)
    po6, pl6 = rank_partials(6, seed=10 + rank)  # 6 > max_rows = 4: the collective path

    def cycle(i):
        ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.bfloat16, timeout_s=30, **HOST)
        ws.combine(po, pl)
        if rank == 0:  # a void call: rank 0's note stays until every rank closed
            with pytest.raises(ValueError, match="'partial_out': expected dtype"):
                ws.combine(po.half(), pl)
        else:
            with pytest.raises(torch_sdcp.VoidedCallError, match="rank 0 voided call"):
                ws.combine(po, pl)
        ws.combine(po6, pl6)  # an agreement on the collective path, in the group's order
        how = ("abort", "drop")[i % 2]
        if rank == 0:
            if how == "abort":
                ws.abort(f"cycle {i}")
                ws.close()
            else:
                del ws
                gc.collect()
            return
        with pytest.raises(RuntimeError, match=r"peer 0 aborted.*\[rank 0: (abort\(\): cycle|left: )"):
            ws.combine(po, pl)
        ws.close()

    cycle(0)
    cycle(1)
    dist.barrier()
    keys0 = store.num_keys()
    t0 = time.monotonic()
    for i in range(cycles):
        cycle(i)
    elapsed = time.monotonic() - t0
    dist.barrier()
    deadline = time.monotonic() + 2.0  # the last rank of the last close removes what is left
    while store.num_keys() > keys0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"keys": (keys0, store.num_keys()), "elapsed": elapsed}


def test_cycles_of_create_void_abort_drop_and_close_leave_the_store_as_found():
    results = run_workers(_cycles_worker, 2, args=(CYCLES,), timeout=180 + CYCLES)
    for rank, r in enumerate(results):
        assert r["keys"][1] <= r["keys"][0], f"rank {rank}: the store grew: {r['keys']} keys after {CYCLES} cycles"
    print(f"{CYCLES} cycles (create, void call, collective-path call, abort or drop, close) at world 2: "
          f"{1000 * max(r['elapsed'] for r in results) / CYCLES:.1f} ms per cycle; keys {results[0]['keys']}")


def _dropped_worker(rank, world):
    import gc
    import threading

    import torch.distributed as dist

    import torch_sdcp

    po, pl = rank_partials(2, seed=rank)
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.bfloat16, timeout_s=60, **HOST)
    ws.combine(po, pl)
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)  # the peer waits in its next call by now
        dropped = time.monotonic()
        del ws
        gc.collect()
        return {"dropped": dropped}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        ws.combine(po, pl)
    failed = time.monotonic()
    text = str(raised.value)
    assert re.search(r"peer 0 aborted.*\[rank 0: left: its OutputLSEWorkspace was dropped without close\(\) "
                     r"\(garbage-collected\) in pid \d+\]", text), text
    assert ws.poisoned
    t1 = time.monotonic()
    ws.close()  # no barrier with a peer that left
    assert time.monotonic() - t1 < 1.0
    assert threading.active_count() >= 1
    return {"failed": failed, "waited": failed - t0}


def _creation_error_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    out = {}
    # max_rows=0 on rank 1 only: rank 1 raises its own error, rank 0 the same one naming rank 1, at once
    t0 = time.monotonic()
    with pytest.raises(ValueError) as raised:
        torch_sdcp.OutputLSEWorkspace(None, 0 if rank == 1 else 4, 8, 64, timeout_s=60, **HOST)
    out["max_rows_s"] = time.monotonic() - t0
    want = "torch_sdcp: argument 'max_rows': expected a positive int"
    if rank == 1:
        assert str(raised.value).startswith(want), str(raised.value)
    else:
        assert str(raised.value).startswith("torch_sdcp: PeerArena creation failed at step 'validate': rank 1: "
                                            + want), str(raised.value)
        assert "got 0" in str(raised.value)
    # a bad timeout_s on rank 0 only (the posted step takes the default bound)
    with pytest.raises(ValueError, match="argument 'timeout_s': expected a number of seconds"):
        torch_sdcp.TopKWorkspace(None, 4, 4, timeout_s="5" if rank == 0 else 60, **HOST)
    # the group is usable: the next creation pairs on every rank
    with torch_sdcp.TopKWorkspace(None, 4, 4, candidates_per_rank=8, timeout_s=60, **HOST) as ws:
        scores = torch.arange(16, dtype=torch.float32).view(2, 8) + 100 * rank
        ids = torch.arange(16, dtype=torch.int32).view(2, 8) + 100 * rank
        got = ws.merge(scores, ids)
        assert got.shape == (2, 4) and bool((got >= 100).all()), got  # rank 1's candidates win
    dist.barrier()
    return out


def test_creation_posts_a_local_argument_error_to_every_rank():
    results = run_workers(in_turn, 2, args=((_creation_error_worker, ()), (_dropped_worker, ())), timeout=120)
    for rank, (created, _dropped) in enumerate(results):
        assert created["max_rows_s"] < 5.0, (rank, created)  # not timeout_s = 60
    r1 = results[1][1]
    assert r1["failed"] - results[0][1]["dropped"] < 2.0, results  # the dropped workspace's peer: at once


def _killed_and_interrupted_worker(rank, world):
    import _thread
    import logging
    import threading

    import torch.distributed as dist

    from torch_sdcp import peer as peer_mod
    from torch_sdcp.peer import GroupOutOfStepError, PeerArena

    out = {}
    # Ctrl-C inside a creation agreement on rank 0: both ranks refuse the group at once
    g = dist.new_group([0, 1])
    if rank == 0:
        timer = threading.Timer(0.5, _thread.interrupt_main)  # while rank 1 is not there yet
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            PeerArena(g, 4096, backend="host", timeout_s=60)
        timer.join()
        t1 = time.monotonic()
        with pytest.raises(GroupOutOfStepError, match="interrupted on rank 0"):
            PeerArena(g, 4096, backend="host", timeout_s=60)  # the retry fails at once
        out["retry_s"] = time.monotonic() - t1
        out["interrupted_s"] = t1 - t0
    else:
        time.sleep(1.5)
        t1 = time.monotonic()
        with pytest.raises(GroupOutOfStepError, match="rank 0 gave up on it .*interrupted on rank 0"):
            PeerArena(g, 4096, backend="host", timeout_s=60)
        out["retry_s"] = time.monotonic() - t1
    dist.barrier()
    # a close barrier given up because the peer exited says so (not "timed-out")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch_sdcp").addHandler(handler)
    a = PeerArena(None, 4096, backend="host", timeout_s=60)
    # rank 1 dies in the 'validate' step of the next creation: rank 0 finds it by its pid, at once
    g2 = dist.new_group([0, 1])

    def hook(stage):
        if stage == "validate" and rank == 1:
            os._exit(7)

    peer_mod._TEST_HOOK = hook
    t0 = time.monotonic()
    with pytest.raises(GroupOutOfStepError, match=r"rank 1 \(pid \d+\) exited") as raised:
        PeerArena(g2, 4096, backend="host", timeout_s=60)
    out["killed_s"] = time.monotonic() - t0
    out["killed"] = str(raised.value)
    t0 = time.monotonic()
    a.close()
    out["close_s"] = time.monotonic() - t0
    out["logged"] = [r.getMessage() for r in records]
    return out


def test_a_killed_or_interrupted_rank_is_named_at_once():
    results = run_workers(_killed_and_interrupted_worker, 2, timeout=120, may_die=(1,))
    r0 = results[0]
    assert r0["interrupted_s"] < 5.0 and r0["retry_s"] < 0.5, r0
    assert r0["killed_s"] < 5.0, r0  # found by its exit, not by timeout_s = 60
    assert "creation step 'validate' given up on rank 0 (rank 1 (pid" in r0["killed"], r0["killed"]
    assert r0["close_s"] < 5.0, r0
    closing = [m for m in r0["logged"] if "close() could not synchronise" in m]
    assert len(closing) == 1 and "timed-out" not in closing[0], r0["logged"]
    assert re.search(r"close barrier given up on rank 0 \(rank 1 \(pid \d+\) exited", closing[0]), closing[0]


def _messages_worker(rank, world):
    import torch_sdcp

    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **HOST)
    assert ws.inbox is not None
    ws.close()
    with pytest.raises(RuntimeError, match=rf"QueryWorkspace on rank {rank} is closed: inbox\(\) after close\(\)"):
        ws.inbox  # noqa: B018
    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.bfloat16, timeout_s=60, **HOST)
    po, pl = rank_partials(2, seed=rank)
    with pytest.raises(ValueError, match="argument 'partial_out': expected a tensor on cpu .*got a tensor on meta"):
        ws.combine(po.to("meta"), pl)  # every rank alike: each raises its own, nothing is poisoned
    ws.combine(po, pl)
    ws.close()
    # a workspace dropped after its own failure: the peers keep the note of that failure, not "left"
    import gc

    import torch.distributed as dist

    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.bfloat16, timeout_s=60, **HOST)
    if rank == 0:
        ws.abort("the first failure")
        del ws
        gc.collect()
    dist.barrier()
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"peer 0 aborted.*\[rank 0: abort\(\): the first failure\]"):
            ws.check()
        ws.close()
    dist.barrier()
    return True


def test_messages_name_what_is_wrong():
    assert run_workers(_messages_worker, 2, timeout=120) == [True, True]
