"""Refusals on one rank of two (host backend) keep every rank in step, or
poison and abort on every rank: no rank ever returns a wrong result without
an error (docs/PROTOCOL.md "Failure behaviour").

- An argument error that the peer op finds (a non-contiguous tensor, a
  dtype, an ``out`` shape, a list where a tensor belongs) or that Python finds
  (``lse_base="10"``, a misspelt keyword) is a void call on every peer op of
  every family (the cross-family table, _family_calls.py): the
  bad rank raises its own ValueError/TypeError, the peer raises
  VoidedCallError naming it, and the next good calls pair and are right.
- A void call pairs with a peer's call of other options (the LSE base,
  whether a ``q_scale`` was given; on the peer path and from a call over
  ``max_rows``): void on every rank, nothing poisoned; the op is still
  compared (a void gather against an all_gather_heads is a call mismatch).
- A view call while the last view is still open, and a call from a second
  thread while another is inside a call, poison and abort on every rank (each
  rank raises a named error).
- A release() with no view open is refused without any effect: the next
  calls pair and are right.
"""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_workers
from _family_calls import ROWS, op_calls
from _helpers import HOST, make_query, rank_candidates, rank_partials


def _families(rank):
    """name: (create, good call, [(what, bad call, error, the argument it names)]):
    every peer op of every family with a void call (the cross-family table,
    _family_calls.py), and a combine in base 2."""
    import torch_sdcp

    table = op_calls(rank)
    families = {op: (calls.make, calls.good, list(calls.void)) for op, calls in table.items() if calls.void}
    po, pl = rank_partials(ROWS, seed=rank)
    families["output_lse_combine base 2"] = (
        lambda: torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=60, **HOST),
        lambda ws: ws.combine(po, pl, lse_base="2"), [
            # The placeholder takes the call's valid base, not the default (it would pair with
            # any: test_a_void_call_pairs_with_a_call_of_other_options).
            ("a misspelt keyword beside lse_base '2'",
             lambda ws: ws.combine(po, pl, lse_base="2", retrun_lse=True), TypeError, None),
        ])
    return families


def _void_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    torch.set_num_threads(1)
    wrong = []
    for name, (make, good, bad_calls) in _families(rank).items():
        ws = make()
        want = good(ws).clone()  # the same inputs give this result again while the ranks pair
        for what, bad, error, arg in bad_calls:
            case = f"{name}: {what}"
            dist.barrier()
            t0 = time.monotonic()
            try:
                if rank == 1:
                    match = f"argument '{arg}'" if arg is not None else "unexpected keyword argument"
                    with pytest.raises(error, match=match):
                        bad(ws)
                else:
                    with pytest.raises(torch_sdcp.VoidedCallError, match="rank 1 voided call") as raised:
                        good(ws)
                    assert f"[rank 1: {error.__name__}: torch_sdcp:" in str(raised.value), str(raised.value)
                assert time.monotonic() - t0 < 30
                assert not ws.poisoned
                ws.check()
                assert torch.equal(good(ws), want), "the next good call is wrong"
            except Exception as e:
                wrong.append(f"{case}: {type(e).__name__}: {e}")
                if ws.poisoned:  # the ranks are no longer paired on this workspace: the next family's
                    break
        ws.close()
        dist.barrier()
    return wrong


def test_refusals_before_publishing_are_void_calls_on_every_family():
    results = run_workers(_void_worker, 2, timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _open_view_worker(rank, world, second):
    """Rank 1 makes ``second`` while its last view is still open: every rank
    raises a named error, none returns a result of a mis-paired call."""
    import torch.distributed as dist

    import torch_sdcp

    q = make_query(ROWS, 2, nope=64, rope=16, max_pos=8, seed=rank)
    scale = torch.ones(1)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=64, rope_dim=16, timeout_s=60, **HOST)
    ws.gather_view(*q, scale)
    if rank == 0:  # before rank 1's abort: a release that met it would raise the abort instead
        ws.release()
    dist.barrier()
    if rank == 1:
        call = {"gather_view": lambda: ws.gather_view(*q, scale), "gather": lambda: ws.gather(*q, scale),
                "all_gather_heads": lambda: ws.all_gather_heads(torch.zeros(ROWS, 2, 80, dtype=ws.dtype))}[second]
        with pytest.raises(RuntimeError, match=f"{second} on rank 1: the view returned by the last gather_view"
                                               r"\(\) is still open.*aborted on every rank"):
            call()
        assert ws.poisoned
    dist.barrier()
    if rank == 0:  # the next view call: the peer's abort, named, with its error
        with pytest.raises(RuntimeError, match=r"peer 1 aborted.*\[rank 1: RuntimeError: .*still open"):
            ws.gather_view(*q, scale)
    else:  # a caller that releases and goes on: poisoned, named
        with pytest.raises(RuntimeError, match="is poisoned: release"):
            ws.release()
        with pytest.raises(RuntimeError, match="is poisoned: gather_view"):
            ws.gather_view(*q, scale)
    assert ws.poisoned
    ws.close()
    return True


