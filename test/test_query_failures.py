"""Query family, its failures: a rank that stops mid-stream is named, call
mismatches raise on every rank naming both sides (0-row calls included), an
error inside a call poisons and aborts the peers, a position outside the
cache is reported (not trapped), creation compares the geometry; on the host
backend, on two GPUs and with ranks sharing one GPU."""

from __future__ import annotations

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import GPU_WORLD, expect_failure, make_query, rank_workspace_args, requires_gpus
from _query import as_bytes, expected_gather

from torch_sdcp import ops


def _stop_worker(rank, world, mode, stop_after):
    import time

    import torch.distributed as dist

    import torch_sdcp

    dist.barrier()  # creation is bounded by timeout_s too: start it together
    timeout = 1.0
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=12, rope_dim=4, backend="host", timeout_s=timeout) as ws:
        scale = torch.tensor([0.5])
        for i in range(stop_after + 1):
            if rank == world - 1 and i == stop_after:
                time.sleep(3 * timeout)  # stops mid-stream: every peer's next call names this rank
                return "stopped"
            q = make_query(3, 2, nope=12, rope=4, max_pos=8, seed=10 * i + rank)
            start = time.monotonic()
            try:
                if mode == "gather":
                    ws.gather(*q, scale)
                elif mode == "heads":
                    ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))
                else:
                    ws.gather_view(*q, scale)
                    ws.release()
            except RuntimeError as e:
                assert i == stop_after, f"call {i}: {e}"
                assert time.monotonic() - start < timeout + 1.0
                return str(e)
    raise AssertionError(f"rank {rank}: the call after the peer stopped returned")


@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_rank_that_stops_is_named_host(mode):
    world, stop_after = 3, 4
    results = run_workers(_stop_worker, world, args=(mode, stop_after), timeout=120)
    assert results[-1] == "stopped"
    for rank, msg in enumerate(results[:-1]):
        # Its own timeout, or another waiting rank's timeout relayed by the abort word.
        own = f"timeout: rank {rank} waited 1 s for peer {world - 1}" in msg
        relayed = "aborted: it timed out" in msg and f"rank {rank} waited for peer {world - 1}" in msg
        assert own or relayed, msg
        # The call header of the call it never made (or, relayed, a peer's data wait).
        assert "'s call header (query workspace" in msg or "'s data (query workspace" in msg, msg
        if mode == "view":
            assert f"view buffer, view call {stop_after}" in msg, msg
        else:  # the copying calls
            assert f"buffer {stop_after % 2}, call {stop_after})" in msg, msg


def _stop_cuda_worker(rank, world):
    import ctypes
    import os
    import time

    import torch.distributed as dist

    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.barrier()
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=56, rope_dim=8, backend="cuda", device=device,
                                   timeout_s=2.0) as ws:
        q = [x.to(device) for x in make_query(3, 2, nope=56, rope=8, max_pos=8, seed=rank)]
        ws.gather(*q)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == world - 1:
            time.sleep(6.0)
            return "stopped"
        start = time.monotonic()
        try:
            # The kernel records the timeout and returns (no trap); the host
            # raises at the next check or call.
            ws.gather(*q)
            torch.cuda.synchronize()
            ws.check()
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            ctypes.CDLL(None).fflush(None)  # the kernel's printf went to C stdout, this rank's log
            with open(os.readlink("/proc/self/fd/1")) as f:
                log = f.read()
            assert f"timeout: rank {rank} block" in log, log[-2000:]
            # Whichever wait ran out first: the peer's call header or its data.
            assert f"for peer {world - 1}'s data" in log or f"for peer {world - 1}'s call header" in log, log[-2000:]
            assert "buffer 1, call 1)" in log, log[-2000:]
            assert "poisoned" in str(e), str(e)
            assert elapsed < 5.0, elapsed
            torch.ones(4, device=device).sum().item()  # the context survived the timeout
            os._exit(0)  # the peer is gone: no teardown
        raise AssertionError("the call after the peer stopped returned and check() passed")


@requires_gpus(GPU_WORLD)
def test_rank_that_stops_is_named_cuda():
    results = run_workers(_stop_cuda_worker, GPU_WORLD, timeout=120, may_die=tuple(range(GPU_WORLD - 1)))
    assert results[-1] == "stopped"


# ---------------------------------------------------------------------------
# Per-call agreement, poisoning and aborts: every query call carries a call
# header (rows, dtype, op, geometry); a mismatch raises on every rank naming
# both sides, an error inside a call poisons the workspace and aborts the
# peers. On CUDA the kernels record and return: the host raises at check().
# ---------------------------------------------------------------------------


