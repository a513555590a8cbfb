"""The benchmark's competitors (torch_sdcp.competitors) where no GPU is needed:
the module imports on CPU, the vLLM a2a and FlashInfer fused merge math
matches the fp64 reference, and their Triton kernels (vLLM a2a: dispatch into
every destination's slot, combine of the own slot; FlashInfer fused: put and
wait + merge) run under the Triton interpreter with N simulated ranks whose
"peer memory" is ordinary CPU tensors, over several calls so that both slots
are used; FlashInfer fused's bounded spins give up and the host check names
the missing peer."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from _dist import run_workers
from _helpers import poisoned_partials

import torch_sdcp  # noqa: F401
from torch_sdcp import competitors, reference
from torch_sdcp.competitors import _symm, flashinfer_combine, vllm_a2a


def test_module_imports_without_cuda():
    assert competitors.SymmMemOutputLSE and competitors.VllmA2AOutputLSE and competitors.FlashInferFusedCombine


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


# ---------------------------------------------------------------------------
# FlashInfer fused: the merge math against the reference, its kernel against
# the math under the Triton interpreter (simulated ranks: put for every rank,
# then wait + merge for every rank; world 1: the fused launch), bounded spins.
# ---------------------------------------------------------------------------


def _finite_payloads(out: torch.Tensor, seed: int) -> torch.Tensor:
    """``out`` with its NaN payloads (those of empty shards) replaced by finite values."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(out.isnan(), torch.randn(out.shape, generator=g).to(out.dtype) * 100, out)


@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n,t,h,d,dtype", [(2, 1, 4, 64, torch.bfloat16), (3, 128, 3, 32, torch.float16),
                                           (4, 7, 8, 16, torch.float32)])
