"""The benchmark's competitors (torch_sdcp.competitors) where no GPU is needed:
the module imports on CPU, the vLLM a2a combine math matches the fp64
reference, and its two Triton kernels (dispatch into every destination's slot,
combine of the own slot) run under the Triton interpreter with N simulated
ranks whose "peer memory" is ordinary CPU tensors, over several calls so that
both slots are used."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import run_workers
from _helpers import poisoned_partials

import torch_sdcp  # noqa: F401
from torch_sdcp import competitors, reference
from torch_sdcp.competitors import _symm, vllm_a2a


def test_module_imports_without_cuda():
    assert competitors.SymmMemOutputLSE and competitors.VllmA2AOutputLSE


def test_enabling_symmetric_memory_is_quiet_and_still_called():
    """The per-group enable call is deprecated as no longer needed from torch
    2.11 on: it is still made (older torch needs it), its FutureWarning is
    not printed, and any other warning still is."""
    import types
    import warnings

    calls = []

    def enable(name, category=FutureWarning):
        calls.append(name)
        warnings.warn("deprecated", category, stacklevel=2)

    group = types.SimpleNamespace(group_name="g0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _symm._enable_for_group(types.SimpleNamespace(enable_symm_mem_for_group=enable), group)
    assert calls == ["g0"] and not seen
    with pytest.warns(UserWarning):
        _symm._enable_for_group(
            types.SimpleNamespace(enable_symm_mem_for_group=lambda n: enable(n, UserWarning)), group)
    _symm._enable_for_group(types.SimpleNamespace(), group)  # absent: nothing to call


@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n,t,h,d,dtype", [(2, 1, 4, 64, torch.bfloat16), (3, 128, 3, 32, torch.float16),
                                           (4, 7, 2, 16, torch.float32)])
def test_a2a_combine_math_matches_the_reference(base2, n, t, h, d, dtype):
    out, lse = poisoned_partials(n, t, h, d, dtype, seed=n + t)
    got, got_lse = vllm_a2a.a2a_combine_math(out, lse, base2)
    want, want_lse = reference.lse_combine_ref64(out, lse, base2)
    assert got.dtype == dtype and got_lse.dtype == torch.float32
    assert not got.isnan().any()
    assert (got[0, 0] == 0).all() and torch.isneginf(got_lse[0, 0])
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _interpreted_kernels(rank, world, n, t, h, d, max_rows, calls):
    # Runs with TRITON_INTERPRET=1: the kernels execute on CPU tensors.
    hl = h // n
    inbox = [torch.zeros(2, n, max_rows, hl, d, dtype=torch.bfloat16) for _ in range(n)]
    inbox_lse = [torch.zeros(2, n, max_rows, hl) for _ in range(n)]
    out_offs = [_symm.element_offsets(inbox, inbox[r], "cpu") for r in range(n)]
    lse_offs = [_symm.element_offsets(inbox_lse, inbox_lse[r], "cpu") for r in range(n)]
    epochs = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    for call in range(calls):
        base2 = call % 2 == 1
        rows = t if call != 1 else 1  # fewer rows than max_rows, and a change of rows
        out, lse = poisoned_partials(n, rows, h, d, torch.bfloat16, seed=100 + call)
        for r in range(n):  # every producer stores before any owner combines (the signal round)
            epochs[r].add_(1)
            vllm_a2a.a2a_dispatch(out[r], lse[r], inbox[r], inbox_lse[r], out_offs[r], lse_offs[r],
                                     epochs[r], r)
        want, want_lse = reference.lse_combine_ref64(out, lse, base2)
        for r in range(n):
            got, got_lse = vllm_a2a.a2a_combine(inbox[r], inbox_lse[r], epochs[r], rows, base2)
            w, wl = reference.output_lse_shard(want, want_lse, r, n)
            assert not got.isnan().any(), (call, r)
            torch.testing.assert_close(got_lse.double(), wl, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.double(), w, rtol=1e-2, atol=1e-2)
            # The kernel is the plain-torch math, up to exp2/log2 rounding.
            slot = int(epochs[r]) % 2
            m, ml = vllm_a2a.a2a_combine_math(inbox[r][slot, :, :rows], inbox_lse[r][slot, :, :rows], base2)
            torch.testing.assert_close(got.float(), m.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got_lse, ml, rtol=1e-6, atol=1e-6)
        # The other slot still holds the previous call's data: nothing wrote it.
    return calls


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter mode)")
def test_a2a_kernels_under_the_triton_interpreter():
    res = run_workers(_interpreted_kernels, 1, args=(3, 5, 6, 64, 8, 3), env={"TRITON_INTERPRET": "1"},
                      timeout=240)
    assert res == [3]
