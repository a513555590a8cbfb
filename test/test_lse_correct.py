"""The collective Output/LSE path as engines run it: ``sdcp::lse_correct`` (the
one fused correction kernel between the LSE all_gather and the head
reduce_scatter) and ``collective.lse_all_gather_correct_reduce_scatter``.

The op is checked against the fp64 reference by summing every rank's corrected
shard (what the reduce_scatter does), on poisoned inputs (NaN/+inf/-inf LSEs,
all-empty rows, NaN payloads under zero weight), both bases, rows 1 and 128;
then opcheck, the fake, torch.compile, and the path under gloo.
"""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_workers
from _helpers import devices, poisoned_partials

import torch_sdcp
from torch_sdcp import collective, ops, reference

INF, NAN = math.inf, math.nan
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def corrected_sum(out, lse, base2, device):
    """Every rank's lse_correct on `device`, summed in fp64 ([T, H, D]), and the
    LSEs every rank returned."""
    n = out.size(0)
    total, lses = None, []
    gathered = lse.to(device)
    for r in range(n):
        scaled, big_l = ops.lse_correct(out[r].to(device), gathered, r, lse_base="2" if base2 else "e")
        assert scaled.shape == (out.size(2), out.size(1), out.size(3)) and scaled.is_contiguous()
        assert scaled.dtype == out.dtype and big_l.dtype == torch.float32 and big_l.shape == lse.shape[1:]
        part = scaled.cpu().double().transpose(0, 1)  # [T, H, D]
        total = part if total is None else total + part
        lses.append(big_l.cpu())
    return total, lses


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n,t,h,d", [(1, 1, 4, 64), (2, 1, 8, 512), (3, 128, 6, 64), (4, 128, 8, 128)])
def test_corrected_shards_sum_to_the_exact_combine(device, dtype, base2, n, t, h, d):
    out, lse = poisoned_partials(n, t, h, d, dtype, seed=n * 1000 + t + d)
    total, lses = corrected_sum(out, lse, base2, device)
    want_out, want_lse = reference.lse_combine_ref64(out, lse, base2)
    # Every rank computes the same global LSE, bit for bit.
    for other in lses[1:]:
        assert torch.equal(other, lses[0])
    torch.testing.assert_close(lses[0].double(), want_lse, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lses[0][0, 0]) and (h < 2 or torch.isneginf(lses[0][-1, 1]))
    assert not total.isnan().any(), "a zero-weight (NaN) payload leaked"
    # One rounding per term to the payload dtype: |err| <= N ulp sum_n w_n |O_n|.
    mag, _ = reference.lse_combine_ref64(out.abs(), lse, base2)
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    err = (total - want_out).abs()
    bound = (n + 1) * ulp * mag + 1e-5 * mag + 1e-30
    assert (err <= bound).all(), float((err - bound).max())
    assert (total[0, 0] == 0).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("base2", [False, True])
