"""The argument contract of the peer ops (csrc/README.md, "Where validation
lives"): every argument error of a peer op is raised before the op publishes
anything, as a ValueError or TypeError that names the argument, the expected
and the actual value.

Two host-backend ranks: rank 1 alone makes every bad call straight through
torch_sdcp.ops (no call guard), each a refusal of the kinds a caller makes (a
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
from _helpers import HOST, make_query, rank_candidates, rank_partials

import torch_sdcp
from torch_sdcp import ops
from torch_sdcp import reference as ref

ARG_ERROR = re.compile(r"^torch_sdcp: argument '([^']+)': expected .+, got .+", re.S)


def _bad_calls(query, topk, combine, exchange):
    """(what, the argument the error must name, the call) for rank 1."""
    nope, pe, pos, cache = make_query(2, 2, nope=64, rope=16, max_pos=8, seed=1)
    h = query.handle
    q_out = torch.float8_e4m3fn
    q3 = torch.zeros(2, 2, 80, dtype=q_out)
    scores, ids = rank_candidates(2, 8, seed=1)
    part, lse = rank_partials(2, seed=1)
    out, out_lse = torch.empty(2, 4, 64, dtype=torch.bfloat16), torch.empty(2, 4)

    def gather(**changed):
        """A query_gather / query_publish call with the arguments ``changed``."""
        a = {"ql_nope": nope, "q_pe": pe, "positions": pos, "cos_sin_cache": cache, "q_scale": torch.ones(1),
             "workspace": h, "rope_style": "interleaved", "out_dtype": q_out, **changed}
        return lambda fn: fn(a["ql_nope"], a["q_pe"], a["positions"], a["cos_sin_cache"], a["q_scale"],
                             a["workspace"], rope_style=a["rope_style"], out_dtype=a["out_dtype"])

    cases = []
    for name, fn in (("query_gather", ops.query_gather), ("query_publish", ops.query_publish)):
        cases += [
            (f"{name}: q_pe dtype", "q_pe", lambda fn=fn: gather(q_pe=pe.float())(fn)),
            (f"{name}: q_pe a list", "q_pe", lambda fn=fn: gather(q_pe=pe.tolist())(fn)),
            (f"{name}: q_scale a list", "q_scale", lambda fn=fn: gather(q_scale=[1.0])(fn)),
            (f"{name}: ql_nope non-contiguous", "ql_nope",
             lambda fn=fn: gather(ql_nope=nope.transpose(1, 2).contiguous().transpose(1, 2))(fn)),
            (f"{name}: cos_sin_cache non-contiguous", "cos_sin_cache",
             lambda fn=fn: gather(cos_sin_cache=cache.t().contiguous().t())(fn)),
            (f"{name}: a position outside the cache", "positions",
             lambda fn=fn: gather(positions=torch.tensor([0, 8]))(fn)),
            (f"{name}: more rows than max_rows", "ql_nope",
             lambda fn=fn: gather(ql_nope=nope.repeat(2, 1, 1), q_pe=pe.repeat(2, 1, 1),
                                  positions=pos.repeat(2))(fn)),
            (f"{name}: out_dtype a string", "out_dtype", lambda fn=fn: gather(out_dtype="fp8")(fn)),
            (f"{name}: out_dtype of another size", "out_dtype",
             lambda fn=fn: gather(out_dtype=torch.bfloat16, q_scale=None)(fn)),
            (f"{name}: rope_style", "rope_style", lambda fn=fn: gather(rope_style="gptj")(fn)),
            (f"{name}: a top-K handle", "workspace", lambda fn=fn: gather(workspace=topk.handle)(fn)),
            (f"{name}: handle None", "workspace", lambda fn=fn: gather(workspace=None)(fn)),
        ]
    cases += [
        ("query_release: not the inbox", "inbox", lambda: ops.query_release(q3.clone().view(2, 1, 160), h)),
        ("query_release: a list", "inbox", lambda: ops.query_release([], h)),
        ("query_all_gather_heads: q dtype", "q", lambda: ops.query_all_gather_heads(q3.view(torch.uint8), h)),
        ("query_all_gather_heads: q non-contiguous", "q",
         lambda: ops.query_all_gather_heads(torch.zeros(2, 80, 2, dtype=q_out).transpose(1, 2), h)),
        ("query_all_gather_heads: q a list", "q", lambda: ops.query_all_gather_heads([], h)),
        ("query_all_gather_heads_out: out shape", "out",
         lambda: ops.query_all_gather_heads_out(q3, h, torch.empty(2, 2, 80, dtype=q_out))),
        ("query_all_gather_heads_out: out dtype", "out",
         lambda: ops.query_all_gather_heads_out(q3, h, torch.empty(2, 4, 80, dtype=torch.bfloat16))),
        ("query_all_gather_heads_out: out non-contiguous", "out",
         lambda: ops.query_all_gather_heads_out(q3, h, torch.empty(2, 80, 4, dtype=q_out).transpose(1, 2))),
        ("query_all_gather_heads_out: out a list", "out", lambda: ops.query_all_gather_heads_out(q3, h, [])),
        ("topk_merge: scores dtype", "scores", lambda: ops.topk_merge(scores.double(), ids, topk.handle, 4)),
        ("topk_merge: ids dtype", "ids", lambda: ops.topk_merge(scores, ids.long(), topk.handle, 4)),
        ("topk_merge: scores a list", "scores", lambda: ops.topk_merge(scores.tolist(), ids, topk.handle, 4)),
        ("topk_merge: ids strided", "ids", lambda: ops.topk_merge(scores, ids.t().contiguous().t(), topk.handle, 4)),
        ("topk_merge: k a float", "k", lambda: ops.topk_merge(scores, ids, topk.handle, 4.0)),
        ("topk_merge: k of another workspace", "k", lambda: ops.topk_merge(scores, ids, topk.handle, 3)),
        ("topk_merge: more rows than max_rows", "scores",
         lambda: ops.topk_merge(scores.repeat(2, 1), ids.repeat(2, 1), topk.handle, 4)),
        ("output_lse_combine: lse_base '10'", "lse_base",
         lambda: ops.output_lse_combine(part, lse, combine.handle, lse_base="10")),
        ("output_lse_combine: partial_out non-contiguous", "partial_out",
         lambda: ops.output_lse_combine(part.transpose(1, 2).contiguous().transpose(1, 2), lse, combine.handle)),
        ("output_lse_combine: partial_lse dtype", "partial_lse",
         lambda: ops.output_lse_combine(part, lse.double(), combine.handle)),
        ("output_lse_combine: partial_lse a list", "partial_lse",
         lambda: ops.output_lse_combine(part, lse.tolist(), combine.handle)),
        ("output_lse_combine: seq_lens alone", "query_start_loc",
         lambda: ops.output_lse_combine(part, lse, combine.handle, seq_lens=torch.ones(1, dtype=torch.int32))),
        ("output_lse_combine_out: out shape", "out",
         lambda: ops.output_lse_combine_out(part, lse, combine.handle, out[:, :3], out_lse)),
        ("output_lse_combine_out: out_lse a list", "out_lse",
         lambda: ops.output_lse_combine_out(part, lse, combine.handle, out, [])),
        ("output_lse_combine_out: lse_base '10'", "lse_base",
         lambda: ops.output_lse_combine_out(part, lse, combine.handle, out, out_lse, lse_base="10")),
        ("peer_all_gather: x non-contiguous", "x",
         lambda: ops.peer_all_gather(torch.zeros(4, 2).t(), exchange.handle)),
        ("peer_all_gather: x a list", "x", lambda: ops.peer_all_gather([1.0], exchange.handle)),
        ("peer_all_gather: x over max_bytes", "x", lambda: ops.peer_all_gather(torch.zeros(17), exchange.handle)),
        ("peer_all_gather: handle a float", "workspace", lambda: ops.peer_all_gather(torch.zeros(2), 1.0)),
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
    query = torch_sdcp.QueryWorkspace(None, 2, 2, nope_dim=64, rope_dim=16, **HOST)  # float8 output
    topk = torch_sdcp.TopKWorkspace(None, 2, 4, candidates_per_rank=8, **HOST)
    combine = torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, **HOST)  # bf16, 4 heads per rank
    exchange = torch_sdcp.ExchangeWorkspace(None, 64, **HOST)
    wrong = []
    if rank == 1:
        for what, arg, call in _bad_calls(query, topk, combine, exchange):
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
    for ws in (query, topk, combine, exchange):
        torch.ops.sdcp.workspace_check(ws.handle)  # not poisoned
        assert int(torch.ops.sdcp.workspace_take_void(ws.handle)) == 0  # and no void call met
        ws.close()
    return wrong


def test_peer_op_argument_errors_publish_nothing():
    results = run_workers(_worker, 2, timeout=240)
    assert results[0] == []
    assert results[1] == [], "\n".join(results[1])
