"""The collective path of the workspaces of one group runs in one order on
every rank (torch_sdcp/peer/group_order.py, GroupOrder): two workspaces on one
group, each used from its own thread (the dual-batch-overlap set-up of
docs/VLLM.md), with calls over ``max_rows``. Without the order each rank's
threads entered their store agreements and then gloo collectives in an order
of their own, and gloo paired one workspace's collectives with the other's:
wrong results, then an abort. Here each rank delays, between a thread's
agreement and its collectives, the thread that the other rank does not delay:
without the order the ranks' collectives pair crosswise (3 wrong results of
30 per thread seen)."""

from __future__ import annotations

import pytest
from _dist import run_workers
from _helpers import HOST, rank_candidates

CALLS = 30  # per thread; every tenth takes the collective path


def _two_threads_worker(rank, world, calls):
    import threading
    import time

    import torch

    import torch_sdcp
    from torch_sdcp import reference
    from torch_sdcp.peer import PeerArena

    spaces = [torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, timeout_s=30, **HOST) for _ in range(2)]
    agree_call = PeerArena.agree_call

    def skewed_agree_call(arena, *args, **kwargs):
        # Between a thread's agreement and its collectives, the thread that is
        # not this rank's first one waits: the ranks' threads would enter the
        # group's collectives in opposite orders.
        got = agree_call(arena, *args, **kwargs)
        if (rank + spaces.index(next(ws for ws in spaces if ws.arena is arena))) % 2:
            time.sleep(0.05)
        return got

    PeerArena.agree_call = skewed_agree_call
    outcome = {0: {"right": 0, "wrong": 0, "errors": []}, 1: {"right": 0, "wrong": 0, "errors": []}}

    def run(thread):
        ws, out = spaces[thread], outcome[thread]
        for call in range(calls):
            rows = 3 if call % 10 == 3 else 2  # 3 > max_rows = 2: the collective path
            every = [rank_candidates(rows, 8, seed=1000 * thread + 10 * call + r) for r in range(world)]
            try:
                got = ws.merge(*every[rank])
            except Exception as e:
                out["errors"].append(f"call {call}: {type(e).__name__}: {e}")
                return
            if torch.equal(got, reference.topk_merge_ref(every, 4)):
                out["right"] += 1
            else:
                out["wrong"] += 1

    threads = [threading.Thread(target=run, args=(t,), name=f"batch{t}") for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for ws in spaces:
        ws.close()
    return outcome


def test_two_workspaces_on_two_threads_take_the_collective_path_in_one_order():
    results = run_workers(_two_threads_worker, 2, args=(CALLS,), timeout=180)
    for rank, outcome in enumerate(results):
        for thread, out in outcome.items():
            assert out["errors"] == [] and out["wrong"] == 0 and out["right"] == CALLS, (rank, thread, out)


def test_group_order_names_the_section_it_waits_for():
    """A rank whose thread is at another section than rank 0's gives up within
    its timeout, naming what rank 0 runs; a section given up is skipped."""
    import torch.distributed as dist

    from torch_sdcp.peer.group_order import GroupOrder
    from torch_sdcp.peer.store_sync import AgreementAbandoned

    store = dist.HashStore()
    leader, follower = GroupOrder(store, 0, 2), GroupOrder(store, 1, 2)
    turn = leader.enter("ws1/collective1", 1.0)
    with pytest.raises(AgreementAbandoned, match="its turn in the group's order of collective-path calls did not "
                                                 "come within timeout_s = 0.05 s .*rank 0 runs 'ws1/collective1'"):
        follower.enter("ws2/collective1", 0.05)
    store.set("ws1/collective1/v", "abandoned:{}")  # rank 0 gave that section up: the follower skips it
    turn.release()
    leader.enter("ws2/collective1", 1.0).release()
    follower.enter("ws2/collective1", 1.0).release()
    assert store.num_keys() == 1  # the given-up verdict only: the order's keys are gone
    # rank 0 ran a section of ws3 alone, and ws3's verdicts went with its close: closing ws3
    # here tells the follower that the section will not run here
    leader.enter("ws3/collective1", 1.0).release()
    leader.enter("ws4/collective1", 1.0).release()
    follower.forget("ws3")
    follower.enter("ws4/collective1", 1.0).release()
    assert store.num_keys() == 1