def test_zero_weight_is_exactly_zero_and_weights_match(device, base2):
    n, t, h, d = 3, 5, 4, 16
    out, lse = poisoned_partials(n, t, h, d, torch.float32, seed=3)
    w, big_l = reference.lse_weights(lse.double(), base2)  # [N, T, H] fp64
    for r in range(n):
        scaled, got_l = ops.lse_correct(out[r].to(device), lse.to(device), r, lse_base="2" if base2 else "e")
        scaled = scaled.cpu().transpose(0, 1)  # [T, H, D]
        zero = w[r] == 0
        assert (scaled[zero] == 0).all() and not torch.signbit(scaled[zero]).any()
        want = (w[r].unsqueeze(-1) * out[r].double())[~zero]
        torch.testing.assert_close(scaled[~zero].double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_l.cpu().double(), big_l, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", devices())
def test_lse_correct_rejects_bad_input(device):
    out, lse = poisoned_partials(2, 4, 4, 64, torch.bfloat16, seed=1)
    o, g = out[0].to(device), lse.to(device)
    with pytest.raises(ValueError, match="'rank'.*\\[0, 2\\)"):
        ops.lse_correct(o, g, 2)
    with pytest.raises(ValueError, match="'rank'"):
        ops.lse_correct(o, g, -1)
    with pytest.raises(ValueError, match="'gathered_lse'.*dtype"):
        ops.lse_correct(o, g.double(), 0)
    with pytest.raises(ValueError, match="'gathered_lse'.*size 4 at dim 2"):
        ops.lse_correct(o, g[:, :, :3].contiguous(), 0)
    with pytest.raises(ValueError, match="'partial_out'.*contiguous"):
        ops.lse_correct(o.transpose(0, 1), g.transpose(1, 2).contiguous(), 0)
    with pytest.raises(ValueError, match="'gathered_lse'.*3 dimensions"):
        ops.lse_correct(o, g[0], 0)
    with pytest.raises(ValueError, match="lse_base"):
        ops.lse_correct(o, g, 0, lse_base="10")
    if device == "cuda":
        with pytest.raises(ValueError, match="'partial_out'.*multiple of 8 elements"):
            ops.lse_correct(o[..., :12].contiguous(), g, 0)


@pytest.mark.parametrize("device", devices())
def test_lse_correct_opcheck(device):
    for n, t, h, d, dtype in [(1, 1, 2, 8, torch.bfloat16), (2, 5, 4, 64, torch.float32),
                              (3, 2, 3, 16, torch.float16)]:
        out, lse = poisoned_partials(n, t, h, d, dtype, seed=n)
        for rank in range(n):
            for base2 in (False, True):
                torch.library.opcheck(torch.ops.sdcp.lse_correct.default,
                                      (out[rank].to(device), lse.to(device), rank, base2))


def test_lse_correct_fake_matches_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    out, lse = poisoned_partials(2, 3, 4, 8, torch.float16, seed=2)
    mine = out[1].contiguous()
    real = torch.ops.sdcp.lse_correct(mine, lse, 1, False)
    mode = FakeTensorMode()
    fake_out, fake_lse = mode.from_tensor(mine), mode.from_tensor(lse)
    with mode:
        fake = torch.ops.sdcp.lse_correct(fake_out, fake_lse, 1, False)
    for a, b in zip(real, fake, strict=False):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


def test_lse_correct_compiles_fullgraph():
    out, lse = poisoned_partials(2, 4, 4, 32, torch.bfloat16, seed=4)

    def f(o, g):
        scaled, big_l = ops.lse_correct(o, g, 1, lse_base="2")
        return scaled.transpose(0, 1), big_l  # the [T, H, D] view the path returns

    got = torch.compile(f, fullgraph=True, backend="inductor")(out[1], lse)
    want = f(out[1], lse)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------
# The path under gloo, and as the workspace's fallback.
# ---------------------------------------------------------------------------


def _path_worker(rank, world):
    gen = torch.Generator().manual_seed(11 + world)
    hl = 4
    heads = world * hl
    done = 0
    for rows, dim, dtype, base2, use_all_reduce in [
        (1, 64, torch.bfloat16, False, False),
        (128, 64, torch.bfloat16, True, True),  # the all_reduce + slice fallback
        (7, 32, torch.float32, False, True),
        (128, 32, torch.float16, True, False),
    ]:
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        po, pl = poisoned_partials(world, rows, heads, dim, dtype, seed=seed)
        got, got_lse = collective._lse_all_gather_correct_reduce_scatter(po[rank], pl[rank], base2, True, None,
                                                                        use_all_reduce=use_all_reduce)
        assert got.shape == (rows, hl, dim) and got.dtype == dtype
        assert got_lse.shape == (rows, hl) and got_lse.dtype == torch.float32
        want_out, want_lse = reference.output_lse_shard(*reference.lse_combine_ref64(po, pl, base2), rank, world)
        mag, _ = reference.output_lse_shard(*reference.lse_combine_ref64(po.abs(), pl, base2), rank, world)
        torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-5, atol=1e-6)
        assert not got.isnan().any()
        ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
        err = (got.double() - want_out).abs()
        assert (err <= (world + 1) * ulp * mag + 1e-5 * mag + 1e-30).all(), (rows, dtype, base2)
        if rank == 0:
            assert (got[0, 0] == 0).all() and got_lse[0, 0] == -INF
        # The same values: without the LSE, into caller-owned outputs, and as
        # the eager reference path computes them (to one rounding per term).
        only = collective.lse_all_gather_correct_reduce_scatter(po[rank], pl[rank], base2)
        assert isinstance(only, torch.Tensor) and torch.equal(only, got)
        o = torch.full((rows, hl, dim), NAN, dtype=dtype)
        ol = torch.full((rows, hl), NAN)
        res = collective.lse_all_gather_correct_reduce_scatter(po[rank], pl[rank], base2, True, out=o, out_lse=ol)
        assert res[0] is o and res[1] is ol and torch.equal(o, got) and torch.equal(ol, got_lse)
        eager, eager_lse = collective.lse_all_gather_reduce_scatter(po[rank], pl[rank], base2, True)
        torch.testing.assert_close(got_lse, eager_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.double(), eager.double(), rtol=0, atol=float(4 * ulp * mag.max()) + 1e-30)
        done += 1
    with pytest.raises(ValueError, match="argument 'out': expected shape"):
        collective.lse_all_gather_correct_reduce_scatter(po[rank], pl[rank], out=torch.empty(1, 1, 1, dtype=po.dtype))
    with pytest.raises(ValueError, match="argument 'partial_out': expected heads divisible"):
        collective.lse_all_gather_correct_reduce_scatter(torch.zeros(2, heads + 1, 8), torch.zeros(2, heads + 1))
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_fused_collective_path_gloo(world):
    assert run_workers(_path_worker, world, timeout=180) == [4] * world


