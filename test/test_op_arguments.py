"""The argument contract of the peer ops (csrc/README.md, "Where validation
lives"): every argument error of a peer op is raised before the op publishes
anything, as a ValueError or TypeError that names the argument, the expected
and the actual value.

Two host-backend ranks: rank 1 alone makes every bad call straight through
torch_sdcp.ops (no call guard), those of every peer op of every family (the
cross-family table, _family_calls.py) and a few more, each a refusal of the
kinds a caller makes (a
non-contiguous tensor, a wrong dtype, a wrong `out`, a list where a tensor
belongs, a bad option string, too many rows, a handle of another family).
Then both ranks make good calls: had any bad call stored a header or a
payload into rank 0, or advanced rank 1's call index, these would not pair
(a header mismatch or a wait) or would return wrong values. Neither rank is
poisoned, and rank 0 met no void call.
"""

from __future__ import annotations

import re

import torch
from _dist import run_workers
from _family_calls import op_calls
from _helpers import make_query, rank_candidates, rank_partials

from torch_sdcp import ops
from torch_sdcp import reference as ref
from torch_sdcp.families import FAMILIES

ARG_ERROR = re.compile(r"^torch_sdcp: argument '([^']+)': expected .+, got .+", re.S)


def _bad_calls(table, workspaces):
    """(what, the argument the error must name, the call) for rank 1: every
    argument error of every peer op of the cross-family table
    (_family_calls.py) on its family's workspace, a handle of another
    family, and call tags."""
    query, topk, combine, exchange = (workspaces[name] for name in ("query", "topk", "output_lse", "exchange"))
    nope, pe, pos, cache = make_query(2, 2, nope=64, rope=16, max_pos=8, seed=1)
    h = query.handle
    q_out = torch.float8_e4m3fn
    q3 = torch.zeros(2, 2, 80, dtype=q_out)
    scores, ids = rank_candidates(2, 8, seed=1)
    part, lse = rank_partials(2, seed=1)
    out, out_lse = torch.empty(2, 4, 64, dtype=torch.bfloat16), torch.empty(2, 4)
    cases = [(f"{op}: {what}", arg, lambda bad=bad, ws=workspaces[family.name]: bad(ws))
             for family in FAMILIES for op in family.peer_ops for what, arg, bad in table[op].arguments]
    cases += [
        (f"{name}: a top-K handle", "workspace",
         lambda fn=fn: fn(nope, pe, pos, cache, torch.ones(1), topk.handle, out_dtype=q_out))
        for name, fn in (("query_gather", ops.query_gather), ("query_publish", ops.query_publish))
    ]
    # Call tags: refused by the typed wrappers (None or [0, 2**23 - 1), no bool) and, straight to the op
    # (-1 untagged), by the op's own check.
    big = 2**23 - 1
    cases += [
        ("topk_merge: tag a bool", "tag", lambda: ops.topk_merge(scores, ids, topk.handle, 4, tag=True)),
        ("peer_all_gather: tag -1", "tag", lambda: ops.peer_all_gather(torch.zeros(2), exchange.handle, tag=-1)),
        ("query_gather: tag 2**23 - 1", "tag", lambda: ops.query_gather(nope, pe, pos, cache, torch.ones(1), h,
                                                                        out_dtype=q_out, tag=big)),
        ("op peer_all_gather: tag -2", "tag", lambda: torch.ops.sdcp.peer_all_gather(torch.zeros(2), exchange.handle,
                                                                                      -2)),
        ("op topk_merge: tag 2**23 - 1", "tag", lambda: torch.ops.sdcp.topk_merge(scores, ids, topk.handle, 4, big)),
        ("op output_lse_combine: tag 2**23 - 1", "tag",
         lambda: torch.ops.sdcp.output_lse_combine(part, lse, combine.handle, False, None, None, big)),
        ("op output_lse_combine_out: tag 2**23 - 1", "tag",
         lambda: torch.ops.sdcp.output_lse_combine_out(part, lse, combine.handle, False, out, out_lse, None, None,
                                                       big)),
        ("op query_gather: tag -5", "tag",
         lambda: torch.ops.sdcp.query_gather(nope, pe, pos, cache, torch.ones(1), h, False, q_out, -5)),
        ("op query_publish: tag 2**23 - 1", "tag",
         lambda: torch.ops.sdcp.query_publish(nope, pe, pos, cache, torch.ones(1), h, False, q_out, big)),
        ("op query_all_gather_heads: tag 2**23 - 1", "tag", lambda: torch.ops.sdcp.query_all_gather_heads(q3, h, big)),
        ("op query_all_gather_heads_out: tag -2", "tag",
         lambda: torch.ops.sdcp.query_all_gather_heads_out(q3, h, torch.empty(2, 4, 80, dtype=q_out), -2)),
    ]
    return cases


