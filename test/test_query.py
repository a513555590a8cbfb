"""Query boundary: the fused RoPE/FP8 producer, the peer gather (host backend
at world sizes 1-4, CUDA on 2 GPUs), opcheck, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from torch_sdcp import ops, reference

from conftest import devices


def make_query(t, h, *, nope=512, rope=64, max_pos=4096, seed=0, cache_dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ql_nope = (torch.randn(t, h, nope, generator=g) * 3).to(torch.bfloat16)
    q_pe = (torch.randn(t, h, rope, generator=g) * 3).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(cache_dtype)
    return [x.to(device) for x in (ql_nope, q_pe, positions, cache)]


def as_bytes(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.view(torch.int16)


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