def _workspace_fallback_worker(rank, world):
    with torch_sdcp.OutputLSEWorkspace(None, 4, 4 * world, 64, backend="host") as ws:
        po, pl = poisoned_partials(world, 6, 4 * world, 64, torch.bfloat16, seed=9)  # 6 rows > max_rows = 4
        got, got_lse = ws.combine(po[rank], pl[rank], lse_base="2", return_lse=True)
        want, want_lse = collective.lse_all_gather_correct_reduce_scatter(po[rank], pl[rank], True, True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
        # Both paths return contiguous results, so empty_like() of one is a valid output.
        assert got.is_contiguous() and got_lse.is_contiguous()
        o, ol = torch.empty_like(got), torch.empty_like(got_lse)
        ws.combine_out(po[rank], pl[rank], o, ol, lse_base="2")
        assert torch.equal(o, got) and torch.equal(ol, got_lse)
        # combine_out checks its outputs as the peer path does: contiguous.
        strided = torch.empty(got.shape[1], got.shape[0], got.shape[2], dtype=got.dtype).transpose(0, 1)
        with pytest.raises(ValueError, match="argument 'out': expected a contiguous tensor"):
            ws.combine_out(po[rank], pl[rank], strided, torch.empty_like(got_lse), lse_base="2")
        assert ws.poisoned  # an error inside a call poisons the workspace, the collective path included
        ws.resize(4)  # re-created on every rank
        o, ol = torch.empty(got.shape, dtype=got.dtype), torch.empty(got_lse.shape)
        ws.combine_out(po[rank], pl[rank], o, ol, lse_base="2")
        assert torch.equal(o, got) and torch.equal(ol, got_lse)
    return True


def test_workspace_falls_back_to_the_fused_collective_path():
    assert run_workers(_workspace_fallback_worker, 2, timeout=120) == [True, True]
