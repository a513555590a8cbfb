"""Calls and creations that disagree across ranks, on the host backend with
spawned gloo ranks: the calls of two families (Output/LSE and the exchange)
that disagree raise on every rank naming both sides, creation compares every
parameter, the aborting rank's error reaches every peer, every rank reports
its own argument error first, and a call that fails its checks is void on
every rank; on CUDA, the same mismatches and check() during graph capture."""

from __future__ import annotations

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
    rank_partials,
    rank_workspace_args,
    requires_gpus,
)

# ---------------------------------------------------------------------------
# Agreement across ranks: the calls of two families (Output/LSE and the
# exchange) that disagree raise on every rank; creation compares every
# parameter
# ---------------------------------------------------------------------------


def _mismatch_worker(rank, world, device):
    import torch_sdcp

    dev = rank_workspace_args(rank, device)

    def settle(ws):  # CUDA reports at the next host call or check(); the host backend at once
        if device != "host":
            torch.cuda.synchronize()
        return ws

    cases = [  # (what differs, rank 0's call, rank 1's call, expected text)
        ("rows", dict(rows=4), dict(rows=8), "rank 0 called with 4 rows, rank 1 with 8 rows"),
        ("base", dict(rows=2, lse_base="e"), dict(rows=2, lse_base="2"),
         "rank 0 called with lse base e, rank 1 with lse base 2"),
        ("rows0", dict(rows=0), dict(rows=3), "rank 0 called with 0 rows, rank 1 with 3 rows"),
    ]
    for name, *calls, text in cases:
        mine = calls[rank]
        with torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=60, **dev) as ws:
            po, pl = rank_partials(2, seed=rank)
            ws.combine(po.to(ws.device), pl.to(ws.device))  # a good call first: the workspace works
            po, pl = rank_partials(mine["rows"], seed=rank)
            t0 = time.monotonic()
            match = f"call mismatch .*{re.escape(text)}"
            if device != "host":
                ws.combine(po.to(ws.device), pl.to(ws.device), lse_base=mine.get("lse_base", "e"))
                settle(ws)  # the kernels end at once: neither rank waits for rows that never come
                with pytest.raises(RuntimeError, match=match):
                    ws.check()
            else:
                with pytest.raises(RuntimeError, match=match):
                    ws.combine(po, pl, lse_base=mine.get("lse_base", "e"))
            assert time.monotonic() - t0 < 30, name
            assert ws.poisoned
            expect_poisoned(ws, lambda: ws.combine(po.to(ws.device), pl.to(ws.device)))
            expect_poisoned(ws, ws.check)
    # dtype: the op checks element sizes only, the header carries the dtype
    with torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=60, **dev) as ws:
        dtype = torch.bfloat16 if rank == 0 else torch.float16
        po, pl = rank_partials(2, seed=rank, dtype=dtype)
        po, pl = po.to(ws.device), pl.to(ws.device)
        out, out_lse = torch.empty(2, 4, 64, dtype=dtype, device=ws.device), torch.empty(2, 4, device=ws.device)
        match = "call mismatch .*rank 0 called with dtype BFloat16, rank 1 with dtype Half"
        if device != "host":
            torch.ops.sdcp.output_lse_combine_out(po, pl, ws.handle, False, out, out_lse)
            settle(ws)
        else:
            with pytest.raises(RuntimeError, match=match):
                torch.ops.sdcp.output_lse_combine_out(po, pl, ws.handle, False, out, out_lse)
        with pytest.raises(RuntimeError, match=match):
            ws.check()
    # The exchange: bytes and dtype
    for x, text in (((torch.ones(4) if rank == 0 else torch.ones(8)),
                     "rank 0 called with 16 bytes, rank 1 with 32 bytes"),
                    ((torch.ones(4) if rank == 0 else torch.ones(4, dtype=torch.int32)),
                     "rank 0 called with dtype Float, rank 1 with dtype Int")):
        with torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=60, **dev) as ws:
            x = x.to(ws.device)
            match = f"call mismatch .*{re.escape(text)}"
            if device != "host":
                ws.all_gather(x)
                settle(ws)
                with pytest.raises(RuntimeError, match=match):
                    ws.check()
            else:
                with pytest.raises(RuntimeError, match=match):
                    ws.all_gather(x)
            expect_poisoned(ws, lambda: ws.all_gather(x))
    # Re-created workspaces work.
    with torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=60, **dev) as ws:
        got = ws.all_gather(torch.full((2,), float(rank), device=ws.device)).cpu()
        assert torch.equal(got, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        ws.check()
    if device != "host":
        assert torch.ones(4, device="cuda").sum().item() == 4.0  # the context is alive
    return True


def test_mismatched_calls_raise_on_every_rank_naming_both_sides():
    assert run_workers(_mismatch_worker, 2, args=("host",), timeout=180) == [True, True]


def _creation_agreement_worker(rank, world):
    import torch_sdcp
    from torch_sdcp.peer.plan import RankMismatchError

    cases = [
        (lambda: torch_sdcp.OutputLSEWorkspace(None, 4 + 4 * rank, 8, 64, **HOST),
         r"'max_rows' \(rank 0: 4, rank 1: 8\)"),
        (lambda: torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=(torch.bfloat16, torch.float16)[rank], **HOST),
         r"'dtype' \(rank 0: 'torch.bfloat16', rank 1: 'torch.float16'\)"),
        (lambda: torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, rows_fallback=rank == 0, **HOST),
         r"'rows_fallback' \(rank 0: True, rank 1: False\)"),
        (lambda: torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, fallback=True, **HOST) if rank == 0
         else torch_sdcp.TopKWorkspace(None, 4, 8, **HOST), r"'workspace' \(rank 0: 'OutputLSEWorkspace', rank 1: "
         r"'TopKWorkspace'\)"),
    ]
    for make, match in cases:
        with pytest.raises(RankMismatchError, match=f"expected the same value on every rank.*{match}"):
            make()
    with torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, **HOST) as ws:  # the ranks are still in step
        ws.check()
        po, pl = rank_partials(2, seed=rank)
        ws.combine(po, pl)
        ws.check()
        assert not ws.poisoned
    with pytest.raises(RuntimeError, match="is closed: check"):
        ws.check()
    return True