def _rel_setup(rank, device):
    """Workspace arguments and tensor device of a test rank (_helpers.rank_workspace_args)."""
    dev = rank_workspace_args(rank, device)
    return dev, dev.get("device", torch.device("cpu"))


def _rel_query(t, seed, where, h=2, nope=28, rope=4):  # 32 fp8 bytes per head: whole 16-byte vectors
    return [x.to(where) for x in make_query(t, h, nope=nope, rope=rope, max_pos=16, seed=seed)]


def _query_mismatch_worker(rank, world, device):
    import re

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    rows = (2, 3)[rank]

    def gather(ws):
        return ws.gather(*_rel_query(rows, rank, where), scale)

    def heads(ws):
        return ws.all_gather_heads(ops.query_rope_quant(*_rel_query(rows, rank, where), scale,
                                                        out_dtype=torch.float8_e4m3fn))

    def view(ws):
        return ws.gather_view(*_rel_query(rows, rank, where), scale)

    both = "rank 0 called with 2 rows, rank 1 with 3 rows"
    cases = [  # (rank 0's call, rank 1's call, expected text)
        (gather, gather, r"call mismatch \(query workspace \d+, buffer 1, call 1\): " + re.escape(both)),
        (heads, heads, r"call mismatch \(query workspace \d+, buffer 1, call 1\): " + re.escape(both)),
        (view, view, r"call mismatch \(query workspace \d+, view buffer, view call 1\): " + re.escape(both)),
    ]
    for call0, call1, match in cases:
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            good = _rel_query(2, 10 + rank, where)
            if call0 is view:  # a good call first: the workspace works
                ws.gather_view(*good, scale)
                ws.release()
            else:
                ws.gather(*good, scale)
            expect_failure(ws, device, lambda: (call0, call1)[rank](ws), match)
    # Different ops on the two ranks, same rows.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
        q = _rel_query(2, rank, where)
        op = ((lambda: ws.gather(*q, scale)) if rank == 0 else
              (lambda: ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))))
        expect_failure(ws, device, op, "call mismatch .*rank 0 called with query_gather \\(interleaved RoPE, with "
                        "q_scale\\), rank 1 with query_all_gather_heads")
    # A copying call against a view call (their headers and buffers differ):
    # named on both ranks, whichever kind each rank made, not a timeout.
    for kinds in (("gather", "view"), ("view", "heads")):
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            q = _rel_query(2, rank, where)
            op = {"gather": lambda: ws.gather(*q, scale), "view": lambda: ws.gather_view(*q, scale),
                  "heads": lambda: ws.all_gather_heads(ops.query_rope_quant(*q, scale, out_dtype=torch.float8_e4m3fn))}
            named = {"gather": "query_gather \\(interleaved RoPE, with q_scale\\)", "heads": "query_all_gather_heads",
                     "view": "query_publish \\(interleaved RoPE, with q_scale\\)"}
            expect_failure(ws, device, op[kinds[rank]],
                            f"call mismatch .*rank 0 called with {named[kinds[0]]}, rank 1 with {named[kinds[1]]}")
    # The dtype: the op checks element sizes only, the header carries the dtype.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=32, rope_dim=0, dtype=torch.bfloat16, timeout_s=60,
                                   **dev) as ws:
        q = torch.ones(2, 2, 32, dtype=(torch.bfloat16, torch.float16)[rank], device=where)
        expect_failure(ws, device, lambda: ops.query_all_gather_heads(q, ws.handle),
                        "call mismatch .*rank 0 called with dtype BFloat16, rank 1 with dtype Half")
    # Re-created workspaces work.
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
        inputs = [_rel_query(2, 20 + r, "cpu") for r in range(world)]
        for x in inputs[1:]:
            x[2], x[3] = inputs[0][2], inputs[0][3]
        got = ws.gather(*[x.to(where) for x in inputs[rank]], scale).cpu()
        want = expected_gather(inputs, scale.cpu(), "interleaved", torch.float8_e4m3fn)
        assert torch.equal(as_bytes(got), as_bytes(want))
        ws.check()
    if device != "host":
        assert torch.ones(4, device=where).sum().item() == 4.0  # the context is alive
    return True


def test_query_mismatched_calls_raise_on_every_rank_naming_both_sides():
    assert run_workers(_query_mismatch_worker, 2, args=("host",), timeout=240) == [True, True]


