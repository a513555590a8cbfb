"""The cross-family call table of the tests, keyed by peer op: for every peer
op of every family (``torch_sdcp.families.FAMILIES``, ``Family.peer_ops``)
the workspace it runs on, one good call through that workspace, the argument
errors its workspace method refuses before publishing (void calls) and those
the op itself refuses (straight through ``torch_sdcp.ops``).

test_call_tags.py, test_void_calls.py and test_op_arguments.py run every row;
test_family_table.py fails when a peer op of the table has no row here, so a
new family cannot go uncovered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from _helpers import make_query, rank_candidates, rank_partials, rank_workspace_args

from torch_sdcp.families import FAMILIES

ROWS = 2
MAX_ROWS = 4


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dimensions' strides swapped (same values, not contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


class OpCalls(NamedTuple):
    """One peer op's row of the table (on one rank)."""

    #: The op's workspace on this rank (every op of a family makes the same one).
    make: Callable[[], Any]
    #: ``good(ws, **tag)``: the op through its workspace method, its result as a tensor.
    good: Callable[..., torch.Tensor]
    #: (what, ``bad(ws)``, the error, the argument it names or None): refused by the
    #: workspace method before anything is published, a void call for the peers.
    void: tuple[tuple[str, Callable[[Any], Any], type, str | None], ...]
    #: (what, the argument the error names, ``bad(ws)``): refused by the op itself
    #: (``torch_sdcp.ops``, the workspace's handle), before it publishes anything.
    arguments: tuple[tuple[str, str, Callable[[Any], Any]], ...]


#: Every peer op of every family, in family order: what the table must cover.
PEER_OPS = tuple(op for family in FAMILIES for op in family.peer_ops)

#: Why an op has no void call: release() takes no argument to refuse (a
#: release with no view open is refused with no effect: test_void_calls.py).
NO_VOID_CALL = {"query_release": "release() takes no argument"}


