"""The workspace machinery that every family shares, under hostile use, on the
host backend with spawned gloo ranks: absurd sizes and timeouts refused
locally before any collective, creation bounded by timeout_s, dropped
workspaces released, closed workspaces refusing every call, failed resizes
leaving the workspace as it was, one caller thread at a time, argument errors
naming the argument on the peer and the collective path, and the rows_fallback
opt-out. Calls that disagree across ranks: test_call_agreement.py; the failure
tests of one family's calls live in test_<family>.py (README.md)."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch
from _dist import run_workers
from _helpers import (
    HOST,
    expect_poisoned,
    make_query,
    rank_candidates,
)


def _refuse_probe(stage):  # the capability gate fails on every rank
    if stage == "probe":
        raise RuntimeError("peer writes were dropped")


# ---------------------------------------------------------------------------
# 1, 2, 6: sizes, timeouts and groups are checked locally, before any collective
# ---------------------------------------------------------------------------


def _local_checks_worker(rank, world):
    import os
    import time

    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp import workspaces as wsmod

    region = "at most 1099511627776"
    bad_sizes = [(2**62 + 4, "2**40"), (2**63, "2**40"), (2**64 + 1, "2**40"), (True, "got True"),
                 (8.0, "got 8.0"), ("8", "got '8'"), (0, "got 0"), (-3, "got -3")]
    for value, tail in bad_sizes:
        with pytest.raises(ValueError, match=rf"argument 'max_rows': expected a positive int.*{re.escape(tail)}"):
            torch_sdcp.OutputLSEWorkspace(None, value, 8, 64, **HOST)
        with pytest.raises(ValueError, match=rf"argument 'max_rows': .*{re.escape(tail)}"):
            torch_sdcp.TopKWorkspace(None, value, 16, **HOST)
        with pytest.raises(ValueError, match=rf"argument 'max_rows': .*{re.escape(tail)}"):
            torch_sdcp.QueryWorkspace(None, value, 4, **HOST)
    for kwargs, arg in [(dict(total_heads=2**64), "total_heads"), (dict(head_dim=2**63), "head_dim"),
                        (dict(head_dim=False), "head_dim")]:
        args = {"max_rows": 8, "total_heads": 8, "head_dim": 64, **kwargs}
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            torch_sdcp.OutputLSEWorkspace(None, **args, **HOST)
    for kwargs, arg in [(dict(k=2**63), "k"), (dict(k=True), "k"),
                        (dict(candidates_per_rank=2**62), "candidates_per_rank")]:
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            torch_sdcp.TopKWorkspace(None, 8, **{"k": 16, **kwargs}, **HOST)
    for kwargs, arg in [(dict(local_heads=2**63), "local_heads"), (dict(nope_dim=1.5), "nope_dim"),
                        (dict(rope_dim=2**64), "rope_dim")]:
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            torch_sdcp.QueryWorkspace(None, 8, **{"local_heads": 4, **kwargs}, **HOST)
    with pytest.raises(ValueError, match="argument 'max_bytes'"):
        torch_sdcp.ExchangeWorkspace(None, 2**63, **HOST)
    # Each parameter fits, their product does not: the C++ layout names max_rows.
    with pytest.raises(ValueError, match=f"argument 'max_rows': expected a workspace region of {region}"):
        torch_sdcp.OutputLSEWorkspace(None, 2**30, 8, 2**12, **HOST)
    with pytest.raises(ValueError, match=f"argument 'max_rows': expected a workspace region of {region}"):
        torch_sdcp.TopKWorkspace(None, 2**39, 2**20, **HOST)

    for bad in ("5", True, 0, -1, 1e-12, 5e-4, math.inf, -math.inf, math.nan, 86400.5, [5], torch.tensor(5.0)):
        with pytest.raises(ValueError, match="argument 'timeout_s': expected a"):
            torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=bad, **HOST)
    for bad in ("abc", "0", "-5", "inf", "nan", "1e-12", "1e9", "5s"):
        os.environ["SDCP_TIMEOUT_S"] = bad
        with pytest.raises(ValueError, match=f"environment variable SDCP_TIMEOUT_S: expected .*got '{re.escape(bad)}'"):
            torch_sdcp.TopKWorkspace(None, 8, 16, **HOST)
    with torch_sdcp.TopKWorkspace(None, 8, 16, timeout_s=5, **HOST) as ws:  # an explicit timeout_s wins
        assert ws.timeout_s == 5.0
    del os.environ["SDCP_TIMEOUT_S"]
    with pytest.raises(ValueError, match="argument 'fallback': expected a bool"):
        torch_sdcp.ExchangeWorkspace(None, 64, fallback="yes", **HOST)
    with pytest.raises(ValueError, match="argument 'rows_fallback': expected a bool"):
        torch_sdcp.TopKWorkspace(None, 8, 16, rows_fallback=0, **HOST)

    with pytest.raises(ValueError, match="argument 'group': expected a torch.distributed ProcessGroup or None, "
                                         "got int 42"):
        torch_sdcp.OutputLSEWorkspace(42, 8, 8, 64, **HOST)
    only0 = dist.new_group([0])  # collective over the default group
    if rank == 1:
        with pytest.raises(ValueError, match="argument 'group': expected a process group that contains this "
                                             "process \\(global rank 1\\)"):
            torch_sdcp.ExchangeWorkspace(only0, 64, **HOST)
        with pytest.raises(ValueError, match="argument 'group'.*contains this process"):
            torch_sdcp.OutputLSEWorkspace(only0, 8, 8, 64, **HOST)

    # Every refusal above was local: the ranks are still in step.
    os.environ["SDCP_TIMEOUT_S"] = "123"
    with torch_sdcp.ExchangeWorkspace(None, 64, **HOST) as ws:
        assert ws.timeout_s == 123.0
        assert torch.equal(ws.all_gather(torch.full((2,), float(rank))),
                           torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    del os.environ["SDCP_TIMEOUT_S"]
    with torch_sdcp.TopKWorkspace(None, 8, 16, timeout_s=7, **HOST) as ws:
        assert ws.timeout_s == 7.0 and wsmod.DEFAULT_TIMEOUT_S == 300.0
    with torch_sdcp.TopKWorkspace(None, 8, 16, **HOST) as ws:
        assert ws.timeout_s == 300.0

    # Creation honours timeout_s (it used to wait at least 30 s): rank 1 never comes.
    late = dist.new_group([0, 1])
    if rank == 1:
        time.sleep(4.0)  # the peer gives up on its own bound, not on a closed connection
        return True
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError), match="PeerArena creation failed"):
        torch_sdcp.ExchangeWorkspace(late, 64, timeout_s=1.0, **HOST)
    elapsed = time.monotonic() - t0
    assert elapsed < 3.5, elapsed
    return True


def test_sizes_timeouts_and_groups_are_refused_locally():
    assert run_workers(_local_checks_worker, 2, timeout=120) == [True, True]


# ---------------------------------------------------------------------------
# 4, 6, 7: closed workspaces, failed resizes, call arguments, rows_fallback
# ---------------------------------------------------------------------------


def _calls_worker(rank, world):
    import contextlib

    import torch_sdcp
    from torch_sdcp import peer as peer_mod
    from torch_sdcp import reference

    g = torch.Generator().manual_seed(11)
    outs, lses = torch.randn(world, 4, 8, 64, generator=g).bfloat16(), torch.randn(world, 4, 8, generator=g)
    ws = torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, **HOST)  # bf16; rows 4 > max_rows take the collective path

    # Inputs, on the peer path (2 rows) and the collective path (4 rows), every
    # rank making the same bad call. On the peer path each is a void call (each
    # rank raises its own error, nothing is poisoned) when its leading tensor
    # tells the placeholder; otherwise (and on the collective path, where no
    # placeholder exists) it poisons the workspace on every rank (a peer may
    # wait in the call) and is followed by a re-creation (resize, collective).
    @contextlib.contextmanager
    def poisons(match):
        with pytest.raises(ValueError, match=match):
            yield
        if rows <= 2:
            assert not ws.poisoned
            ws.check()
            return
        assert ws.poisoned
        with pytest.raises(RuntimeError, match=f"OutputLSEWorkspace on rank {rank} is poisoned: combine\\(\\) after a "
                                               "failed call \\(ValueError: .*re-create the workspace"):
            ws.combine(outs[rank, :2].contiguous(), lses[rank, :2].contiguous())
        ws.resize(2)
        assert not ws.poisoned

    for rows in (2, 4):
        po, pl = outs[rank, :rows].contiguous(), lses[rank, :rows].contiguous()
        with poisons(match="argument 'partial_out': expected a Tensor, got NoneType"):
            ws.combine(None, pl)  # the placeholder takes the rows of partial_lse
        with poisons(match="argument 'partial_lse': expected a Tensor, got list"):
            ws.combine(po, [1.0])
        with poisons(match=r"argument 'partial_out': expected dtype torch.bfloat16 \(the dtype of "
                                             r"this OutputLSEWorkspace\), got dtype torch.float16"):
            ws.combine(po.half(), pl)
        with poisons(match="argument 'partial_out': expected dtype torch.bfloat16.*float16"):
            ws.combine_out(po.half(), pl, torch.empty(rows, 4, 64, dtype=torch.half), torch.empty(rows, 4))
        with poisons(match="argument 'partial_lse': expected dtype torch.float32, got dtype "
                                             "torch.float64"):
            ws.combine(po, pl.double())
        with poisons(match=r"argument 'partial_out': expected size 64 at dim 2 \(head_dim of this "
                                             rf"OutputLSEWorkspace\), got 32 \(shape \[{rows}, 8, 32\]\)"):
            ws.combine(po[..., :32].contiguous(), pl)
        with poisons(match=r"argument 'partial_lse': expected size 8 at dim 1 .*got 4"):
            ws.combine(po, pl[:, :4].contiguous())
        with poisons(match=r"argument 'partial_out': expected 3 dimensions \[T, H, D\], got 2"):
            ws.combine(po[0], pl)
        good_out, good_lse = torch.empty(rows, 4, 64, dtype=torch.bfloat16), torch.empty(rows, 4)
        bad_outputs = [
            (torch.empty(1, 4, 64, dtype=torch.bfloat16), good_lse,
             rf"'out': expected shape \[{rows}, 4, 64\], got shape \[1, 4, 64\]"),  # broadcastable
            (torch.empty(rows, 4, 64), good_lse, "'out': expected dtype torch.bfloat16, got dtype torch.float32"),
            (torch.empty(rows, 64, 4, dtype=torch.bfloat16).transpose(1, 2), good_lse,
             "'out': expected a contiguous tensor"),
            (torch.empty(rows, 4, 64, dtype=torch.bfloat16, device="meta"), good_lse,
             "'out': expected device cpu .*got device meta"),
            (None, good_lse, "'out': expected a Tensor, got NoneType"),
            (good_out, torch.empty(rows, 4, dtype=torch.bfloat16), "'out_lse': expected dtype torch.float32"),
            (good_out, torch.empty(rows, 1), rf"'out_lse': expected shape \[{rows}, 4\], got shape \[{rows}, 1\]"),
            (good_out, torch.empty(4, rows).t(), "'out_lse': expected a contiguous tensor"),
        ]
        for out, out_lse, match in bad_outputs:
            with poisons(match=f"argument {match}"):
                ws.combine_out(po, pl, out, out_lse)
        # Every rank re-created the workspace after each error: the calls that follow are paired.
        want_out, want_lse = ws.combine(po, pl, return_lse=True)
        ws.combine_out(po, pl, good_out, good_lse)
        assert torch.equal(good_out, want_out) and torch.equal(good_lse, want_lse)
        ref_out, ref_lse = reference.lse_combine_ref64(outs[:, :rows], lses[:, :rows])
        ref_out, _ = reference.output_lse_shard(ref_out, ref_lse, rank, world)
        torch.testing.assert_close(want_out.double(), ref_out, rtol=2e-2, atol=2e-2)

    # A closed workspace refuses every call, the collective path included.
    ws.close()
    po, pl = outs[rank].contiguous(), lses[rank].contiguous()
    closed = f"OutputLSEWorkspace on rank {rank} is closed"
    for call in (lambda: ws.combine(po[:2], pl[:2]), lambda: ws.combine(po, pl),
                 lambda: ws.combine_out(po, pl, torch.empty(4, 4, 64, dtype=torch.bfloat16), torch.empty(4, 4)),
                 lambda: ws.resize(4)):
        with pytest.raises(RuntimeError, match=f"{closed}: (combine|combine_out|resize)\\(\\) after close\\(\\)"):
            call()
    assert ws.closed and not ws.peer and "closed" in repr(ws)
    ws.close()  # idempotent

    s2, i2 = rank_candidates(2, 8, seed=rank)
    s3, i3 = rank_candidates(3, 8, seed=10 + rank)
    topk = torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, **HOST)
    topk.close()
    for call in (lambda: topk.merge(s2, i2), lambda: topk.merge(s3, i3), lambda: topk.resize(8)):
        with pytest.raises(RuntimeError, match=f"TopKWorkspace on rank {rank} is closed"):
            call()
    query = torch_sdcp.QueryWorkspace(None, 2, 2, nope_dim=64, rope_dim=16, **HOST)
    q = make_query(1, 2, nope=64, rope=16, max_pos=8, seed=rank)
    query.gather_view(*q, torch.ones(1))
    query.close()  # an open view becomes invalid
    for name, call in (("gather", lambda: query.gather(*q, torch.ones(1))),
                       ("gather_view", lambda: query.gather_view(*q, torch.ones(1))),
                       ("release", query.release), ("resize", lambda: query.resize(4))):
        with pytest.raises(RuntimeError, match=f"QueryWorkspace on rank {rank} is closed: {name}\\(\\)"):
            call()
    peer_mod._TEST_HOOK = _refuse_probe
    try:
        coll = torch_sdcp.ExchangeWorkspace(None, 64, fallback=True, **HOST)  # collective mode
    finally:
        peer_mod._TEST_HOOK = None
    assert not coll.peer
    assert coll.all_gather(torch.ones(2)).shape == (2, 2)
    coll.abort("this rank stops")  # collective mode: this rank only, and it enters no collective afterwards
    with pytest.raises(RuntimeError, match="poisoned: all_gather\\(\\) .*this rank stops"):
        coll.all_gather(torch.ones(2))
    coll.close()
    with pytest.raises(RuntimeError, match=f"ExchangeWorkspace on rank {rank} is closed: all_gather"):
        coll.all_gather(torch.ones(2))
    with pytest.raises(ValueError, match="argument 'x': expected a Tensor, got NoneType"):
        torch_sdcp.ExchangeWorkspace(None, 64, **HOST).all_gather(None)

    # A failed resize leaves the workspace as it was, usable; a later one works.
    every2 = [(rank_candidates(2, 8, seed=r)) for r in range(world)]
    every3 = [(rank_candidates(3, 8, seed=10 + r)) for r in range(world)]
    want2, want3 = reference.topk_merge_ref(every2, 4), reference.topk_merge_ref(every3, 4)
    for fallback in (False, True):
        with torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, fallback=fallback, **HOST) as tk:
            handle, physical = tk.handle, tk.physical_bytes
            with pytest.raises(ValueError, match="argument 'max_rows'"):
                tk.resize(2**62 + 4)
            with pytest.raises(ValueError, match="argument 'max_rows'"):
                tk.resize(True)
            peer_mod._TEST_HOOK = _refuse_probe
            try:
                with pytest.raises(RuntimeError, match="PeerArena creation failed at step 'probe"):
                    tk.resize(16)
            finally:
                peer_mod._TEST_HOOK = None
            assert tk.peer and tk.handle == handle and tk.max_rows == 2 and tk.physical_bytes == physical
            assert handle in torch.ops.sdcp.workspace_handles()
            assert torch.equal(tk.merge(s2, i2), want2)
            tk.resize(16)
            assert tk.max_rows == 16 and tk.handle != handle and handle not in torch.ops.sdcp.workspace_handles()
            assert torch.equal(tk.merge(s3, i3), want3)

    # Rows above max_rows: the collective path by default, an error with rows_fallback=False.
    with torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, **HOST) as tk:
        assert tk.rows_fallback and torch.equal(tk.merge(s3, i3), want3)
    with torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, rows_fallback=False, **HOST) as tk:
        with pytest.raises(ValueError, match=r"argument 'scores': expected at most max_rows = 2 rows \(this "
                                             r"TopKWorkspace was created with rows_fallback=False\), got 3"):
            tk.merge(s3, i3)
        expect_poisoned(tk, lambda: tk.merge(s2, i2))  # an error inside a call: re-create the workspace
        tk.resize(2)
        assert torch.equal(tk.merge(s2, i2), want2)
    with torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, rows_fallback=False, **HOST) as olse, \
            pytest.raises(ValueError, match="argument 'partial_out': expected at most max_rows = 2 rows"):
        olse.combine(po, pl)
    return True


def test_closed_resize_arguments_and_rows_fallback():
    assert run_workers(_calls_worker, 2, timeout=120) == [True, True]


def _one_rank_resize_worker(rank, world):
    """A resize refused on rank 1 only (a bad max_rows, a layout too large, an
    open view): rank 1 raises its own error, rank 0 the same error naming rank
    1, both at once (not after timeout_s = 30 s); the workspaces stay as they
    were, and the next calls and resizes pair."""
    import torch_sdcp
    from torch_sdcp import reference

    every = [rank_candidates(2, 8, seed=r) for r in range(world)]
    want = reference.topk_merge_ref(every, 4)
    out = {}
    with torch_sdcp.TopKWorkspace(None, 4, 4, candidates_per_rank=8, timeout_s=30, **HOST) as tk:
        handle = tk.handle
        for bad, text in ((0, "expected a positive int, got 0"), (True, "got True"),
                          (2**39, "expected a workspace region of at most")):
            t0 = time.monotonic()
            with pytest.raises(ValueError) as raised:
                tk.resize(bad if rank == 1 else 8)
            out[f"max_rows={bad}"] = time.monotonic() - t0
            own = "torch_sdcp: argument 'max_rows': "
            if rank == 0:
                own = "torch_sdcp: PeerArena creation failed at step 'validate': rank 1: " + own
            assert str(raised.value).startswith(own) and text in str(raised.value), str(raised.value)
            assert tk.handle == handle and tk.max_rows == 4 and not tk.poisoned
            assert torch.equal(tk.merge(*every[rank]), want)
        tk.resize(8)
        assert tk.max_rows == 8 and torch.equal(tk.merge(*every[rank]), want)
    q = make_query(2, 2, nope=28, rope=4, max_pos=8, seed=rank)
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=30, **HOST) as qw:
        want_q = qw.gather(*q).clone()
        qw.gather_view(*q)
        if rank == 0:
            qw.release()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=("" if rank == 1 else "PeerArena creation failed at step 'validate': "
                                                "rank 1: ") + "torch_sdcp: QueryWorkspace.resize: a view from "
                                               r"gather_view\(\) is still open"):
            qw.resize(8)
        out["open view"] = time.monotonic() - t0
        if rank == 1:
            qw.release()
        assert qw.max_rows == 4 and not qw.poisoned and torch.equal(qw.gather(*q), want_q)
        qw.resize(8)
        assert qw.max_rows == 8 and torch.equal(qw.gather(*q), want_q)
    return out


def test_a_resize_refused_on_one_rank_raises_on_every_rank_at_once():
    for rank, took in enumerate(run_workers(_one_rank_resize_worker, 2, timeout=150)):
        assert max(took.values()) < 5.0, (rank, took)  # not timeout_s = 30 s


def _one_rank_differs_worker(rank, world):
    """What one rank's calls can do that the call header does or does not
    tell (docs/PROTOCOL.md "What remains undetectable"): two calls of one
    shape made in another order on rank 1 both return on every rank without
    an error, each paired with the peer's other call (no call tag); rows over
    max_rows on rank 0 only with rows_fallback=False: rank 0 raises its
    ValueError and rank 1 names it at once (not after timeout_s = 30 s), both
    poisoned."""
    import torch_sdcp
    from torch_sdcp import reference

    g = torch.Generator().manual_seed(3)
    outs, lses = torch.randn(2, world, 2, 8, 64, generator=g), torch.randn(2, world, 2, 8, generator=g)

    def which(r, i):  # the input of rank r's call i: rank 1 swaps them
        return i if r == 0 else 1 - i

    with torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.float32, timeout_s=30, **HOST) as ws:
        got = [ws.combine(outs[which(rank, i), rank], lses[which(rank, i), rank]) for i in range(2)]
        assert not ws.poisoned
        ws.check()
        for i in range(2):
            paired = [which(r, i) for r in range(world)]
            want, want_lse = reference.lse_combine_ref64(torch.stack([outs[c, r] for r, c in enumerate(paired)]),
                                                         torch.stack([lses[c, r] for r, c in enumerate(paired)]))
            want, _ = reference.output_lse_shard(want, want_lse, rank, world)
            torch.testing.assert_close(got[i].double(), want, rtol=1e-4, atol=1e-4)
    out = {}
    with torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.float32, timeout_s=30, rows_fallback=False,
                                       **HOST) as ws:
        rows = 6 if rank == 0 else 2
        po, pl = torch.randn(rows, 8, 64, generator=g), torch.randn(rows, 8, generator=g)
        too_many = "argument 'partial_out': expected at most max_rows = 4 rows"
        t0 = time.monotonic()
        if rank == 0:
            with pytest.raises(ValueError, match=too_many):
                ws.combine(po, pl)
        else:
            with pytest.raises(RuntimeError, match=rf"peer 0 aborted.*\[rank 0: ValueError: torch_sdcp: {too_many}"):
                ws.combine(po, pl)
        out["rows_s"] = time.monotonic() - t0
        assert ws.poisoned
    return out


def test_what_one_rank_can_do_that_the_call_header_does_or_does_not_tell():
    for rank, r in enumerate(run_workers(_one_rank_differs_worker, 2, timeout=120)):
        assert r["rows_s"] < 10.0, (rank, r)  # at once, not after timeout_s = 30 s


# ---------------------------------------------------------------------------
# 3: a workspace dropped without close() is released
# ---------------------------------------------------------------------------


def _arena_maps():
    with open("/proc/self/maps") as f:
        return sum("sdcp-arena" in line for line in f)


def _leak_worker(rank, world, count):
    import gc
    import os

    import torch_sdcp
    from torch_sdcp import _registry

    def make(i):
        kind = i % 4
        if kind == 0:
            return torch_sdcp.ExchangeWorkspace(None, 4096, **HOST)
        if kind == 1:
            return torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, **HOST)
        if kind == 2:
            return torch_sdcp.TopKWorkspace(None, 8, 16, **HOST)
        return torch_sdcp.QueryWorkspace(None, 8, 2, nope_dim=64, rope_dim=16, **HOST)

    for i in range(4):  # warm-up: the first creation sets up lazily allocated state
        make(i)
    gc.collect()
    assert torch.ops.sdcp.workspace_handles() == [] and _registry.handles() == []
    maps, fds = _arena_maps(), len(os.listdir("/proc/self/fd"))
    x = torch.full((4,), float(rank))
    for i in range(count):
        ws = make(i)
        if i % 50 == 0:
            assert ws.peer and _arena_maps() > maps
            if i % 4 == 0:
                assert torch.equal(ws.all_gather(x)[:, 0], torch.arange(world, dtype=torch.float32))
        if i % 20 == 7:
            ws.self_reference = ws  # a cycle: only the collector frees it
        del ws
    gc.collect()
    assert torch.ops.sdcp.workspace_handles() == [], torch.ops.sdcp.workspace_handles()
    assert _registry.handles() == []
    assert _arena_maps() == maps, (_arena_maps(), maps)
    assert len(os.listdir("/proc/self/fd")) <= fds
    # A view of a dropped workspace keeps its memory valid until the view goes.
    q = torch_sdcp.QueryWorkspace(None, 8, 2, nope_dim=64, rope_dim=16, **HOST)
    inbox = q.inbox
    inbox.view(torch.uint8).fill_(7)
    del q
    gc.collect()
    assert torch.ops.sdcp.workspace_handles() == [] and int(inbox.view(torch.uint8)[0, 0, 0]) == 7
    del inbox
    gc.collect()
    assert _arena_maps() == maps
    return True


def test_dropped_workspaces_are_released():
    assert run_workers(_leak_worker, 2, args=(200,), timeout=180) == [True, True]


# ---------------------------------------------------------------------------
# 5: one caller thread at a time
# ---------------------------------------------------------------------------


def _threads_worker(rank, world):
    import threading
    import time

    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp import reference

    control = dist.new_group([0, 1])  # orders the two ranks' steps, apart from the workspace
    every = [rank_candidates(2, 8, seed=r) for r in range(world)]
    want = reference.topk_merge_ref(every, 4)
    s, i = every[rank]
    every3 = [rank_candidates(3, 8, seed=10 + r) for r in range(world)]
    # A second thread's call while another is inside a call (on the peer path,
    # then the collective path) would leave this rank a call behind its peers:
    # it aborts the workspace on every rank, and no rank returns a result.
    for scores, ids in ((s, i), every3[rank]):
        ws = torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, timeout_s=60, **HOST)
        assert torch.equal(ws.merge(s, i), want)
        if rank == 0:
            result = {}

            def decode(ws=ws, scores=scores, ids=ids, result=result):
                try:
                    result["ids"] = ws.merge(scores, ids)
                except RuntimeError as e:
                    result["error"] = str(e)

            worker = threading.Thread(target=decode, name="decode-worker")
            worker.start()  # blocks inside merge() until rank 1 calls
            deadline = time.monotonic() + 30
            while ws._calls.caller is None and time.monotonic() < deadline:
                time.sleep(0.005)
            with pytest.raises(RuntimeError, match=r"TopKWorkspace on rank 0: merge\(\) from thread 'MainThread' "
                                                   r"\(id \d+\) while thread 'decode-worker' \(id \d+\) is inside "
                                                   r"merge\(\) on this workspace.*aborted on every rank"):
                ws.merge(scores, ids)
            worker.join(60)
            assert not worker.is_alive() and "ids" not in result, result
            assert "abort" in result["error"] or "poisoned" in result["error"], result
            dist.barrier(group=control)
        else:
            dist.barrier(group=control)
            with pytest.raises(RuntimeError, match=r"(peer 0 aborted|poisoned).*thread 'decode-worker'"):
                ws.merge(scores, ids)
        assert ws.poisoned
        ws.close()
    # Another thread, while no call is in flight, is fine.
    ws = torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, timeout_s=60, **HOST)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("ids", ws.merge(s, i)))
    worker.start()
    worker.join(60)
    assert torch.equal(result["ids"], want) and torch.equal(ws.merge(s, i), want)
    ws.close()
    return True


def test_one_caller_thread_at_a_time():
    assert run_workers(_threads_worker, 2, timeout=120) == [True, True]