@pytest.mark.parametrize("second", ["gather_view", "gather", "all_gather_heads"])
def test_a_call_while_the_view_is_open_aborts_every_rank(second):
    assert run_workers(_open_view_worker, 2, args=(second,), timeout=120) == [True, True]


def _extra_release_worker(rank, world):
    """A release() with no view open (twice, or after a gather_view that
    raised) is refused and changes nothing: the next calls pair and are right."""
    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp import reference
    from torch_sdcp.workspaces.base import CallRefused

    qs = [make_query(ROWS, 2, nope=64, rope=16, max_pos=8, seed=r) for r in range(world)]
    scale = torch.ones(1)
    want = torch.cat([reference.query_rope_quant_ref(*q, scale, out_dtype=torch.float8_e4m3fn) for q in qs], 1)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=64, rope_dim=16, timeout_s=60, **HOST)
    for _ in range(3):
        view = ws.gather_view(*qs[rank], scale)
        assert torch.equal(view.view(torch.uint8), want.view(torch.uint8))
        ws.release()
        if rank == 1:
            with pytest.raises(CallRefused, match="release on rank 1: no view is open"):
                ws.release()
        assert not ws.poisoned
        assert torch.equal(ws.gather(*qs[rank], scale).view(torch.uint8), want.view(torch.uint8))
    dist.barrier()
    ws.check()
    ws.close()
    return True


def test_a_release_with_no_view_open_keeps_every_rank_in_step():
    assert run_workers(_extra_release_worker, 2, timeout=120) == [True, True]


def _no_placeholder_worker(rank, world, family):
    """A bad call with no tensor that tells its rows (or bytes) has no
    placeholder: it poisons and aborts on every rank, each naming the error."""
    import torch.distributed as dist

    import torch_sdcp

    scores, ids = rank_candidates(ROWS, 8, seed=rank)
    x = torch.arange(4, dtype=torch.float32)
    make, good, bad, arg = {
        "merge": (lambda: torch_sdcp.TopKWorkspace(None, 4, 4, candidates_per_rank=8, timeout_s=60, **HOST),
                  lambda ws: ws.merge(scores, ids), lambda ws: ws.merge(scores.tolist(), ids.tolist()), "scores"),
        "all_gather": (lambda: torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=60, **HOST),
                       lambda ws: ws.all_gather(x), lambda ws: ws.all_gather(x.tolist()), "x"),
    }[family]
    ws = make()
    good(ws)
    dist.barrier()
    if rank == 1:
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            bad(ws)
    else:
        with pytest.raises(RuntimeError, match=rf"peer 1 aborted.*\[rank 1: ValueError: torch_sdcp: argument '{arg}'"):
            good(ws)
    assert ws.poisoned
    ws.close()
    return True


@pytest.mark.parametrize("family", ["merge", "all_gather"])
def test_a_refusal_without_a_placeholder_aborts_every_rank(family):
    assert run_workers(_no_placeholder_worker, 2, args=(family,), timeout=120) == [True, True]


