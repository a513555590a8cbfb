"""An output that overlaps an input in memory (docs/PROTOCOL.md "Void calls"):
``all_gather_heads(q, out=...)`` with ``q`` inside ``out``'s storage, and
``combine_out`` with ``out`` or ``out_lse`` over ``partial_out``,
``partial_lse`` or each other, is an argument error found before anything is
published: a void call on every rank (the rank that passed it raises a
ValueError naming both arguments, its peers VoidedCallError), and the next
calls pair and are right. Host backend, spawned gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import rank_partials

ROWS, HEADS, WIDTH = 3, 2, 16


def _query(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(ROWS, HEADS, WIDTH, generator=g).to(torch.bfloat16)


def _aliasing_cases(rank):
    """(name, call(ws), argument named): one call whose output overlaps an input, on rank 0."""
    def heads(ws):
        out = torch.empty(ROWS, 2 * HEADS, WIDTH, dtype=torch.bfloat16)
        q = out.view(-1)[:ROWS * HEADS * WIDTH].view(ROWS, HEADS, WIDTH)  # contiguous, inside out's storage
        q.copy_(_query(rank))
        return ws.all_gather_heads(q, out=out)

    def combine_out(which):
        def call(ws):
            po, pl = rank_partials(ROWS, seed=rank, heads=4, dim=WIDTH)
            out, out_lse = torch.empty(ROWS, 2, WIDTH, dtype=torch.bfloat16), torch.empty(ROWS, 2)
            if which == "out":  # contiguous, over the first rows of partial_out
                out = po.as_strided((ROWS, 2, WIDTH), (2 * WIDTH, WIDTH, 1))
            elif which == "out_lse":
                out_lse = pl.as_strided((ROWS, 2), (2, 1))
            else:  # the two outputs over each other
                flat = torch.empty(ROWS * 2 * WIDTH, dtype=torch.bfloat16)
                out = flat.view(ROWS, 2, WIDTH)
                out_lse = flat.view(torch.float32)[:2 * ROWS].view(ROWS, 2)
            return ws.combine_out(po, pl, out, out_lse)
        return call

    return [("all_gather_heads", "query", heads, "out"),
            ("combine_out over partial_out", "output_lse", combine_out("out"), "out"),
            ("combine_out over partial_lse", "output_lse", combine_out("out_lse"), "out_lse"),
            ("combine_out, out over out_lse", "output_lse", combine_out("both"), "out")]


def _aliasing_worker(rank, world):
    import torch_sdcp
    from torch_sdcp.workspaces import VoidedCallError

    options = {"timeout_s": 30, "backend": "host"}
    make = {"query": lambda: torch_sdcp.QueryWorkspace(None, 8, HEADS, nope_dim=WIDTH, rope_dim=0,
                                                      dtype=torch.bfloat16, **options),
            "output_lse": lambda: torch_sdcp.OutputLSEWorkspace(None, 8, 4, WIDTH, **options)}
    wrong = []
    for name, family, bad, arg in _aliasing_cases(rank):
        ws = make[family]()
        try:
            if rank == 0:
                bad(ws)
            else:  # the same call without aliasing
                if family == "query":
                    ws.all_gather_heads(_query(rank))
                else:
                    po, pl = rank_partials(ROWS, seed=rank, heads=4, dim=WIDTH)
                    ws.combine_out(po, pl, torch.empty(ROWS, 2, WIDTH, dtype=torch.bfloat16), torch.empty(ROWS, 2))
            wrong.append(f"{name}: no error on rank {rank}")
        except ValueError as e:
            if rank != 0 or f"argument '{arg}'" not in str(e) or "overlap" not in str(e):
                wrong.append(f"{name}: rank {rank}: {e}")
        except VoidedCallError as e:
            if rank == 0:
                wrong.append(f"{name}: rank 0: {e}")
        except RuntimeError as e:
            wrong.append(f"{name}: rank {rank}: {type(e).__name__}: {e}")
        if ws.poisoned:
            wrong.append(f"{name}: rank {rank}: poisoned")
        elif family == "query":  # the next call pairs and is right
            got = ws.all_gather_heads(_query(rank))
            want = torch.cat([_query(r) for r in range(world)], dim=1)
            if not torch.equal(got, want):
                wrong.append(f"{name}: rank {rank}: the next call is wrong")
        ws.close()
        dist.barrier()
    return wrong


def test_an_output_over_an_input_is_a_void_call():
    results = run_workers(_aliasing_worker, 2, timeout=240)
    assert results == [[], []], "\n".join(results[0] + results[1])
