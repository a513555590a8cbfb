"""The collective paths of torch_sdcp.collective under a real multi-process gloo
group, against the references computed on the full (global) data.

One spawn per world size runs every check: each worker builds the same seeded
global inputs, takes its own part, runs the collective and compares with the
references. A failing worker fails the test with its traceback; nothing can
hang (gloo timeout, plus a deadline on the join).
"""

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _helpers import poisoned_partials

import torch_sdcp  # noqa: F401  (registers torch.ops.sdcp)
from torch_sdcp import collective
from torch_sdcp import reference as ref

NOPE, ROPE = 512, 64
INF, NAN = math.inf, math.nan
GLOO_TIMEOUT_S = 60
JOIN_DEADLINE_S = 150


def make_cache(max_pos, rope, dtype, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype).contiguous()


def same_on_every_rank(t):
    """True when every rank holds identical bytes."""
    mine = t.contiguous().view(torch.uint8).reshape(-1)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[0]) for g in gathered)


# ---------------------------------------------------------------------------
# Per-boundary checks, run inside every worker.
# ---------------------------------------------------------------------------


def check_query(rank, n):
    gen = torch.Generator().manual_seed(1234 + n)
    hl = 4
    for rows in (1, 8):
        ql_nope = (torch.randn(rows, n * hl, NOPE, generator=gen) * 3).bfloat16()
        q_pe = (torch.randn(rows, n * hl, ROPE, generator=gen) * 3).bfloat16()
        positions = torch.randint(0, 2048, (rows,), generator=gen)
        for cache_dtype, neox, out_dtype, scale in [
            (torch.float32, False, torch.bfloat16, None),
            (torch.bfloat16, True, torch.bfloat16, None),
            (torch.float32, False, torch.float8_e4m3fn, 1.0 / 64),  # saturates
            (torch.bfloat16, True, torch.float8_e4m3fn, None),
        ]:
            cache = make_cache(2048, ROPE, cache_dtype)
            q_scale = None if scale is None else torch.tensor([scale])
            heads = slice(rank * hl, (rank + 1) * hl)  # this rank's TP head shard (strided views)
            got = collective.query_all_gather(ql_nope[:, heads], q_pe[:, heads], positions, cache, q_scale, neox,
                                              out_dtype)
            want = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, q_scale, neox, out_dtype)
            parts = [ref.query_rope_quant_ref(ql_nope[:, r * hl:(r + 1) * hl], q_pe[:, r * hl:(r + 1) * hl],
                                              positions, cache, q_scale, neox, out_dtype) for r in range(n)]
            assert got.dtype == out_dtype and got.shape == (rows, n * hl, NOPE + ROPE), (got.dtype, got.shape)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rows, cache_dtype, neox, out_dtype)
            assert torch.equal(got.view(torch.uint8), ref.query_gathered_layout(parts).view(torch.uint8))


def check_topk(rank, n):
    gen = torch.Generator().manual_seed(99 + n)
    rows, c, interleave = 5, 64, 2
    # Each rank's candidates are tokens it owns: global ids from local indices.
    shards = []
    for r in range(n):
        local = torch.stack([torch.randperm(4 * c, generator=gen)[:c] for _ in range(rows)])
        ids = ref.token_global_index(local, r, n, interleave).int()
        ids = torch.where(torch.rand(rows, c, generator=gen) < 0.15, -1, ids)  # no candidate
        scores = (torch.randn(rows, c, generator=gen) * 2).round()  # many ties across ranks
        u = torch.rand(rows, c, generator=gen)
        scores = torch.where(u < 0.05, NAN, scores)
        scores = torch.where((u >= 0.05) & (u < 0.1), -0.0, scores)
        scores = torch.where((u >= 0.1) & (u < 0.13), -INF, scores)
        scores = torch.where((u >= 0.13) & (u < 0.15), INF, scores)
        shards.append((scores.float().contiguous(), ids.contiguous()))
        assert (ref.token_owner(ids[ids >= 0], n, interleave) == r).all()
    shards[-1][1][1] = -1  # one row with an empty shard on the last rank
    for k in (1, 16, 64, n * c + 5):
        got = collective.topk_all_gather_merge(shards[rank][0], shards[rank][1], k)
        want = ref.topk_merge_ref(shards, k)
        assert got.dtype == torch.int32 and got.shape == (rows, k)
        assert torch.equal(got, want), (k, got, want)
        assert same_on_every_rank(got)


