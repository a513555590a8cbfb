"""A call over ``max_rows`` on some ranks only (docs/PROTOCOL.md "Failure
behaviour"): those ranks look for the peers' call headers while they wait in
the collective path's agreement; once one lands (a peer took the peer path
of the call, its rows within the bound), no rank enters a collective and the
call is void on every rank:

- a rank over the bound raises a ValueError that names its rows, the bound
  and the peers' rows, within a few seconds (the peers' ``timeout_s`` is 60);
  its placeholder takes the peers' rows;
- each peer raises VoidedCallError naming that error (host backend: at once;
  CUDA: at ``check()`` once its kernel completed);
- the workspace stays usable: the next calls pair and are right, a call over
  the bound on every rank still takes the collective path (its result as
  before the mismatch), and a second mismatch after it is named again; once
  closed, nothing stays on the group's store.

Every rows-bounded call (the exchange is bounded in bytes, an argument error
of its op): host backend at world 2 and 4, and CUDA with ranks sharing GPU 0.
"""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_workers
from _helpers import make_query, rank_candidates, rank_partials, rank_workspace_args, requires_gpus

MAX_ROWS, WITHIN, OVER = 4, 2, 6
CALLS = ("combine", "combine_out", "merge", "gather", "gather_view", "all_gather_heads")