def test_fi_combine_math_matches_the_reference(base2, n, t, h, d, dtype):
    """NaN, +inf and -inf LSEs carry no weight; a row whose shards are all
    empty (-inf or NaN) gives 0 and LSE -inf; the rest is the reference."""
    out, lse = poisoned_partials(n, t, h, d, dtype, seed=n + t)
    out = _finite_payloads(out, n)
    want, want_lse = reference.lse_combine_ref64(out, lse, base2)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for r in range(n):
        got, got_lse = flashinfer_combine.fi_combine_math(out, lse, r, base2)
        w, wl = reference.output_lse_shard(want, want_lse, r, n)
        assert got.dtype == dtype and got_lse.dtype == torch.float32 and got.shape == w.shape
        torch.testing.assert_close(got_lse.double(), wl, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), w, rtol=tol, atol=tol)
    first, first_lse = flashinfer_combine.fi_combine_math(out, lse, 0, base2)
    assert (first[0, 0] == 0).all() and torch.isneginf(first_lse[0, 0])  # every shard -inf
    last, last_lse = flashinfer_combine.fi_combine_math(out, lse, 1 // (h // n), base2)
    assert (last[-1, 1 % (h // n)] == 0).all() and torch.isneginf(last_lse[-1, 1 % (h // n)])  # every shard NaN


def test_fi_combine_math_reads_zero_weight_payloads():
    """FlashInfer multiplies every payload by its weight: a NaN payload of an
    empty shard turns its row into NaN (the reference never reads it)."""
    out = torch.ones(2, 1, 2, 8)
    lse = torch.tensor([[[1.0, 1.0]], [[-math.inf, 2.0]]])
    out[1, 0, 0] = math.nan
    got, got_lse = flashinfer_combine.fi_combine_math(out, lse, 0)
    want, _ = reference.lse_combine_ref64(out, lse)
    assert got[0, 0].isnan().all() and not want[0, 0].isnan().any()
    assert got_lse[0, 0] == 1.0  # the LSE has no payload in it


def _fi_workspaces(n, max_rows, hl, d, dtype):
    nbytes = flashinfer_combine.workspace_bytes(max_rows * hl, n, d, dtype)
    ws = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(n)]
    views = [flashinfer_combine.workspace_views(w, n, max_rows * hl, d, dtype) for w in ws]
    offs = [_symm.element_offsets(ws, ws[r], "cpu") for r in range(n)]
    syncs = [torch.zeros(flashinfer_combine.SYNC_WORDS, dtype=torch.int32) for _ in range(n)]
    return views, offs, syncs


def _fi_interpreted(rank, world, n, h, d, max_rows, calls, grid_cap):
    # Runs with TRITON_INTERPRET=1: the kernel executes on CPU tensors.
    fi = flashinfer_combine
    views, offs, syncs = _fi_workspaces(n, max_rows, h // n, d, torch.bfloat16)
    for call in range(calls):
        base2 = call % 2 == 1
        rows = 1 if call % 3 == 1 else max_rows  # 1 row: one program per destination; max: spread puts
        out, lse = poisoned_partials(n, rows, h, d, torch.bfloat16, seed=200 + call)
        if call % 2:
            out = _finite_payloads(out, call)
        phases = ("fused",) if n == 1 else ("put", "merge")
        got = [None] * n
        for phase in phases:  # every producer's put before any owner's wait (a sequential interpreter)
            for r in range(n):
                got[r] = fi.fi_launch(out[r], lse[r], views[r], offs[r], syncs[r], r, base2, grid_cap, phase)
        want, want_lse = reference.lse_combine_ref64(out, lse, base2)
        for r in range(n):
            o, ol, _ = got[r]
            assert int(views[r]["state"][0]) == call + 1 and int(views[r]["state"][1]) == call  # epoch words
            assert (views[r]["ready"][call % 2] == call + 1).all()  # every source's flag of this slot
            spec, spec_lse = fi.fi_combine_math(out, lse, r, base2)
            torch.testing.assert_close(o.float(), spec.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
            torch.testing.assert_close(ol, spec_lse, rtol=1e-6, atol=1e-6)
            if call % 2:  # finite payloads: the reference too
                w, wl = reference.output_lse_shard(want, want_lse, r, n)
                torch.testing.assert_close(o.double(), w, rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(ol.double(), wl, rtol=1e-5, atol=1e-5)
            fi.check_status(syncs[r], r)  # no spin gave up
    return calls


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter mode)")
@pytest.mark.parametrize("n,grid_cap", [(3, 4), (3, 64), (1, 1)])
def test_fi_kernel_under_the_triton_interpreter(n, grid_cap):
    """Both slots (4 calls), 1 row (entries < 16: one program per destination)
    and 9 rows (18 entries: puts spread over the grid), grids smaller and
    larger than the work; world 1 runs the fused launch whole."""
    res = run_workers(_fi_interpreted, 1, args=(n, 2 * n, 64, 9, 4, grid_cap), env={"TRITON_INTERPRET": "1"},
                      timeout=300)
    assert res == [4]


def _fi_gives_up(rank, world):
    fi = flashinfer_combine
    views, offs, syncs = _fi_workspaces(2, 2, 2, 16, torch.bfloat16)
    out, lse = poisoned_partials(2, 2, 4, 16, torch.bfloat16, seed=1)
    fi.fi_launch(out[0], lse[0], views[0], offs[0], syncs[0], 0, False, 4, "put")  # rank 1 never puts
    fi.fi_launch(out[0], lse[0], views[0], offs[0], syncs[0], 0, False, 4, "merge", spin_limit=5)
    messages = []
    with pytest.raises(RuntimeError, match="rank 0 gave up waiting for peer 1") as e:
        fi.check_status(syncs[0], 0)
    messages.append(str(e.value))
    # World 1 fused on 2 programs: run one after another, the first waits at
    # the grid barrier for the second, which never comes while it waits.
    views, offs, syncs = _fi_workspaces(1, 2, 2, 16, torch.bfloat16)
    fi.fi_launch(out[0][:, :2], lse[0][:, :2], views[0], offs[0], syncs[0], 0, False, 2, "fused", spin_limit=5)
    with pytest.raises(RuntimeError, match="grid barrier gave up") as e:
        fi.check_status(syncs[0], 0)
    messages.append(str(e.value))
    return messages


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter mode)")
def test_fi_spins_are_bounded():
    """A peer that never publishes, a grid that is not co-resident: the spin
    gives up after the limit, and the host check names what was missing."""
    (messages,) = run_workers(_fi_gives_up, 1, env={"TRITON_INTERPRET": "1"}, timeout=240)
    assert len(messages) == 2
