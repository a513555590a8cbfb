"""PeerArena's agreements on the group's store (torch_sdcp/peer/store_sync.py,
agreements.py, groups.py): one verdict on every rank, nothing left in flight,
the group refused after a timeout (and only that group), a close on one rank
only."""

import logging
import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import expect_raises

from torch_sdcp.peer import PeerArena
from torch_sdcp.peer.groups import GroupOutOfStepError, group_store
from torch_sdcp.peer.store_sync import AgreementAbandoned, StoreSync

# ---------------------------------------------------------------------------------------------
# agreements on the group's store: nothing left in flight, the group refused after a timeout
# ---------------------------------------------------------------------------------------------


def test_store_agreement_gives_every_rank_one_verdict():
    """Ranks that come around the moment a peer gives up: every rank gets the same verdict (all
    done with every payload, or all abandoned naming who gave up), and a finished agreement leaves
    no key; an abandoned one leaves its verdict only."""
    store = dist.HashStore()
    rng = random.Random(0)
    world, timeout_s, abandoned = 3, 0.02, 0
    for trial in range(80):
        delays = [rng.choice([0.0, 0.005, 0.018, 0.02, 0.022, 0.04]) for _ in range(world)]
        results = [None] * world

        def rank_main(r):
            time.sleep(delays[r])
            try:
                results[r] = ("done", StoreSync(store, r, world, f"t{trial}").meet("x", timeout_s, b"p%d" % r))
            except AgreementAbandoned as e:
                results[r] = ("abandoned", e.by_rank, e.mine)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        kinds = {res[0] for res in results}
        assert len(kinds) == 1, (delays, results)
        if kinds == {"done"}:
            assert all(res[1] == [b"p0", b"p1", b"p2"] for res in results), results
        else:
            abandoned += 1
            assert len({res[1] for res in results}) == 1, results  # one rank gave up, named alike
            assert sum(res[2] for res in results) == 1, results
    assert 0 < abandoned < 80  # both outcomes were exercised
    assert store.num_keys() == abandoned  # the verdicts of the abandoned agreements only
    # a rank that leaves without the barrier: the peers complete it at once, and nothing stays
    syncs = [StoreSync(store, r, 2, "post") for r in range(2)]
    syncs[0].post("close")
    t0 = time.monotonic()
    assert syncs[1].meet("close", 5.0) == [b"", b""] and time.monotonic() - t0 < 1.0
    assert store.num_keys() == abandoned
    # an interrupted wait (Ctrl-C) gives the agreement up for its peers at once
    syncs = [StoreSync(store, r, 2, "interrupted") for r in range(2)]

    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        syncs[0].meet("x", 5.0, give_up=interrupt)
    with pytest.raises(AgreementAbandoned, match="rank 0 gave up .*interrupted on rank 0") as e:
        syncs[1].meet("x", 5.0)
    assert not e.value.mine
    # a rank that leaves after a peer gave the barrier up learns it (and completes nothing)
    assert syncs[1].post("x").by_rank == 0


def _log_records():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch_sdcp").addHandler(handler)
    return records


def _late_creation_worker(rank, ws):
    import torch_sdcp

    out = {}
    if rank == 1:
        time.sleep(2.5)  # rank 0 gives up after 1 s
    for attempt in ("first", "retry"):
        t0 = time.monotonic()
        out[attempt] = expect_raises(GroupOutOfStepError, PeerArena, None, 4096, backend="host", timeout_s=1.0)
        out[attempt + "_s"] = time.monotonic() - t0
    out["workspace"] = expect_raises(GroupOutOfStepError, torch_sdcp.ExchangeWorkspace, None, 64, backend="host")
    # the group's own collectives are in step: nothing was left in flight
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["sum"] = t.item()
    with PeerArena(dist.new_group([0, 1]), 4096, backend="host", timeout_s=20) as a:  # a new group works
        a.barrier()
    return out


def test_creation_timeout_then_retry_refuses_the_group_without_a_crash():
    results = run_workers(_late_creation_worker, 2, timeout=120)
    refusal = ("the process group '0' is out of step after a timed-out creation step 'validate' on rank 0 "
               "(waited for ranks [1]); re-create the process group")
    r0, r1 = results
    assert r0["first"].startswith("torch_sdcp: PeerArena creation failed at step 'validate': rank 0 gave up "
                                  "waiting for ranks [1]: waited timeout_s = 1 s"), r0["first"]
    assert r0["first"].endswith(refusal) and 0.9 < r0["first_s"] < 2.0, r0
    # the late rank fails at once, naming who gave up
    assert "rank 0 gave up on it after" in r1["first"] and "before rank 1 came" in r1["first"], r1["first"]
    assert r1["first"].endswith(refusal) and r1["first_s"] < 0.5, r1
    for r in results:
        assert r["retry"] == f"torch_sdcp: {refusal} (PeerArena creation refused)" and r["retry_s"] < 0.1, r
        assert r["workspace"] == r["retry"]
        assert r["sum"] == 3.0


