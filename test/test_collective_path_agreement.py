"""The collective path of a call over ``max_rows`` (docs/PROTOCOL.md "Failure
behaviour", "Rows fallback"): its store agreement compares what the peer
path's call header compares, so both paths refuse the same calls naming the
same difference (the LSE base of ``combine``, a ``q_scale`` on one rank only
of ``gather``), and no rank returns a result of calls that differ. Host
backend, spawned gloo ranks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import make_query, rank_partials

MAX_ROWS, WITHIN, OVER = 4, 2, 6
OPTIONS = {"timeout_s": 30, "backend": "host"}


def _one_field_differs(rank):
    """(name, make() -> workspace, call(ws, rows), pattern): calls that differ in one header field on
    rank 1 only, and what the mismatch names of both sides."""
    import torch_sdcp

    def combine(ws, rows, out=False):
        po, pl = rank_partials(rows, seed=rank)
        base = "2" if rank == 1 else "e"
        if not out:
            return ws.combine(po, pl, lse_base=base)
        ws.combine_out(po, pl, torch.empty(rows, 4, 64, dtype=torch.bfloat16), torch.empty(rows, 4),
                       lse_base=base)

    def gather(ws, rows, what):
        scale = torch.tensor([0.02]) if rank == 1 else None
        return getattr(ws, what)(*make_query(rows, 2, nope=64, rope=16, seed=rank), scale)

    def output_lse():
        return torch_sdcp.OutputLSEWorkspace(None, MAX_ROWS, 8, 64, **OPTIONS)

    def query():
        return torch_sdcp.QueryWorkspace(None, MAX_ROWS, 2, nope_dim=64, rope_dim=16, dtype=torch.float8_e4m3fn,
                                         **OPTIONS)

    base = r"lse base e\b.*lse base 2"
    scale = r"without q_scale.*with q_scale"
    return [("combine", output_lse, combine, base),
            ("combine_out", output_lse, lambda ws, rows: combine(ws, rows, out=True), base),
            ("gather", query, lambda ws, rows: gather(ws, rows, "gather"), scale),
            ("gather_view", query, lambda ws, rows: gather(ws, rows, "gather_view"), scale)]


def _differ_worker(rank, world):
    """On each path (rows within the bound: the call header; over it: the store agreement), a call
    that differs in one header field on rank 1 only raises a call mismatch naming that field's two
    sides on every rank, and no rank returns a result."""
    wrong = []
    for name, make, call, pattern in _one_field_differs(rank):
        for rows in (WITHIN, OVER):
            ws = make()
            try:
                call(ws, rows)
                wrong.append(f"{name}, {rows} rows: returned a result of calls that differ")
            except RuntimeError as e:
                if not re.search(pattern, str(e)):
                    wrong.append(f"{name}, {rows} rows: {e}")
            ws.close()
            dist.barrier()
    return wrong


def test_the_collective_path_compares_what_the_call_header_compares():
    results = run_workers(_differ_worker, 2, timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _turn_never_comes_worker(rank, world):
    """Rank 1 takes the collective path of a call that rank 0 never makes: its turn in the group's
    order does not come within timeout_s, and the call fails with a RuntimeError (not the internal
    AgreementAbandoned), naming why."""
    import torch_sdcp

    wrong = []
    ws = torch_sdcp.OutputLSEWorkspace(None, MAX_ROWS, 8, 64, timeout_s=1.5, backend="host")
    if rank == 1:
        po, pl = rank_partials(OVER, seed=rank)
        try:
            ws.combine(po, pl)
            wrong.append("the call returned")
        except RuntimeError as e:
            if "timeout_s" not in str(e):
                wrong.append(f"{type(e).__name__}: {e}")
        except Exception as e:
            wrong.append(f"not a RuntimeError: {type(e).__name__}: {e}")
    else:
        import time

        time.sleep(3)
    ws.close()
    return wrong


def test_a_turn_that_never_comes_is_a_runtime_error():
    results = run_workers(_turn_never_comes_worker, 2, timeout=120)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _out_of_step_worker(rank, world):
    """Rank 0 calls over the bound with tag 1 while rank 1, a call ahead (it skipped one), calls
    within it with tag 2: rank 0's void placeholder (the peers' rows, its own tag) meets the tag
    mismatch, so its call is not void; whatever it raises tells the truth about the workspace."""
    from _helpers import rank_candidates

    import torch_sdcp

    wrong = []
    ws = torch_sdcp.TopKWorkspace(None, MAX_ROWS, 4, candidates_per_rank=8, timeout_s=30, backend="host")
    rows, tag = (OVER, 1) if rank == 0 else (WITHIN, 2)
    try:
        ws.merge(*rank_candidates(rows, 8, seed=rank), tag=tag)
        wrong.append(f"rank {rank}: the call returned")
    except RuntimeError as e:
        if "stays usable" in str(e) and ws.poisoned:
            wrong.append(f"rank {rank}: told that the workspace stays usable, but it is poisoned: {e}")
    except ValueError as e:
        if "stays usable" in str(e) and ws.poisoned:
            wrong.append(f"rank {rank}: told that the workspace stays usable, but it is poisoned: {e}")
    ws.close()
    return wrong


def test_the_rank_out_of_step_is_told_the_truth():
    results = run_workers(_out_of_step_worker, 2, timeout=120)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _order_after_close_worker(rank, world, cycles, later_calls):
    """The issue's sequence, ``cycles`` times, alternating close and resize: a call over the bound on
    rank 0 only (a void call; rank 0 names a section of the group's order), then the workspace closed
    or resized before rank 1 ever took the collective path. Then ``later_calls`` collective-path
    calls on a new workspace: each pairs at once and is right, and the group's store holds the keys
    it held before."""
    import torch_sdcp
    from torch_sdcp.peer.groups import group_store

    wrong = []
    store = group_store(dist.group.WORLD)
    dist.barrier()
    keys0 = store.num_keys()
    for i in range(cycles):
        ws = torch_sdcp.OutputLSEWorkspace(None, MAX_ROWS, 8, 64, timeout_s=10, backend="host")
        po, pl = rank_partials(OVER if rank == 0 else WITHIN, seed=rank)
        try:
            ws.combine(po, pl)
            wrong.append(f"cycle {i}: the mismatched call returned")
        except (ValueError, torch_sdcp.VoidedCallError):
            pass
        if i % 2:
            ws.resize(2 * MAX_ROWS)
        ws.close()
    ws = torch_sdcp.OutputLSEWorkspace(None, MAX_ROWS, 8, 64, timeout_s=10, backend="host")
    po, pl = rank_partials(OVER, seed=rank)
    for i in range(later_calls):
        t0 = __import__("time").monotonic()
        try:
            ws.combine(po, pl)
        except RuntimeError as e:
            wrong.append(f"later call {i}: {e}")
            break
        if __import__("time").monotonic() - t0 > 5:
            wrong.append(f"later call {i} took {__import__('time').monotonic() - t0:.1f} s")
    ws.close()
    dist.barrier()
    if store.num_keys() != keys0:
        wrong.append(f"the store held {keys0} keys before, {store.num_keys()} after")
    return wrong


def test_the_group_order_survives_close_and_resize():
    results = run_workers(_order_after_close_worker, 2, args=(4, 100), timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _other_kind_worker(rank, world, over_call, within_call):
    """Rank 0 calls ``over_call`` over the bound, rank 1 ``within_call`` within it (the other kind of
    query call: a copying call against a view call): both raise within seconds (the peer's header
    of the other kind is read), not after timeout_s."""
    import time

    import torch_sdcp

    ws = torch_sdcp.QueryWorkspace(None, MAX_ROWS, 2, nope_dim=64, rope_dim=16, dtype=torch.bfloat16,
                                   timeout_s=30, backend="host")
    what, rows = (over_call, OVER) if rank == 0 else (within_call, WITHIN)
    wrong = []
    t0 = time.monotonic()
    try:
        getattr(ws, what)(*make_query(rows, 2, nope=64, rope=16, seed=rank))
        wrong.append(f"rank {rank}: {what}() returned")
    except RuntimeError:
        pass
    waited = time.monotonic() - t0
    if waited > 10:
        wrong.append(f"rank {rank}: {what}() raised after {waited:.1f} s")
    ws.close()
    return wrong


@pytest.mark.parametrize("over_call,within_call", [("gather", "gather_view"), ("gather_view", "gather")])
def test_a_call_of_the_other_kind_within_the_bound_is_named_at_once(over_call, within_call):
    results = run_workers(_other_kind_worker, 2, args=(over_call, within_call), timeout=120)
    assert results == [[], []], "\n".join(results[0] + results[1])