def _query_zero_rows_worker(rank, world, device):
    """A call of 0 rows is a call on every op: made by every rank between
    others, it pairs (the results before and after it are right); made by one
    rank while another has rows, it is a rows mismatch named on both ranks."""
    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5])
    fp8 = torch.float8_e4m3fn

    def inputs(t, seed):
        per_rank = [_rel_query(t, seed * 10 + r, "cpu") for r in range(world)]
        for x in per_rank[1:]:
            x[2], x[3] = per_rank[0][2], per_rank[0][3]  # positions and cache are the group's
        return per_rank

    calls = {  # op -> (make the call on this rank's inputs, its result)
        "gather": lambda ws, x: ws.gather(*x, scale.to(where)),
        "heads": lambda ws, x: ws.all_gather_heads(ops.query_rope_quant(*x, scale.to(where), out_dtype=fp8)),
        "view": lambda ws, x: ws.gather_view(*x, scale.to(where)),
    }
    for name, call in calls.items():
        with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=60, **dev) as ws:
            for i, t in enumerate((2, 0, 0, 3, 0, 1)):
                x = inputs(t, 30 + i)
                got = call(ws, [y.to(where) for y in x[rank]])
                assert got.shape == (t, 2 * world, 32), (name, i, got.shape)
                want = expected_gather(x, scale, "interleaved", fp8)
                assert torch.equal(as_bytes(got.cpu()), as_bytes(want)), f"rank {rank} {name} call {i} ({t} rows)"
                if name == "view":
                    ws.release()
            ws.check()
            rows = (0, 3)[rank]
            expect_failure(ws, device, lambda: call(ws, [y.to(where) for y in inputs(rows, 40)[rank]]),
                            "call mismatch .*rank 0 called with 0 rows, rank 1 with 3 rows")
    return True


@pytest.mark.parametrize("device", ["host", pytest.param("cuda_shared", marks=requires_gpus(1))])
def test_query_zero_row_calls_pair_and_mismatch(device):
    assert run_workers(_query_zero_rows_worker, 2, args=(device,), timeout=240) == [True, True]


def _query_caught_error_worker(rank, world, device, mode):
    """Rank 0 makes a call that raises after it was entered (bad input),
    catches it and carries on: its next call raises "poisoned"; rank 1, waiting
    in that call, raises at once naming rank 0's abort."""
    import time

    import torch.distributed as dist

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=120, **dev)
    q = _rel_query(2, rank, where)

    def call(args):
        if mode == "view":
            ws.gather_view(*args, scale)
            ws.release()
        elif mode == "heads":
            ws.all_gather_heads(ops.query_rope_quant(*args[:4], scale, out_dtype=torch.float8_e4m3fn)
                                if args[1].dtype == torch.bfloat16 else args[0])
        else:
            ws.gather(*args, scale)

    call(q)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)  # rank 1 is waiting in its call by now
        # No tensor tells the rows (a list for the query): no void
        # placeholder, so the call poisons (an argument error with one is a
        # void call instead).
        bad = [q[0].tolist(), q[1].float(), q[2], q[3]]
        with pytest.raises(ValueError, match="'ql_nope'|'q'"):
            call(bad)
        with pytest.raises(RuntimeError, match="on rank 0 is poisoned"):
            call(q)  # carries on: refused
    else:
        t0 = time.monotonic()
        match = "peer 0 aborted: a call raised an error on that rank"
        if device != "host":
            call(q)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match=match):
                ws.check()
        else:
            with pytest.raises(RuntimeError, match=match):
                call(q)
        assert time.monotonic() - t0 < 30  # at once, not after the 120 s timeout
    assert ws.poisoned
    with pytest.raises(RuntimeError, match="is poisoned"):
        ws.check()
    ws.close()
    return True


@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_query_caught_error_poisons_and_aborts_the_peer(mode):
    assert run_workers(_query_caught_error_worker, 2, args=("host", mode), timeout=180) == [True, True]