def _worker(rank, world):
    torch.set_num_threads(1)
    table = op_calls(rank)
    # One workspace per family, the one its peer ops run on; the query's gives float8, Output/LSE's 4 heads per rank.
    workspaces = {family.name: table[family.peer_ops[0]].make() for family in FAMILIES}
    query, topk, combine, exchange = (workspaces[name] for name in ("query", "topk", "output_lse", "exchange"))
    wrong = []
    if rank == 1:
        for what, arg, call in _bad_calls(table, workspaces):
            try:
                call()
            except (ValueError, TypeError) as e:
                m = ARG_ERROR.match(str(e))
                if m is None or arg not in m.group(1).split(", "):
                    wrong.append(f"{what}: {type(e).__name__}: {e}")
            except Exception as e:
                wrong.append(f"{what}: {type(e).__name__} (not ValueError/TypeError): {e}")
            else:
                wrong.append(f"{what}: no error")
    # Good calls on both ranks pair, and return the right values.
    qs = [make_query(2, 2, nope=64, rope=16, max_pos=8, seed=r) for r in range(world)]
    scale = torch.full((1,), 0.5)
    want_q = torch.cat([ref.query_rope_quant_ref(*q, scale, out_dtype=torch.float8_e4m3fn) for q in qs], dim=1)
    got = query.gather(*qs[rank], scale)
    assert torch.equal(got.view(torch.uint8), want_q.view(torch.uint8))
    view = query.gather_view(*qs[rank], scale)
    assert torch.equal(view.view(torch.uint8), want_q.view(torch.uint8))
    query.release()
    local = ref.query_rope_quant_ref(*qs[rank], scale, out_dtype=torch.float8_e4m3fn)
    assert torch.equal(query.all_gather_heads(local).view(torch.uint8), want_q.view(torch.uint8))
    cands = [rank_candidates(2, 8, seed=r) for r in range(world)]
    assert torch.equal(topk.merge(*cands[rank]), ref.topk_merge_ref(cands, 4))
    parts = [rank_partials(2, seed=r) for r in range(world)]
    full, _ = ref.lse_combine_ref(torch.stack([p for p, _ in parts]), torch.stack([l for _, l in parts]))
    torch.testing.assert_close(combine.combine(*parts[rank]), ref.output_lse_shard(full, None, rank, world)[0],
                               rtol=2e-2, atol=2e-2)
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    assert torch.equal(exchange.all_gather(x), torch.stack([torch.arange(4.0) + 10 * r for r in range(world)]))
    for ws in workspaces.values():
        torch.ops.sdcp.workspace_check(ws.handle)  # not poisoned
        assert int(torch.ops.sdcp.workspace_take_void(ws.handle)) == 0  # and no void call met
        ws.close()
    return wrong


def test_peer_op_argument_errors_publish_nothing():
    results = run_workers(_worker, 2, timeout=240)
    assert results[0] == []
    assert results[1] == [], "\n".join(results[1])