def _call(name, rank, world, rows, where):
    """(make(max_rows) -> workspace, call(ws) -> its result as one tensor) for
    ``name`` on inputs of ``rows`` rows (the same inputs every time)."""
    import torch_sdcp

    options = {"timeout_s": 60, **where}
    device = where.get("device", torch.device("cpu"))
    if name in ("combine", "combine_out"):
        po, pl = (t.to(device) for t in rank_partials(rows, seed=rank))

        def make(max_rows):
            return torch_sdcp.OutputLSEWorkspace(None, max_rows, 8, 64, **options)

        if name == "combine":
            return make, lambda ws: torch.cat([t.float().flatten() for t in ws.combine(po, pl, return_lse=True)])
        out = torch.empty(rows, 8 // world, 64, dtype=torch.bfloat16, device=device)
        out_lse = torch.empty(rows, 8 // world, device=device)

        def combine_out(ws):
            ws.combine_out(po, pl, out, out_lse)
            return torch.cat([out.float().flatten(), out_lse.flatten()])

        return make, combine_out
    if name == "merge":
        scores, ids = (t.to(device) for t in rank_candidates(rows, 8, seed=rank))
        return (lambda max_rows: torch_sdcp.TopKWorkspace(None, max_rows, 4, candidates_per_rank=8, **options),
                lambda ws: ws.merge(scores, ids))

    def make_query_ws(max_rows):
        return torch_sdcp.QueryWorkspace(None, max_rows, 2, nope_dim=64, rope_dim=16, **options)

    if name == "all_gather_heads":
        q = (torch.full((rows, 2, 80), 0.25 * (rank + 1)) + torch.arange(rows).view(rows, 1, 1)).to(
            torch.float8_e4m3fn).to(device)
        return make_query_ws, lambda ws: ws.all_gather_heads(q).view(torch.uint8)
    nope, pe, pos, cache = (t.to(device) for t in make_query(rows, 2, nope=64, rope=16, max_pos=8, seed=rank))
    scale = torch.full((1,), 0.5, device=device)
    if name == "gather":
        return make_query_ws, lambda ws: ws.gather(nope, pe, pos, cache, scale).view(torch.uint8)

    def view(ws):
        got = ws.gather_view(nope, pe, pos, cache, scale).clone()
        ws.release()  # the collective path's view as well
        return got.view(torch.uint8)

    return make_query_ws, view


def _mismatch(ws, rank, over, call_over, call_within, cuda, peers):
    """One call over the bound on the ranks in ``over``, within it on the
    others: the errors each rank raises, within seconds. ``peers``: the
    ranks within the bound (named by the ranks over it)."""
    import torch_sdcp

    t0 = time.monotonic()
    if rank in over:
        named = rf"(rank ({'|'.join(map(str, peers))}) with {WITHIN} rows, )+"  # those whose header came
        with pytest.raises(ValueError, match=rf"expected {WITHIN} rows \({named}the peer path\), got {OVER} "
                                             rf"rows \(over max_rows = {MAX_ROWS} on this rank only\): every rank "
                                             "must call with the same rows; the call is void on every rank"):
            call_over(ws)
    else:
        if cuda:  # the kernel records the void; the host learns of it once the kernel completed
            call_within(ws)
            torch.cuda.synchronize()
            check = ws.check
        else:
            def check():
                call_within(ws)
        voider = rf"rank ({'|'.join(map(str, over))})"  # the first void this rank met
        with pytest.raises(torch_sdcp.VoidedCallError, match=rf"{voider} voided call .*\[{voider}: ValueError: "
                                                             "torch_sdcp: argument") as raised:
            check()
        assert f"got {OVER} rows (over max_rows = {MAX_ROWS} on this rank only)" in str(raised.value), \
            str(raised.value)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"{elapsed:.1f} s"  # not the peers' timeout (60 s)
    assert not ws.poisoned
    return elapsed


def _worker(rank, world, mode, over):
    import torch.distributed as dist

    from torch_sdcp.peer.groups import group_store

    torch.set_num_threads(1)
    where = rank_workspace_args(rank, mode)
    cuda = mode != "host"
    store = group_store(dist.group.WORLD)
    dist.barrier()
    keys0 = store.num_keys()
    peers = [r for r in range(world) if r not in over]
    wrong, times = [], []
    for name in CALLS:
        make, call_within = _call(name, rank, world, WITHIN, where)
        _, call_over = _call(name, rank, world, OVER, where)
        try:
            ws = make(MAX_ROWS)
            want = call_within(ws).clone()
            want_over = call_over(ws).clone()  # the collective path, before any mismatch
            dist.barrier()
            times.append(_mismatch(ws, rank, over, call_over, call_within, cuda, peers))
            assert torch.equal(call_within(ws), want), "the next call within the bound is wrong"
            assert torch.equal(call_over(ws), want_over), "a call over the bound on every rank is wrong"
            dist.barrier()
            times.append(_mismatch(ws, rank, over, call_over, call_within, cuda, peers))  # named again
            assert torch.equal(call_over(ws), want_over), "a call over the bound on every rank is wrong"
            assert torch.equal(call_within(ws), want), "the next call within the bound is wrong"
            ws.check()
            ws.close()
        except Exception as e:
            wrong.append(f"{name}: {type(e).__name__}: {e}")
            break
        dist.barrier()
    dist.barrier()
    deadline = time.monotonic() + 2.0  # the last rank of the last close removes what is left
    while store.num_keys() > keys0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if store.num_keys() > keys0:
        wrong.append(f"the store grew: {keys0} -> {store.num_keys()} keys")
    return {"wrong": wrong, "slowest": max(times, default=0.0)}


def _check(results):
    wrong = [f"rank {r}: {w}" for r, got in enumerate(results) for w in got["wrong"]]
    assert not wrong, "\n".join(wrong)
    print(f"slowest mismatch: {max(r['slowest'] for r in results) * 1e3:.0f} ms")


@pytest.mark.parametrize("world, over", [(2, (1,)), (2, (0,)), (4, (0, 2))])
def test_rows_over_the_bound_on_some_ranks_only_void_the_call(world, over):
    _check(run_workers(_worker, world, args=("host", over), timeout=300))


@pytest.mark.gpu
@requires_gpus(1)
def test_rows_over_the_bound_on_one_rank_only_cuda_shared_gpu():
    _check(run_workers(_worker, 2, args=("cuda_shared", (1,)), timeout=400))