def _query_bad_position_worker(rank, world, device):
    """A position outside cos_sin_cache on rank 0: the host backend raises at
    once (ValueError, naming the row) before it publishes anything, a void
    call (rank 1 raises VoidedCallError, nothing is poisoned); CUDA records it
    in the kernel (no trap), after publishing, and raises at the next check(),
    and rank 1 learns rank 0's abort."""
    import torch.distributed as dist

    import torch_sdcp

    dev, where = _rel_setup(rank, device)
    scale = torch.tensor([0.5]).to(where)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, timeout_s=120, **dev)
    q = _rel_query(2, rank, where)
    ws.gather(*q, scale)
    if rank == 0:
        q[2] = torch.tensor([3, 99], dtype=q[2].dtype, device=where)
        if device != "host":
            ws.gather(*q, scale)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match=r"bad input on rank 0 block 0 \(query workspace \d+, buffer 1, "
                                                   r"call 1\): argument 'positions': expected values in \[0, 16\) "
                                                   r".*got 99 at row 1"):
                ws.check()
        else:
            with pytest.raises(ValueError, match=r"'positions'.*99 at row 1"):
                ws.gather(*q, scale)
            assert not ws.poisoned
            ws.close()
            return True
    elif device == "host":
        with pytest.raises(torch_sdcp.VoidedCallError, match=r"rank 0 voided call.*'positions'.*99 at row 1"):
            ws.gather(*q, scale)
        assert not ws.poisoned
        ws.close()
        return True
    else:
        match = "peer 0 aborted: a (kernel on that rank met bad input|call raised an error on that rank)"
        if device != "host":
            ws.gather(*q, scale)
            torch.cuda.synchronize()
            ws.gather(*q, scale)  # learns a peer's abort at the latest in its next kernel
            torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=match):
            ws.check() if device != "host" else ws.gather(*q, scale)
    dist.barrier()
    assert ws.poisoned
    ws.close()
    if device != "host":
        assert torch.ones(4, device=where).sum().item() == 4.0  # no trap: the context is alive
    return True


def test_query_bad_position_poisons_and_aborts_the_peer():
    assert run_workers(_query_bad_position_worker, 2, args=("host",), timeout=180) == [True, True]


def _query_creation_agreement_worker(rank, world, device):
    import torch_sdcp
    from torch_sdcp.peer.plan import RankMismatchError

    dev, where = _rel_setup(rank, device)
    cases = [
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2 + 2 * rank, **dev), r"'local_heads' \(rank 0: 2, rank 1: 4\)"),
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, rope_style=("interleaved", "neox")[rank], **dev),
         r"'rope_style' \(rank 0: 'interleaved', rank 1: 'neox'\)"),
        (lambda: torch_sdcp.QueryWorkspace(None, 4, 2, dtype=(torch.float8_e4m3fn, torch.bfloat16)[rank], **dev),
         r"'dtype' \(rank 0: 'torch.float8_e4m3fn', rank 1: 'torch.bfloat16'\)"),
    ]
    for make, match in cases:
        with pytest.raises(RankMismatchError, match=f"expected the same value on every rank.*{match}"):
            make()
    with torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=28, rope_dim=4, **dev) as ws:  # still in step
        ws.gather(*_rel_query(2, rank, where), torch.tensor([0.5]).to(where))
        ws.check()
        assert not ws.poisoned
    return True


def test_query_creation_compares_the_geometry_across_ranks():
    assert run_workers(_query_creation_agreement_worker, 2, args=("host",), timeout=120) == [True, True]


@requires_gpus(2)
def test_query_cuda_mismatched_calls_raise_on_every_rank():
    assert run_workers(_query_mismatch_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
@pytest.mark.parametrize("mode", ["gather", "heads", "view"])
def test_query_cuda_caught_error_poisons_and_aborts_the_peer(mode):
    assert run_workers(_query_caught_error_worker, 2, args=("cuda", mode), timeout=300) == [True, True]


@requires_gpus(2)
def test_query_cuda_bad_position_is_reported_not_trapped():
    assert run_workers(_query_bad_position_worker, 2, args=("cuda",), timeout=300) == [True, True]


@requires_gpus(2)
def test_query_cuda_creation_compares_the_geometry_across_ranks():
    assert run_workers(_query_creation_agreement_worker, 2, args=("cuda",), timeout=300) == [True, True]


# Both ranks on one GPU (time-sliced): the CUDA failure paths where one GPU is
# all there is.
@requires_gpus(1)
@pytest.mark.parametrize("worker,args", [(_query_mismatch_worker, ()), (_query_caught_error_worker, ("gather",)),
                                         (_query_caught_error_worker, ("heads",)),
                                         (_query_caught_error_worker, ("view",)),
                                         (_query_bad_position_worker, ())],
                         ids=["mismatch", "caught_gather", "caught_heads", "caught_view", "bad_position"])
def test_query_cuda_two_ranks_on_one_gpu(worker, args):
    assert run_workers(worker, 2, args=("cuda_shared", *args), timeout=300) == [True, True]


# Four ranks on one GPU, in one spawn: rank 0's error inside a gather, then its
# position outside the cache (met by the kernel), reach the three ranks waiting.
@requires_gpus(1)
def test_query_cuda_four_ranks_shared_gpu():
    steps = ((_query_caught_error_worker, ("cuda_shared", "gather")), (_query_bad_position_worker, ("cuda_shared",)))
    assert run_workers(in_turn, 4, args=steps, timeout=180) == [[True, True]] * 4
