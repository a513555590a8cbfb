"""The collective path of a call over ``max_rows`` (docs/PROTOCOL.md "Failure
behaviour", "Rows fallback"): its store agreement compares what the peer
path's call header compares, so both paths refuse the same calls naming the
same difference (the LSE base of ``combine``, a ``q_scale`` on one rank only
of ``gather``), and no rank returns a result of calls that differ. Host
backend, spawned gloo ranks."""

from __future__ import annotations

import re

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