def check_lse(rank, n):
    gen = torch.Generator().manual_seed(7 + n)
    rows, hl, dim = 6, 4, 64
    heads = n * hl
    for dtype, base2, use_all_reduce in [
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, True),  # the all_reduce + slice fallback
        (torch.float32, False, False),
        (torch.float32, True, True),
    ]:
        po, pl = poisoned_partials(n, rows, heads, dim, dtype, gen=gen, lse_mean=5.0)
        out, lse = collective._lse_all_gather_reduce_scatter(po[rank], pl[rank], base2, True, None,
                                                             use_all_reduce=use_all_reduce)
        assert out.dtype == dtype and out.shape == (rows, hl, dim), (out.dtype, out.shape)
        assert lse.dtype == torch.float32 and lse.shape == (rows, hl)
        want_out, want_lse = ref.output_lse_shard(*ref.lse_combine_ref64(po, pl, base2), rank, n)
        # sum_n w_n |O_n|: the scale of the rounding errors (zero-weight terms excluded).
        mag, _ = ref.output_lse_shard(*ref.lse_combine_ref64(po.abs(), pl, base2), rank, n)
        # The global LSE is computed from the gathered fp32 LSEs by the same
        # code as the fp32 reference: identical.
        _, ref_lse = ref.output_lse_shard(*ref.lse_combine_ref(po, pl, base2), rank, n)
        assert torch.equal(lse, ref_lse)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
        assert not out.isnan().any()  # NaN payloads of empty shards do not leak
        if rank == 0:
            assert (out[0, 0] == 0).all() and lse[0, 0] == -INF
        # Each term rounds to the communication dtype, then N-1 sums in it.
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
        err = (out.double() - want_out).abs()
        bound = (n + 1) * ulp * mag + 1e-5 * mag + 1e-30
        assert (err <= bound).all(), (dtype, base2, float((err - bound).max()))
        # Without return_lse: the output alone, the same values.
        only = collective.lse_all_gather_reduce_scatter(po[rank], pl[rank], base2)
        assert isinstance(only, torch.Tensor) and torch.equal(only, out)


def check_validation(rank, n):
    # Bad inputs fail on every rank before any communication.
    with pytest.raises(ValueError, match=r"argument 'partial_out': expected heads divisible by the world size"):
        collective.lse_all_gather_reduce_scatter(torch.zeros(2, n * 4 + 1, 8), torch.zeros(2, n * 4 + 1))
    with pytest.raises(ValueError, match=r"argument 'partial_lse': expected dtype torch.float32"):
        collective.lse_all_gather_reduce_scatter(torch.zeros(2, n, 8), torch.zeros(2, n, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"torch_sdcp: argument 'k': expected k >= 1, got 0"):
        collective.topk_all_gather_merge(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"argument 'out_dtype'"):
        collective.query_all_gather(torch.zeros(1, 1, 8, dtype=torch.bfloat16),
                                    torch.zeros(1, 1, 2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long),
                                    torch.zeros(1, 2), out_dtype=torch.float32)
    # A flag is a bool: "no" is truthy, and would have returned a pair.
    for fn in (collective.lse_all_gather_reduce_scatter, collective.lse_all_gather_correct_reduce_scatter):
        with pytest.raises(ValueError, match=r"argument 'return_lse': expected a bool, got 'no'"):
            fn(torch.zeros(2, n, 8), torch.zeros(2, n), return_lse="no")
        with pytest.raises(ValueError, match=r"argument 'base2': expected a bool, got 1"):
            fn(torch.zeros(2, n, 8), torch.zeros(2, n), base2=1)
    # all_gather_heads names a wrong out (not torch's size message), before anything is sent.
    q = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"argument 'out': expected shape \[3, {2 * n}, 4\], got shape \[3, 2, 4\]"):
        collective.all_gather_heads(q, None, torch.empty(3, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument 'out': expected dtype torch.bfloat16, got dtype torch.float32"):
        collective.all_gather_heads(q, None, torch.empty(3, 2 * n, 4))
    with pytest.raises(ValueError, match=r"argument 'out': expected a contiguous tensor, got strides"):
        collective.all_gather_heads(q, None, torch.empty(3, 4, 2 * n, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match=r"argument 'out': expected a Tensor, got list"):
        collective.all_gather_heads(q, None, [])
    with pytest.raises(ValueError, match=r"argument 'q': expected 3 dimensions, got 2 \(shape \[3, 8\]\)"):
        collective.all_gather_heads(q.view(3, 8), None)


def check_all_gather_heads(rank, n):
    q = (torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4) + 100 * rank).to(torch.bfloat16)
    want = torch.cat([(q.float() - 100 * rank + 100 * r).to(torch.bfloat16) for r in range(n)], dim=1)
    assert torch.equal(collective.all_gather_heads(q, None), want)
    out = torch.empty(3, 2 * n, 4, dtype=torch.bfloat16)
    assert collective.all_gather_heads(q, None, out) is out and torch.equal(out, want)


def check_gather_fallback(rank, n):
    # The list all_gather (fallback for gloo builds without the single-tensor
    # form) stacks exactly like the single-tensor collective.
    x = torch.arange(6, dtype=torch.int32).reshape(2, 3) + 100 * rank
    a = collective.all_gather_stack(x, None)
    b = collective.all_gather_stack(x, None, use_list=True)
    assert torch.equal(a, b) and torch.equal(a, torch.stack([x - 100 * rank + 100 * r for r in range(n)]))


def _worker(rank, world_size, init_file):
    torch.set_num_threads(1)  # several processes share a few cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        check_validation(rank, world_size)
        check_gather_fallback(rank, world_size)
        check_all_gather_heads(rank, world_size)
        check_query(rank, world_size)
        check_topk(rank, world_size)
        check_lse(rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_paths_gloo(world_size, tmp_path):
    ctx = mp.start_processes(_worker, args=(world_size, str(tmp_path / "store")), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_DEADLINE_S
    # join() raises with the worker's traceback as soon as one fails (and
    # terminates the others); the deadline guards against a hang.
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"collective workers (world size {world_size}) did not finish in {JOIN_DEADLINE_S} s")