def op_calls(rank: int, mode: str = "host") -> dict[str, OpCalls]:
    """The table on rank ``rank``. Every rank's inputs are alike in shape, so
    calls of one op pair by shape alone. ``mode``: "host", "cuda" or
    "cuda_shared" (_helpers.rank_workspace_args)."""
    import torch_sdcp
    from torch_sdcp import ops

    opts = {"timeout_s": 60, **rank_workspace_args(rank, mode)}
    where = opts.get("device", torch.device("cpu"))
    nope, pe, pos, cache = (t.to(where) for t in make_query(ROWS, 2, nope=64, rope=16, max_pos=8, seed=rank))
    scale = torch.full((1,), 0.5, device=where)
    q = torch.full((ROWS, 2, 80), 0.25 * (rank + 1)).to(torch.float8_e4m3fn).to(where)
    scores, ids = (t.to(where) for t in rank_candidates(ROWS, 8, seed=rank))
    po, pl = (t.to(where) for t in rank_partials(ROWS, seed=rank))
    out, out_lse = torch.empty(ROWS, 4, 64, dtype=torch.bfloat16, device=where), torch.empty(ROWS, 4, device=where)
    x = torch.arange(8, dtype=torch.float32, device=where).view(2, 4) + 10 * rank
    q_out = torch.float8_e4m3fn
    over = 3  # ROWS * over rows: above MAX_ROWS

    def query():
        return torch_sdcp.QueryWorkspace(None, MAX_ROWS, 2, nope_dim=64, rope_dim=16, **opts)

    def topk():
        return torch_sdcp.TopKWorkspace(None, MAX_ROWS, 4, candidates_per_rank=8, **opts)

    def output_lse():
        return torch_sdcp.OutputLSEWorkspace(None, MAX_ROWS, 8, 64, **opts)

    def exchange():
        return torch_sdcp.ExchangeWorkspace(None, 64, **opts)

    def view(ws, *args, **kwargs):
        got = ws.gather_view(*args, **kwargs).clone()
        ws.release()
        return got.view(torch.uint8)

    def combine_out(ws, *args, **kwargs):
        ws.combine_out(*args, **kwargs)
        return torch.cat([args[2].float().flatten(), args[3].flatten()])

    def gather_op(fn, ws, **changed):
        """``fn`` (ops.query_gather or ops.query_publish) with the arguments ``changed``."""
        a = {"ql_nope": nope, "q_pe": pe, "positions": pos, "cos_sin_cache": cache, "q_scale": torch.ones(1),
             "rope_style": "interleaved", "out_dtype": q_out, **changed}
        return fn(a["ql_nope"], a["q_pe"], a["positions"], a["cos_sin_cache"], a["q_scale"], ws.handle,
                  rope_style=a["rope_style"], out_dtype=a["out_dtype"])

    def gather_arguments(fn):
        return (
            ("q_pe dtype", "q_pe", lambda ws: gather_op(fn, ws, q_pe=pe.float())),
            ("q_pe a list", "q_pe", lambda ws: gather_op(fn, ws, q_pe=pe.tolist())),
            ("q_scale a list", "q_scale", lambda ws: gather_op(fn, ws, q_scale=[1.0])),
            ("ql_nope non-contiguous", "ql_nope", lambda ws: gather_op(fn, ws, ql_nope=_strided(nope))),
            ("cos_sin_cache non-contiguous", "cos_sin_cache",
             lambda ws: gather_op(fn, ws, cos_sin_cache=cache.t().contiguous().t())),
            ("a position outside the cache", "positions", lambda ws: gather_op(fn, ws, positions=torch.tensor([0, 8]))),
            ("more rows than max_rows", "ql_nope",
             lambda ws: gather_op(fn, ws, ql_nope=nope.repeat(over, 1, 1), q_pe=pe.repeat(over, 1, 1),
                                  positions=pos.repeat(over))),
            ("out_dtype a string", "out_dtype", lambda ws: gather_op(fn, ws, out_dtype="fp8")),
            ("out_dtype of another size", "out_dtype",
             lambda ws: gather_op(fn, ws, out_dtype=torch.bfloat16, q_scale=None)),
            ("rope_style", "rope_style", lambda ws: gather_op(fn, ws, rope_style="gptj")),
            ("handle None", "workspace", lambda ws: fn(nope, pe, pos, cache, torch.ones(1), None, out_dtype=q_out)),
        )

    q3 = torch.zeros(ROWS, 2, 80, dtype=q_out)
    return {
        "peer_all_gather": OpCalls(exchange, lambda ws, **tag: ws.all_gather(x, **tag), (
            ("x non-contiguous", lambda ws: ws.all_gather(_strided(x)), ValueError, "x"),
        ), (
            ("x non-contiguous", "x", lambda ws: ops.peer_all_gather(torch.zeros(4, 2).t(), ws.handle)),
            ("x a list", "x", lambda ws: ops.peer_all_gather([1.0], ws.handle)),
            ("x over max_bytes", "x", lambda ws: ops.peer_all_gather(torch.zeros(17), ws.handle)),
            ("handle a float", "workspace", lambda ws: ops.peer_all_gather(torch.zeros(2), 1.0)),
        )),
        "output_lse_combine": OpCalls(output_lse, lambda ws, **tag: ws.combine(po, pl, **tag), (
            ("partial_out non-contiguous", lambda ws: ws.combine(_strided(po), pl), ValueError, "partial_out"),
            ("partial_lse non-contiguous", lambda ws: ws.combine(po, _strided(pl)), ValueError, "partial_lse"),
            ("lse_base '10'", lambda ws: ws.combine(po, pl, lse_base="10"), ValueError, "lse_base"),
            ("return_lse 'no'", lambda ws: ws.combine(po, pl, return_lse="no"), ValueError, "return_lse"),
            ("seq_lens a list", lambda ws: ws.combine(po, pl, seq_lens=[1], query_start_loc=[0, 1]), ValueError,
             "seq_lens"),
        ), (
            ("lse_base '10'", "lse_base", lambda ws: ops.output_lse_combine(po, pl, ws.handle, lse_base="10")),
            ("partial_out non-contiguous", "partial_out",
             lambda ws: ops.output_lse_combine(po.transpose(1, 2).contiguous().transpose(1, 2), pl, ws.handle)),
            ("partial_lse dtype", "partial_lse", lambda ws: ops.output_lse_combine(po, pl.double(), ws.handle)),
            ("partial_lse a list", "partial_lse", lambda ws: ops.output_lse_combine(po, pl.tolist(), ws.handle)),
            ("seq_lens alone", "query_start_loc",
             lambda ws: ops.output_lse_combine(po, pl, ws.handle, seq_lens=torch.ones(1, dtype=torch.int32))),
        )),
        "output_lse_combine_out": OpCalls(
            output_lse, lambda ws, **tag: combine_out(ws, po, pl, out, out_lse, **tag), (
                ("out shape", lambda ws: combine_out(ws, po, pl, out[:, :3], out_lse), ValueError, "out"),
                ("out_lse a list", lambda ws: combine_out(ws, po, pl, out, []), ValueError, "out_lse"),
                ("lse_base '10'", lambda ws: combine_out(ws, po, pl, out, out_lse, lse_base="10"), ValueError,
                 "lse_base"),
            ), (
                ("out shape", "out", lambda ws: ops.output_lse_combine_out(po, pl, ws.handle, out[:, :3], out_lse)),
                ("out_lse a list", "out_lse", lambda ws: ops.output_lse_combine_out(po, pl, ws.handle, out, [])),
                ("lse_base '10'", "lse_base",
                 lambda ws: ops.output_lse_combine_out(po, pl, ws.handle, out, out_lse, lse_base="10")),
            )),
        "topk_merge": OpCalls(topk, lambda ws, **tag: ws.merge(scores, ids, **tag), (
            ("scores dtype", lambda ws: ws.merge(scores.double(), ids), ValueError, "scores"),
            ("ids dtype", lambda ws: ws.merge(scores, ids.long()), ValueError, "ids"),
            ("ids non-contiguous", lambda ws: ws.merge(scores, _strided(ids)), ValueError, "ids"),
            ("ids a list", lambda ws: ws.merge(scores, ids.tolist()), ValueError, "ids"),
        ), (
            ("scores dtype", "scores", lambda ws: ops.topk_merge(scores.double(), ids, ws.handle, 4)),
            ("ids dtype", "ids", lambda ws: ops.topk_merge(scores, ids.long(), ws.handle, 4)),
            ("scores a list", "scores", lambda ws: ops.topk_merge(scores.tolist(), ids, ws.handle, 4)),
            ("ids strided", "ids", lambda ws: ops.topk_merge(scores, ids.t().contiguous().t(), ws.handle, 4)),
            ("k a float", "k", lambda ws: ops.topk_merge(scores, ids, ws.handle, 4.0)),
            ("k of another workspace", "k", lambda ws: ops.topk_merge(scores, ids, ws.handle, 3)),
            ("more rows than max_rows", "scores",
             lambda ws: ops.topk_merge(scores.repeat(over, 1), ids.repeat(over, 1), ws.handle, 4)),
        )),
        "query_gather": OpCalls(
            query, lambda ws, **tag: ws.gather(nope, pe, pos, cache, scale, **tag).view(torch.uint8), (
                ("ql_nope non-contiguous", lambda ws: ws.gather(_strided(nope), pe, pos, cache, scale), ValueError,
                 "ql_nope"),
                ("q_pe dtype", lambda ws: ws.gather(nope, pe.float(), pos, cache, scale), ValueError, "q_pe"),
                ("positions a list", lambda ws: ws.gather(nope, pe, pos.tolist(), cache, scale), ValueError,
                 "positions"),
                ("q_scale a list", lambda ws: ws.gather(nope, pe, pos, cache, [0.5]), ValueError, "q_scale"),
            ), gather_arguments(ops.query_gather)),
        "query_publish": OpCalls(query, lambda ws, **tag: view(ws, nope, pe, pos, cache, scale, **tag), (
            ("q_pe dtype", lambda ws: view(ws, nope, pe.float(), pos, cache, scale), ValueError, "q_pe"),
            ("cos_sin_cache non-contiguous", lambda ws: view(ws, nope, pe, pos, _strided(cache), scale), ValueError,
             "cos_sin_cache"),
        ), gather_arguments(ops.query_publish)),
        "query_release": OpCalls(query, lambda ws, **tag: view(ws, nope, pe, pos, cache, scale, **tag), (), (
            ("not the inbox", "inbox", lambda ws: ops.query_release(q3.clone().view(ROWS, 1, 160), ws.handle)),
            ("a list", "inbox", lambda ws: ops.query_release([], ws.handle)),
        )),
        "query_all_gather_heads": OpCalls(
            query, lambda ws, **tag: ws.all_gather_heads(q, **tag).view(torch.uint8), (
                ("q non-contiguous", lambda ws: ws.all_gather_heads(_strided(q.view(torch.uint8)).view(q.dtype)),
                 ValueError, "q"),
            ), (
                ("q dtype", "q", lambda ws: ops.query_all_gather_heads(q3.view(torch.uint8), ws.handle)),
                ("q non-contiguous", "q",
                 lambda ws: ops.query_all_gather_heads(torch.zeros(ROWS, 80, 2, dtype=q_out).transpose(1, 2),
                                                       ws.handle)),
                ("q a list", "q", lambda ws: ops.query_all_gather_heads([], ws.handle)),
            )),
        "query_all_gather_heads_out": OpCalls(
            query, lambda ws, **tag: ws.all_gather_heads(q, torch.empty(ROWS, 4, 80, dtype=q.dtype, device=where),
                                                         **tag).view(torch.uint8), (
                ("out shape", lambda ws: ws.all_gather_heads(q, torch.empty(ROWS, 2, 80, dtype=q.dtype)), ValueError,
                 "out"),
                ("out a list", lambda ws: ws.all_gather_heads(q, []), ValueError, "out"),
            ), (
                ("out shape", "out",
                 lambda ws: ops.query_all_gather_heads_out(q3, ws.handle, torch.empty(ROWS, 2, 80, dtype=q_out))),
                ("out dtype", "out", lambda ws: ops.query_all_gather_heads_out(
                    q3, ws.handle, torch.empty(ROWS, 4, 80, dtype=torch.bfloat16))),
                ("out non-contiguous", "out", lambda ws: ops.query_all_gather_heads_out(
                    q3, ws.handle, torch.empty(ROWS, 80, 4, dtype=q_out).transpose(1, 2))),
                ("out a list", "out", lambda ws: ops.query_all_gather_heads_out(q3, ws.handle, [])),
            )),
    }