def _agreement_keys_left(store, arena):
    """The keys of ``arena``'s agreements (creation steps, barriers, close) still in the store."""
    prefix = arena._agreements.prefix
    names = ["validate", "allocate", "exchange", "map", "probe write", "probe verify", "close"]
    names += [f"barrier{i}" for i in range(1, arena._barriers + 1)]
    keys = [f"{prefix}/{n}/{k}" for n in names for k in [*map(str, range(arena.world_size)), "v", "n"]]
    return [k for k in keys if store.check([k])]


def _close_one_rank_worker(rank, ws):
    records = _log_records()
    store = group_store(dist.group.WORLD)
    out = {}
    # close(barrier=False) on one rank: the peer's close barrier completes at once, nothing stays
    keys0 = store.num_keys()
    b = PeerArena(None, 4096, backend="host", timeout_s=5.0)
    if rank == 0:
        b.close(barrier=False)
    else:
        time.sleep(0.2)
        t0 = time.monotonic()
        b.close()
        out["post_s"] = time.monotonic() - t0
    dist.barrier()
    # The last reader of a key removes it: on a loaded machine that may land just after the barrier.
    deadline = time.monotonic() + 5.0
    while store.num_keys() > keys0 + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    out["keys"] = (keys0, store.num_keys())
    out["left"] = _agreement_keys_left(store, b)
    dist.barrier()  # both ranks done counting before the next creation (its timeout_s is 1 s)
    # close() on rank 0 only: its barrier times out, is logged, and the group is refused
    a = PeerArena(None, 4096, backend="host", timeout_s=1.0)
    t = torch.tensor([rank + 1.0])
    t0 = time.monotonic()
    if rank == 0:
        a.close()
        out["close_s"] = time.monotonic() - t0
        dist.all_reduce(t)  # pairs with rank 1's: no barrier of ours is in flight
    else:
        time.sleep(2.0)
        dist.all_reduce(t)
        t0 = time.monotonic()
        a.close()  # late: the barrier was given up, it fails at once
        out["close_s"] = time.monotonic() - t0
    out["sum"] = t.item()
    out["logged"] = [r.getMessage() for r in records]
    out["next"] = expect_raises(GroupOutOfStepError, PeerArena, None, 4096, backend="host", timeout_s=1.0)
    return out


def test_close_on_one_rank_only_leaves_nothing_in_flight():
    results = run_workers(_close_one_rank_worker, 2, timeout=120)
    refusal = ("the process group '0' is out of step after a timed-out close barrier on rank 0 (waited for ranks "
               "[1]); re-create the process group")
    assert results[1]["post_s"] < 1.0, results
    for _rank, r in enumerate(results):
        assert r["left"] == [], r  # every key of the arena's agreements is gone
        assert r["keys"][1] <= r["keys"][0] + 1, r  # and no more (gloo's own keys come and go)
        assert r["sum"] == 3.0, r
        assert len(r["logged"]) == 1 and "close() could not synchronise" in r["logged"][0], r
        assert refusal in r["logged"][0], r
        assert r["next"] == f"torch_sdcp: {refusal} (PeerArena creation refused)", r
    assert 0.9 < results[0]["close_s"] < 2.0 and results[1]["close_s"] < 0.5, results


def _subgroup_worker(rank, ws):
    g = dist.new_group([0, 2])
    out = {}
    if rank != 1:
        with PeerArena(g, 4096, backend="host", timeout_s=20) as a:
            a.barrier()
        a = PeerArena(g, 4096, backend="host", timeout_s=1.0)
        if rank == 0:  # rank 2 of the world does not come: the subgroup is refused, not the world
            out["barrier"] = expect_raises(GroupOutOfStepError, a.barrier)
        a.close(barrier=False)
    with PeerArena(None, 4096, backend="host", timeout_s=20) as a:
        a.barrier()
    return out


def test_subgroup_agreements_and_refusal_stay_in_the_subgroup():
    results = run_workers(_subgroup_worker, 3, timeout=120)
    msg = results[0]["barrier"]
    assert "PeerArena barrier failed: rank 0 gave up waiting for ranks [1]" in msg, msg
    assert "the process group '1' is out of step after a timed-out barrier on rank 0" in msg, msg


def _dies_before_its_pid_worker(rank, ws, timeout_s):
    """Both ranks create an arena (each learns the other's pid); then rank 1 exits before it could
    publish its pid for the next creation, which rank 0 begins: rank 0's first step ends on rank
    1's exit (the group's known pids are watched from the first step), not on timeout_s."""
    with PeerArena(None, 4096, backend="host", timeout_s=timeout_s):
        pass
    if rank == 1:
        os._exit(7)
    t0 = time.monotonic()
    try:
        PeerArena(None, 4096, backend="host", timeout_s=timeout_s)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def test_a_rank_gone_before_it_publishes_its_pid_is_found_by_its_exit():
    timeout_s = 20.0
    results = run_workers(_dies_before_its_pid_worker, 2, args=(timeout_s,), timeout=90, may_die=(1,))
    r = results[0]
    assert r["error"] is not None and "exited" in r["error"], r
    assert r["elapsed"] < timeout_s / 4, r
