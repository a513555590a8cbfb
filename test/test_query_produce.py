"""Query family, the producer: the fused RoPE/FP8 kernel alone (bit-exact
against the reference on every device, bad input, opcheck, torch.compile),
and NaN queries through the producer, the gather and the view."""

from __future__ import annotations

import pytest
import torch
from _dist import run_workers
from _helpers import GPU_WORLD, devices, make_query, rank_workspace_args, requires_gpus
from _query import as_bytes, expected_gather, global_query

from torch_sdcp import ops, reference


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
@pytest.mark.parametrize("out_dtype,scale", [(torch.bfloat16, None), (torch.float8_e4m3fn, None),
                                             (torch.float8_e4m3fn, 0.01)])
@pytest.mark.parametrize("t,h", [(1, 8), (17, 16), (64, 32)])
def test_local_producer_bit_exact(device, rope_style, out_dtype, scale, t, h):
    ql_nope, q_pe, pos, cache = make_query(t, h, seed=t + h, device=device)
    q_scale = None if scale is None else torch.tensor([scale], device=device)
    got = ops.query_rope_quant(ql_nope, q_pe, pos, cache, q_scale, rope_style=rope_style, out_dtype=out_dtype)
    want = reference.query_rope_quant_ref(ql_nope.cpu(), q_pe.cpu(), pos.cpu(), cache.cpu(),
                                          None if q_scale is None else q_scale.cpu(),
                                          neox=rope_style == "neox", out_dtype=out_dtype)
    assert torch.equal(as_bytes(got.cpu()), as_bytes(want))
    if scale is not None:  # the scale saturates some values
        assert (got.float().abs() == 448).any()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("nope,rope", [(1024, 64), (48, 32), (520, 8), (32, 80)])
def test_local_producer_shapes(device, rope_style, out_dtype, nope, rope):
    # Heads wider than 512 (a lane converts more than one nope vector), a rope
    # part of one or two output vectors, and shapes that the CUDA kernels
    # produce through the shared-memory stage (nope not a whole number of
    # output vectors, more rope pairs than lanes).
    ql_nope, q_pe, pos, cache = make_query(5, 3, nope=nope, rope=rope, max_pos=64, seed=nope + rope, device=device)
    q_scale = None if out_dtype == torch.bfloat16 else torch.tensor([0.05], device=device)
    got = ops.query_rope_quant(ql_nope, q_pe, pos, cache, q_scale, rope_style=rope_style, out_dtype=out_dtype)
    want = reference.query_rope_quant_ref(ql_nope.cpu(), q_pe.cpu(), pos.cpu(), cache.cpu(),
                                          None if q_scale is None else q_scale.cpu(),
                                          neox=rope_style == "neox", out_dtype=out_dtype)
    assert torch.equal(as_bytes(got.cpu()), as_bytes(want))


@pytest.mark.parametrize("device", devices())
# Scales inside [2**-60, 2**60] take the CUDA kernels' one-reciprocal division
# (near its ends, quotients over- and underflow), the others IEEE division.
@pytest.mark.parametrize("scale", [None, 1.0 / 64, 0.01, 3.0, 1e-18, 1e18, 1e-25, 2e19])
def test_local_producer_every_bf16_value(device, scale):
    # Every bf16 bit pattern once in ql_nope (NaNs of both signs, infinities,
    # subnormals, signed zeros, values past 448 and the e4m3 rounding ties),
    # and random bit patterns in q_pe: the float8 bytes equal the reference's.
    ql_nope, q_pe, pos, cache = make_query(16, 8, seed=5, device=device)
    ql_nope.view(torch.int16).copy_(torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(16, 8, 512))
    g = torch.Generator().manual_seed(6)
    bits = torch.randint(-32768, 32768, q_pe.shape, generator=g, dtype=torch.int32)
    q_pe.view(torch.int16).copy_(bits.to(torch.int16))
    q_scale = None if scale is None else torch.tensor([scale], device=device)
    for rope_style in ("interleaved", "neox"):
        got = ops.query_rope_quant(ql_nope, q_pe, pos, cache, q_scale, rope_style=rope_style,
                                   out_dtype=torch.float8_e4m3fn)
        want = reference.query_rope_quant_ref(ql_nope.cpu(), q_pe.cpu(), pos.cpu(), cache.cpu(),
                                              None if q_scale is None else q_scale.cpu(),
                                              neox=rope_style == "neox", out_dtype=torch.float8_e4m3fn)
        assert torch.equal(as_bytes(got.cpu()), as_bytes(want))
    b = as_bytes(want)
    assert (b == 0x7F).any() and not (b == 0xFF).any()  # NaNs canonical
    assert (b == 0x7E).any() and (b == 0xFE).any()  # +-448: saturated