def _options_cases(rank):
    """(what, make, same(ws): a call every rank makes alike, then [rank 0's call, rank 1's call],
    [(the error each raises, what it says)]): a void call against a call of other options (the
    LSE base; the query's q_scale), on the peer path and from a call over max_rows."""
    import torch_sdcp

    po, pl = rank_partials(ROWS, seed=rank)
    over_out, over_lse = rank_partials(6, seed=rank)  # over max_rows = 4
    q = make_query(ROWS, 2, nope=64, rope=16, max_pos=8, seed=rank)
    nope, pe, pos, cache = q
    scale = torch.full((1,), 0.5)

    def lse():
        return torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=60, **HOST)

    def query():
        return torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=64, rope_dim=16, timeout_s=60, **HOST)

    def view(ws, *args):
        got = ws.gather_view(*args).clone()
        ws.release()
        return got

    def voided(by):
        return torch_sdcp.VoidedCallError, f"rank {by} voided call"

    base2 = lambda ws: ws.combine(po, pl, lse_base="2")  # noqa: E731
    rows = (ValueError, r"argument 'partial_out': expected 2 rows .* the call is void on every rank, and the "
                        "workspace stays usable")
    return [
        ("lse_base '10' against base 2", lse, base2, [base2, lambda ws: ws.combine(po, pl, lse_base="10")],
         [voided(1), (ValueError, "argument 'lse_base'")]),
        ("a misspelt lse_base keyword against base 2", lse, base2,
         [base2, lambda ws: ws.combine(po, pl, lse_bsae="2")],
         [voided(1), (TypeError, "unexpected keyword argument 'lse_bsae'")]),
        ("combine_out, lse_base '10' against base 2", lse, base2, [
            lambda ws: ws.combine_out(po, pl, torch.empty(ROWS, 4, 64, dtype=torch.bfloat16), torch.empty(ROWS, 4),
                                      lse_base="2"),
            lambda ws: ws.combine_out(po, pl, torch.empty(ROWS, 4, 64, dtype=torch.bfloat16), torch.empty(ROWS, 4),
                                      lse_base="10")],
         [voided(1), (ValueError, "argument 'lse_base'")]),
        # A call over max_rows voids with the peers' rows and its own base.
        ("over max_rows in base 2 against lse_base '10' within it", lse, base2,
         [lambda ws: ws.combine(over_out, over_lse, lse_base="2"), lambda ws: ws.combine(po, pl, lse_base="10")],
         [rows, (ValueError, "argument 'lse_base'")]),
        ("over max_rows in base 2 against base e within it", lse, base2,
         [lambda ws: ws.combine(over_out, over_lse, lse_base="2"), lambda ws: ws.combine(po, pl)],
         [rows, voided(0)]),
        ("gather, a misspelt q_scale keyword against a q_scale", query, lambda ws: ws.gather(*q, scale),
         [lambda ws: ws.gather(*q, scale), lambda ws: ws.gather(*q, q_scal=scale)],
         [voided(1), (TypeError, "unexpected keyword argument 'q_scal'")]),
        ("gather, a bad q_pe with a q_scale against none", query, lambda ws: ws.gather(*q, scale),
         [lambda ws: ws.gather(*q), lambda ws: ws.gather(nope, pe.float(), pos, cache, scale)],
         [voided(1), (ValueError, "argument 'q_pe'")]),
        ("gather_view, a misspelt q_scale keyword against a q_scale", query, lambda ws: view(ws, *q, scale),
         [lambda ws: view(ws, *q, scale), lambda ws: ws.gather_view(*q, q_scal=scale)],
         [voided(1), (TypeError, "unexpected keyword argument 'q_scal'")]),
    ]


def _options_worker(rank, world):
    import torch.distributed as dist

    import torch_sdcp

    torch.set_num_threads(1)
    wrong = []
    for what, make, same, calls, raises in _options_cases(rank):
        ws = make()
        try:
            want = same(ws).clone()
            dist.barrier()
            error, match = raises[rank]
            with pytest.raises(error, match=match) as raised:
                calls[rank](ws)
            if error is torch_sdcp.VoidedCallError:  # the voiding peer's own error, named
                assert f"[rank {1 - rank}: {raises[1 - rank][0].__name__}: " in str(raised.value), str(raised.value)
            assert "poisoned" not in str(raised.value), str(raised.value)
            assert not ws.poisoned
            ws.check()
            assert torch.equal(same(ws), want), "the next good call is wrong"
        except Exception as e:
            wrong.append(f"{what}: {type(e).__name__}: {e}")
        ws.close()
        dist.barrier()
    return wrong


def test_a_void_call_pairs_with_a_call_of_other_options():
    """A void placeholder takes the options it can (a valid LSE base, whether
    a q_scale was given); a peer's call of other options pairs with it all
    the same: every rank raises (the bad rank its own error, the peer
    VoidedCallError naming it), nothing is poisoned, the next calls are right."""
    results = run_workers(_options_worker, 2, timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _void_other_op_worker(rank, world):
    """A void gather against a peer's all_gather_heads (alike in rows, dtype
    and workspace): the op is still compared, a call mismatch on every rank."""
    import torch.distributed as dist

    import torch_sdcp

    nope, pe, pos, cache = make_query(ROWS, 2, nope=64, rope=16, max_pos=8, seed=rank)
    ws = torch_sdcp.QueryWorkspace(None, 4, 2, nope_dim=64, rope_dim=16, timeout_s=60, **HOST)
    dist.barrier()
    if rank == 1:
        with pytest.raises(ValueError, match="argument 'q_pe'"):
            ws.gather(nope, pe.float(), pos, cache)
    else:
        with pytest.raises(RuntimeError, match="call mismatch.*query_all_gather_heads.*query_gather"):
            ws.all_gather_heads(torch.zeros(ROWS, 2, 80, dtype=ws.dtype))
    assert ws.poisoned
    ws.close()
    return True


def test_a_void_call_still_compares_the_op():
    assert run_workers(_void_other_op_worker, 2, timeout=120) == [True, True]