def test_creation_compares_every_parameter_across_ranks():
    assert run_workers(_creation_agreement_worker, 2, timeout=120) == [True, True]


# ---------------------------------------------------------------------------
# On 2 GPUs, and with both ranks on one GPU: failures are reported, not
# trapped (the context lives)
# ---------------------------------------------------------------------------


@requires_gpus(2)
def test_cuda_mismatched_calls_raise_on_every_rank():
    assert run_workers(_mismatch_worker, 2, args=("cuda",), timeout=300) == [True, True]


def _cuda_graph_check_worker(rank, world):
    import torch_sdcp

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    po, pl = (t.to(device) for t in rank_partials(4, seed=rank))
    with torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, device=device, timeout_s=60) as ws:
        ws.combine(po, pl)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = ws.combine(po, pl)
            ws.check()  # inside capture: reads host-mapped memory only
        for _ in range(5):
            graph.replay()
            ws.check()  # between replays, without synchronising
        torch.cuda.synchronize()
        ws.check()
        assert torch.isfinite(out).all()
    return True


@requires_gpus(2)
def test_cuda_check_during_capture_and_replay():
    assert run_workers(_cuda_graph_check_worker, 2, timeout=300) == [True, True]


# Both ranks on one GPU (time-sliced): the CUDA failure paths where one GPU is
# all there is.
@requires_gpus(1)
@pytest.mark.parametrize("worker", [_mismatch_worker], ids=lambda w: w.__name__.strip("_"))
def test_cuda_two_ranks_on_one_gpu(worker):
    assert run_workers(worker, 2, args=("cuda_shared",), timeout=300) == [True, True]


def _abort_note_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    po, pl = rank_partials(2, seed=rank)
    for how in ("abort", "bad input"):
        ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=120, **HOST)
        ws.combine(po, pl)
        dist.barrier()
        if rank == 0:
            time.sleep(0.5)  # the peers wait in their call by now
            if how == "abort":
                ws.abort("drained by the watchdog")
            else:  # no tensor tells the rows: no placeholder, so no void call
                with pytest.raises(ValueError, match="'partial_out'"):
                    ws.combine(po.tolist(), pl.tolist())
        else:
            want = ("[rank 0: abort(): drained by the watchdog]" if how == "abort"
                    else "[rank 0: ValueError: torch_sdcp: argument 'partial_out'")
            with pytest.raises(RuntimeError, match="peer 0 aborted") as raised:
                ws.combine(po, pl)
            assert want in str(raised.value), str(raised.value)
            with pytest.raises(RuntimeError) as checked:  # the poisoned workspace says it too
                ws.check()
            assert want in str(checked.value), str(checked.value)
        ws.close()
        dist.barrier()
    return True


def test_the_aborting_ranks_error_reaches_every_peer():
    """A rank's abort() reason, or the error of its failed call, is in the
    error of every peer that meets its abort word (left on the group's store
    before the abort words go out)."""
    assert run_workers(_abort_note_worker, 4, timeout=120) == [True] * 4


def _own_argument_first_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    po, pl = rank_partials(2, seed=rank)
    ws = torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=60, **HOST)
    ws.combine(po, pl)
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)  # rank 0's abort words are here first
    # Rank 0 aborts (its abort words reach rank 1 before its call), then every
    # rank makes the same bad call, found by the op: each reports its own
    # argument, not rank 0's abort.
    if rank == 0:
        ws.abort("rank 0 stops")
    with pytest.raises(ValueError, match="argument 'partial_lse': expected a contiguous tensor"):
        ws.combine(po, pl.t().contiguous().t())
    dist.barrier()
    assert ws.poisoned
    expect_poisoned(ws, lambda: ws.combine(po, pl))  # a good call on the poisoned workspace
    ws.close()
    return True


def test_every_rank_reports_its_own_argument_error_first():
    """Arguments are checked before health: the rank that makes the same bad
    call after its peer's failure reached it still names its own argument."""
    assert run_workers(_own_argument_first_worker, 2, timeout=120) == [True, True]


