"""Output/LSE boundary: the local combine, the peer combine (host backend at
world sizes 1-4, CUDA on 2 GPUs), opcheck, torch.compile, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import torch_sdcp
from torch_sdcp import ops, reference

from conftest import devices


def make_partials(n, t, h, d, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, t, h, d, generator=g).to(dtype).to(device)
    lse = (torch.randn(n, t, h, generator=g) * 4).to(device)
    return out, lse


def poison_lse(out, lse, g):
    """NaN/+inf/-inf LSE columns, all-empty rows, NaN payloads under zero weight."""
    n, t, h = lse.shape
    lse[0, :, 0] = float("nan")
    lse[min(1, n - 1), :, 1 % h] = float("inf")
    lse[:, 0, :] = -float("inf")  # row 0: every shard empty
    if h > 2:
        lse[0, :, 2] = -float("inf")
        out[0, :, 2] = float("nan")  # zero weight: must not leak
    out[0, :, 0] = float("nan")  # NaN LSE is empty: payload must not leak
    return out, lse


def check_close(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any(), "NaN leaked into the output"
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5, equal_nan=False)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n,t,h,d", [(1, 1, 4, 128), (2, 17, 32, 128), (3, 8, 6, 256), (4, 64, 8, 512)])
def test_local_combine_matches_reference(device, base2, n, t, h, d):
    out, lse = make_partials(n, t, h, d, device=device, seed=n * 100 + t)
    out, lse = poison_lse(out, lse, None)
    got_out, got_lse = ops.lse_combine(out, lse, lse_base="2" if base2 else "e")
    ref_out, ref_lse = reference.lse_combine_ref64(out.cpu(), lse.cpu(), base2=base2)
    check_close(got_out.cpu(), got_lse.cpu(), ref_out, ref_lse)
    assert torch.equal(got_out[0].cpu(), torch.zeros_like(got_out[0].cpu())), "all-empty row must be exactly 0"
    assert torch.isneginf(got_lse[0]).all(), "all-empty row must have LSE -inf"


@pytest.mark.parametrize("device", devices())
def test_local_combine_rejects_bad_input(device):
    out, lse = make_partials(2, 4, 4, 128, device=device)
    with pytest.raises(ValueError, match="partial_lse.*dtype"):
        ops.lse_combine(out, lse.double())
    with pytest.raises(ValueError, match="partial_out.*contiguous"):
        ops.lse_combine(out.transpose(1, 2), lse.transpose(1, 2))
    with pytest.raises(ValueError, match="partial_lse.*size 4 at dim 1"):
        ops.lse_combine(out, lse[:, :3].contiguous())
    with pytest.raises(ValueError, match="lse_base"):
        ops.lse_combine(out, lse, lse_base="10")


@pytest.mark.parametrize("device", devices())
def test_local_combine_opcheck(device):
    for n, t, h, d, dtype in [(1, 1, 2, 128, torch.bfloat16), (2, 5, 4, 128, torch.float32),
                              (3, 2, 3, 256, torch.float16)]:
        out, lse = make_partials(n, t, h, d, dtype=dtype, device=device)
        torch.library.opcheck(torch.ops.sdcp.lse_combine.default, (out, lse, False))
        torch.library.opcheck(torch.ops.sdcp.lse_combine.default, (out, lse, True))


def test_local_combine_compiles_fullgraph():
    out, lse = make_partials(2, 4, 4, 128)
    f = torch.compile(lambda o, l: ops.lse_combine(o, l, lse_base="2"), fullgraph=True, backend="inductor")
    got = f(out, lse)
    want = ops.lse_combine(out, lse, lse_base="2")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