@pytest.mark.parametrize("device", devices())
def test_local_producer_rejects_bad_input(device):
    ql_nope, q_pe, pos, cache = make_query(4, 8, device=device)
    with pytest.raises(ValueError, match="'q_pe'.*dtype"):
        ops.query_rope_quant(ql_nope, q_pe.float(), pos, cache)
    with pytest.raises(ValueError, match="'positions'.*size 4"):
        ops.query_rope_quant(ql_nope, q_pe, pos[:3], cache)
    with pytest.raises(ValueError, match="'q_scale'.*None for a bfloat16"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="'rope_style'"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache, rope_style="gptj")
    with pytest.raises(ValueError, match="'ql_nope'.*unit stride"):
        ops.query_rope_quant(ql_nope.transpose(1, 2).contiguous().transpose(1, 2), q_pe, pos, cache)


def test_local_producer_rejects_positions_out_of_range():
    ql_nope, q_pe, pos, cache = make_query(4, 8)
    pos[2] = cache.shape[0]
    with pytest.raises(ValueError, match="'positions'.*at row 2"):
        ops.query_rope_quant(ql_nope, q_pe, pos, cache)


@pytest.mark.parametrize("device", devices())
def test_local_producer_opcheck(device):
    for t, h, dtype, scale in [(1, 2, torch.bfloat16, None), (3, 4, torch.float8_e4m3fn, 0.5)]:
        ql_nope, q_pe, pos, cache = make_query(t, h, nope=64, rope=16, max_pos=32, device=device)
        s = None if scale is None else torch.tensor([scale], device=device)
        torch.library.opcheck(torch.ops.sdcp.query_rope_quant.default, (ql_nope, q_pe, pos, cache, s, False, dtype))


def test_local_producer_compiles_fullgraph():
    ql_nope, q_pe, pos, cache = make_query(4, 8)
    scale = torch.tensor([0.1])
    f = torch.compile(lambda *a: ops.query_rope_quant(*a, rope_style="neox", out_dtype=torch.float8_e4m3fn),
                      fullgraph=True)
    want = ops.query_rope_quant(ql_nope, q_pe, pos, cache, scale, rope_style="neox", out_dtype=torch.float8_e4m3fn)
    assert torch.equal(as_bytes(f(ql_nope, q_pe, pos, cache, scale)), as_bytes(want))


def _nan_producer_worker(rank, world, mode):
    # NaN inputs: the producer writes its canonical NaNs (float8 0x7F, bf16
    # 0x7FC0), the rewrites themselves; gather and view keep them exact.
    import torch_sdcp

    args = rank_workspace_args(rank, mode)
    device = args.get("device", torch.device("cpu"))
    for dtype, scale in ((torch.float8_e4m3fn, torch.tensor([0.02])), (torch.bfloat16, None)):
        with torch_sdcp.QueryWorkspace(None, 8, 4, dtype=dtype, **args) as ws:
            inputs = global_query(world, 6, 4, seed=3)
            for q in inputs:
                q[0][1] = float("nan")
                q[0][3, :, 100:200] = float("nan")
                q[1][4] = float("nan")
                # Negative bf16 NaNs (0xFFC0, set as bits: a float NaN assigned to bf16 loses its sign),
                # whole float8 output words of them: the sentinel, were their sign kept.
                q[0].view(torch.int16)[2, :, 8:40] = -64
            # The local producer of this backend (the CPU and CUDA producers, and
            # the reference, may encode a bf16 NaN differently; the gather keeps the
            # producer's bytes).
            sc = None if scale is None else scale.to(device)
            want = torch.cat([ops.query_rope_quant(*[t.to(device) for t in x], sc, out_dtype=dtype).cpu()
                              for x in inputs], dim=1)
            if dtype == torch.float8_e4m3fn:  # every float8 NaN is 0x7F, as the reference says
                assert torch.equal(as_bytes(want), as_bytes(expected_gather(inputs, scale, "interleaved", dtype)))
                assert (as_bytes(want)[2, :4, 8:40] == 0x7F).all()  # row 2 of rank 0's heads
            mine = [x.to(device) for x in inputs[rank]]
            assert torch.equal(as_bytes(ws.gather(*mine, sc).cpu()), as_bytes(want))
            assert torch.equal(as_bytes(ws.gather_view(*mine, sc).cpu()), as_bytes(want))
            ws.release()
    return True


def test_nan_queries_host():
    assert run_workers(_nan_producer_worker, 2, args=("host",), timeout=120) == [True, True]


@requires_gpus(GPU_WORLD)
def test_nan_queries_cuda():
    assert run_workers(_nan_producer_worker, GPU_WORLD, args=("cuda",), timeout=300) == [True] * GPU_WORLD