def _void_call_worker(rank, world, mode):
    """A call that fails its argument checks before it reaches its op (a
    wrong dtype, arguments that do not bind to the method, meta tensors) is
    a void call: rank 0 raises its own error and its workspace stays usable;
    every peer's same call raises VoidedCallError naming rank 0 and its
    error; the next calls pair as before (the same inputs give the same
    results on every rank). When every rank makes a bad call, each raises
    its own error and nothing is poisoned. On CUDA the peers' error comes at
    the end of a later call or from check(), once the kernel ran."""
    import torch.distributed as dist

    import torch_sdcp

    dev = rank_workspace_args(rank, mode)
    where = dev.get("device", torch.device("cpu"))
    po, pl = (t.to(where) for t in rank_partials(2, seed=rank))
    scores, ids = (t.to(where) for t in rank_candidates(2, 8, seed=rank))
    fp8_q = torch.full((2, 2, 32), 0.5 * (rank + 1)).to(torch.float8_e4m3fn).to(where)
    query = [t.to(where) for t in make_query(2, 2, nope=28, rope=4, max_pos=16, seed=rank)]

    def view(ws, *args, **kwargs):
        out = ws.gather_view(*args, **kwargs).clone()
        ws.release()
        return out

    families = {  # name: (create, good call, bad calls (call, error, text))
        "combine": (lambda: torch_sdcp.OutputLSEWorkspace(None, 8, 8, 64, timeout_s=60, **dev),
                    lambda ws: ws.combine(po, pl),
                    [(lambda ws: ws.combine(po, pl, lse_bse="e"), TypeError, "unexpected keyword argument"),
                     (lambda ws: ws.combine(po.to("meta"), pl.to("meta")), ValueError, "got a tensor on meta"),
                     (lambda ws: ws.combine(po.half(), pl), ValueError, "'partial_out': expected dtype")]),
        "merge": (lambda: torch_sdcp.TopKWorkspace(None, 8, 4, candidates_per_rank=8, timeout_s=60, **dev),
                  lambda ws: ws.merge(scores, ids),
                  [(lambda ws: ws.merge(scores), TypeError, "missing 1 required"),
                   (lambda ws: ws.merge(scores, ids.to("meta")), ValueError, "got a tensor on meta")]),
        "all_gather_heads": (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60,
                                                               **dev),
                             lambda ws: ws.all_gather_heads(fp8_q),
                             [(lambda ws: ws.all_gather_heads(fp8_q, outt=None), TypeError, "unexpected keyword"),
                              (lambda ws: ws.all_gather_heads(fp8_q.float()), ValueError, "'q': expected dtype")]),
        "gather": (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev),
                   lambda ws: ws.gather(*query),
                   [(lambda ws: ws.gather(*query, scale=None), TypeError, "unexpected keyword"),
                    (lambda ws: ws.gather(query[0].to("meta"), *query[1:]), ValueError, "got a tensor on meta")]),
        "gather_view": (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60,
                                                          **dev),
                        lambda ws: view(ws, *query),
                        [(lambda ws: view(ws, *query, scale=None), TypeError, "unexpected keyword")]),
        "all_gather": (lambda: torch_sdcp.ExchangeWorkspace(None, 256, timeout_s=60, **dev),
                       lambda ws: ws.all_gather(po[0, 0]),
                       [(lambda ws: ws.all_gather(x=po[0, 0], y=1), TypeError, "unexpected keyword"),
                        (lambda ws: ws.all_gather(po[0, 0].to("meta")), ValueError, "got a tensor on meta")]),
    }
    for name, (make, good, bad_calls) in families.items():
        ws = make()
        want = good(ws)  # the same inputs give this result again on every rank while the ranks pair
        for bad, error, text in bad_calls:
            dist.barrier()
            t0 = time.monotonic()
            if rank == 0:
                with pytest.raises(error, match=text):
                    bad(ws)
            else:
                with pytest.raises(torch_sdcp.VoidedCallError, match="rank 0 voided call") as raised:
                    good(ws)
                    if mode != "host":  # the kernel records the void; a later call's end or check() says so
                        torch.cuda.synchronize()
                        ws.check()
                assert f"[rank 0: {error.__name__}: torch_sdcp:" in str(raised.value), (name, str(raised.value))
            assert time.monotonic() - t0 < 30, name
            assert not ws.poisoned, name
            ws.check()
            assert torch.equal(good(ws).cpu(), want.cpu()), name
        # Every rank's call is bad: each reports its own error, nothing is poisoned.
        bad, error, text = bad_calls[0]
        with pytest.raises(error, match=text):
            bad(ws)
        if mode != "host":
            torch.cuda.synchronize()
        ws.check()
        assert torch.equal(good(ws).cpu(), want.cpu()), name
        ws.close()
        dist.barrier()
    return True


@pytest.mark.parametrize("mode,world", [("host", 4), pytest.param("cuda_shared", 2, marks=requires_gpus(1))])
def test_a_call_that_fails_its_checks_is_void_on_every_rank(mode, world):
    assert run_workers(_void_call_worker, world, args=(mode,), timeout=300) == [True] * world
