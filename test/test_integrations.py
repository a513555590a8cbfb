"""Engine adapters (torch_sdcp.integrations): the same results as the
references and the collective paths, return_lse and both LSE bases, the
fallback above the rows bound, preparation, the workspace cache, teardown and
argument errors. Host backend at world sizes 2 and 3; CUDA-graph capture on a
GPU."""

from __future__ import annotations

import logging
import traceback

import pytest
import torch
from _dist import run_workers
from _helpers import requires_gpus

from torch_sdcp import collective, reference
from torch_sdcp import integrations as sdcp


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class _Coordinator:
    """The part of a vLLM GroupCoordinator the adapters read."""

    def __init__(self, device_group):
        self.device_group = device_group


def _as_bytes(x):
    return x.contiguous().view(torch.uint8)


def _query_inputs(world, t, h, nope, rope, seed, max_pos=64):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    per_rank = []
    for _ in range(world):
        ql_nope = (torch.randn(t, h, nope, generator=g) * 3).to(torch.bfloat16)
        q_pe = (torch.randn(t, h, rope, generator=g) * 3).to(torch.bfloat16)
        per_rank.append((ql_nope, q_pe, positions, cache))
    return per_rank


def _partials(world, t, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(world, t, h, d, generator=g).to(torch.bfloat16)
    lse = torch.randn(world, t, h, generator=g) * 4
    lse[0, :, 0] = float("nan")  # empty shards: their payloads must not leak
    out[0, :, 0] = float("nan")
    lse[world - 1, :, 1] = float("inf")
    lse[:, 0, :] = -float("inf")  # row 0: every shard empty
    return out, lse


def _candidates(world, t, c, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(world * t * c, generator=g).view(world, t, c)
    shards = []
    for r in range(world):
        scores = torch.randint(0, 8, (t, c), generator=g).float()  # many ties
        ids = perm[r].to(torch.int32)
        ids[:, 3::7] = -1
        scores[:, 1] = float("nan")
        shards.append((scores, ids))
    return shards


def _check_output(rank, world, got, got_lse, out, lse, base2):
    ref_out, ref_lse = reference.lse_combine_ref64(out, lse, base2=base2)
    ref_out, ref_lse = reference.output_lse_shard(ref_out, ref_lse, rank, world)
    assert not torch.isnan(got).any(), "NaN leaked into the output"
    torch.testing.assert_close(got.double(), ref_out, rtol=2e-2, atol=2e-2)
    if got_lse is not None:
        torch.testing.assert_close(got_lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Host backend, real processes.
# ---------------------------------------------------------------------------


def _adapters_worker(rank, world):
    import torch.distributed as dist

    log = _Collect()
    logging.getLogger("torch_sdcp").addHandler(log)
    group = dist.group.WORLD
    cpu = torch.device("cpu")
    checks = []

    # --- prepared at load time, then used through the adapters -----------------------------
    bound = 4
    ws = sdcp.prepare_mla_dcp(group, max_rows=bound, num_heads=4 * world, kv_lora_rank=64, qk_rope_head_dim=16,
                              index_topk=16, device=cpu, timeout_s=30)
    assert ws.query.peer and ws.output_lse.peer and ws.topk.peer
    assert sdcp.prepare_mla_dcp(group, max_rows=bound, num_heads=4 * world, kv_lora_rank=64, qk_rope_head_dim=16,
                                index_topk=16, device=cpu) == ws, "preparing twice must return the same workspaces"
    ag = sdcp.prepare_all_gather(group, max_rows=bound, row_shape=(4, 80), dtype=torch.bfloat16, device=cpu)
    fp8_style = "neox"
    q8 = sdcp.prepare_query_gather(group, max_rows=bound, local_heads=4, nope_dim=64, rope_dim=16,
                                   out_dtype=torch.float8_e4m3fn, rope_style=fp8_style, device=cpu)
    prepared = sdcp.workspaces()
    assert len(prepared) == 5 and ag in prepared and q8 in prepared

    # --- query: the fused producer + gather, and the plain all_gather on heads ----------------
    for t in (1, bound, bound + 3):  # the last one is above the bound: collective path
        inputs = _query_inputs(world, t, 4, 64, 16, seed=t)
        mine = inputs[rank]
        got = sdcp.query_gather(*mine, group=group, tag=t)  # a call tag on the peer and the collective path
        want = reference.query_gathered_layout(
            [reference.query_rope_quant_ref(*x, out_dtype=torch.bfloat16) for x in inputs])
        assert torch.equal(_as_bytes(got), _as_bytes(want)), f"query_gather bf16 t={t}"
        via_collective = collective.query_all_gather(*mine, group=group)
        assert torch.equal(_as_bytes(got), _as_bytes(via_collective)), f"query_gather vs collective t={t}"

        scale = torch.tensor([0.05])
        got8 = sdcp.query_gather(*mine, scale, group=_Coordinator(group), out_dtype=torch.float8_e4m3fn,
                                 rope_style=fp8_style)
        want8 = reference.query_gathered_layout(
            [reference.query_rope_quant_ref(*x, scale, neox=True, out_dtype=torch.float8_e4m3fn) for x in inputs])
        assert torch.equal(_as_bytes(got8), _as_bytes(want8)), f"query_gather fp8 t={t}"

        # Engines today: produce locally, then all_gather(q, dim=1).
        local = reference.query_rope_quant_ref(*mine, out_dtype=torch.bfloat16)
        gathered = sdcp.all_gather(local, group, dim=1, tag=t)
        assert torch.equal(_as_bytes(gathered), _as_bytes(want)), f"all_gather dim=1 t={t}"
        checks.append(("query", t))

    # all_gather along other dimensions and dtypes (each its own workspace, created on first use)
    for t, shape, dtype, dim in [(3, (5,), torch.int32, 0), (2, (3, 4), torch.float8_e4m3fn, -1),
                                 (bound + 1, (4, 80), torch.bfloat16, 2)]:
        parts = [(torch.arange(t * torch.Size(shape).numel()).view(t, *shape) * world + r).to(torch.float32)
                 .to(dtype) for r in range(world)]
        got = sdcp.all_gather(parts[rank], group, dim=dim)
        assert torch.equal(_as_bytes(got), _as_bytes(torch.cat(parts, dim=dim))), f"all_gather {shape} dim={dim}"
    assert sdcp.workspaces()[:5] == prepared and len(sdcp.workspaces()) == 7

    # --- output/LSE: cp_lse_ag_out_rs, both bases, with and without the LSE -------------------
    h, d = 4 * world, 64
    for t in (1, 3, bound, bound + 2):
        out, lse = _partials(world, t, h, d, seed=100 + t)
        for base_e in (True, False):
            got, got_lse = sdcp.cp_lse_ag_out_rs(out[rank], lse[rank], group, return_lse=True,
                                                 is_lse_base_on_e=base_e, tag=t)
            assert got.shape == (t, h // world, d) and got.dtype == torch.bfloat16
            assert got_lse.shape == (t, h // world) and got_lse.dtype == torch.float32
            _check_output(rank, world, got, got_lse, out, lse, base2=not base_e)
            only = sdcp.cp_lse_ag_out_rs(out[rank], lse[rank], _Coordinator(group), None, False, base_e)
            assert isinstance(only, torch.Tensor) and torch.equal(only, got)
            col_out, col_lse = collective.lse_all_gather_reduce_scatter(out[rank], lse[rank], base2=not base_e,
                                                                        return_lse=True, group=group)
            torch.testing.assert_close(got.float(), col_out.float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(got_lse, col_lse, rtol=1e-5, atol=1e-5)
        # Non-contiguous inputs are accepted (copied).
        strided = out[rank].transpose(0, 1).contiguous().transpose(0, 1)
        assert torch.equal(sdcp.cp_lse_ag_out_rs(strided, lse[rank], group, is_lse_base_on_e=False), got)
        checks.append(("output_lse", t))

    # --- top-K: identical to the reference merge and to the collective path -------------------
    for t in (1, bound, bound + 5):
        shards = _candidates(world, t, 16, seed=200 + t)
        got = sdcp.topk_merge(*shards[rank], group, 16, tag=t)
        assert torch.equal(got, reference.topk_merge_ref(shards, 16)), f"topk_merge t={t}"
        assert torch.equal(got, collective.topk_all_gather_merge(*shards[rank], 16, group=group))
        checks.append(("topk", t))

    # --- the fallback is logged, once per workspace ------------------------------
    joined = "\n".join(log.messages)
    for rows in (bound + 3, bound + 2, bound + 5):
        assert f"{rows} rows exceed max_rows={bound}" in joined, joined
    assert "all_gather adapter" in joined and f"{bound + 1} rows exceed max_rows={bound}" in joined, joined

    # --- created on first use with DEFAULT_MAX_ROWS, and a mismatched preparation ---------------
    count = len(sdcp.workspaces())
    out, lse = _partials(world, 2, 2 * world, 32, seed=7)
    got = sdcp.cp_lse_ag_out_rs(out[rank], lse[rank], group)
    _check_output(rank, world, got, None, out, lse, base2=False)
    lazy = sdcp.workspaces()[-1]
    assert len(sdcp.workspaces()) == count + 1 and lazy.max_rows == sdcp.DEFAULT_MAX_ROWS and lazy.peer
    assert sdcp.prepare_output_lse(group, max_rows=sdcp.DEFAULT_MAX_ROWS, total_heads=2 * world, head_dim=32,
                                   device=cpu) is lazy
    with pytest.raises(ValueError, match=r"argument 'max_rows': expected 128 .*, got 8"):
        sdcp.prepare_output_lse(group, max_rows=8, total_heads=2 * world, head_dim=32, device=cpu)

    # --- a workspace closed directly is dropped from the cache and made again -----------------
    lazy.close()
    got = sdcp.cp_lse_ag_out_rs(out[rank], lse[rank], group)
    _check_output(rank, world, got, None, out, lse, base2=False)
    assert lazy not in sdcp.workspaces() and sdcp.workspaces()[-1].peer

    # --- teardown: closes everything, idempotent; adapters work again afterwards --------------
    held = sdcp.workspaces()
    sdcp.teardown()
    assert sdcp.workspaces() == [] and not any(w.peer for w in held)
    sdcp.teardown()
    shards = _candidates(world, 2, 16, seed=9)
    assert torch.equal(sdcp.topk_merge(*shards[rank], group, 16), reference.topk_merge_ref(shards, 16))
    assert len(sdcp.workspaces()) == 1
    sdcp.teardown()
    sdcp.teardown()
    assert sdcp.workspaces() == []

    _collective_mode(rank, world, group)
    return checks


@pytest.mark.parametrize("world", [2, 3])
def test_adapters_host(world):
    results = run_workers(_adapters_worker, world, timeout=120)
    assert results == [results[0]] * world and len(results[0]) == 10


def _collective_mode(rank, world, group):
    """Workspaces in collective mode (the peer-memory gate fails on every rank,
    fallback=True): every adapter call takes the collective path and still
    gives the right result."""
    from torch_sdcp import peer as peer_mod

    def refuse(stage):
        if stage == "probe":
            raise RuntimeError("peer writes were dropped")

    peer_mod._TEST_HOOK = refuse
    try:
        ws = sdcp.prepare_output_lse(group, max_rows=8, total_heads=2 * world, head_dim=32, device="cpu",
                                     fallback=True)
        ag = sdcp.prepare_all_gather(group, max_rows=8, row_shape=(3,), dtype=torch.bfloat16, device="cpu",
                                     fallback=True)
    finally:
        peer_mod._TEST_HOOK = None
    assert not ws.peer and not ag.peer
    out, lse = _partials(world, 3, 2 * world, 32, seed=11)
    got, got_lse = sdcp.cp_lse_ag_out_rs(out[rank], lse[rank], group, return_lse=True, is_lse_base_on_e=False)
    _check_output(rank, world, got, got_lse, out, lse, base2=True)
    parts = [torch.full((2, 3), float(r), dtype=torch.bfloat16) for r in range(world)]
    assert torch.equal(sdcp.all_gather(parts[rank], group, dim=0), torch.cat(parts, dim=0))
    assert sdcp.workspaces() == [ws, ag], "a collective-mode workspace stays cached"
    sdcp.teardown()
    sdcp.teardown()


# ---------------------------------------------------------------------------
# In this process (a one-rank group): argument errors, torch.compile.
# ---------------------------------------------------------------------------


def test_argument_errors(world1):
    out, lse = torch.zeros(2, 4, 32, dtype=torch.bfloat16), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"argument 'cp_attn_out': expected 3 dimensions, got 2 \(shape \[2, 4\]\)"):
        sdcp.cp_lse_ag_out_rs(lse, lse, world1)
    with pytest.raises(ValueError, match=r"argument 'cp_attn_lse': expected shape \[2, 4\] .*, got shape \[2, 3\]"):
        sdcp.cp_lse_ag_out_rs(out, lse[:, :3], world1)
    with pytest.raises(ValueError, match=r"argument 'cp_attn_out': expected .*bfloat16.*, got torch.float64"):
        sdcp.cp_lse_ag_out_rs(out.double(), lse, world1)
    with pytest.raises(ValueError, match=r"argument 'return_lse': expected a bool, got 'yes'"):
        sdcp.cp_lse_ag_out_rs(out, lse, world1, return_lse="yes")
    with pytest.raises(ValueError, match=r"argument 'is_lse_base_on_e': expected a bool, got 2"):
        sdcp.cp_lse_ag_out_rs(out, lse, world1, is_lse_base_on_e=2)
    with pytest.raises(ValueError, match=r"argument 'cp_group': expected a torch.distributed ProcessGroup.*got str"):
        sdcp.cp_lse_ag_out_rs(out, lse, "dcp")
    with pytest.raises(ValueError, match=r"argument 'group': expected .*got _Coordinator"):
        sdcp.topk_merge(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int32), _Coordinator("nccl"), 4)
    with pytest.raises(ValueError, match=r"argument 'k': expected an int >= 1, got 0"):
        sdcp.topk_merge(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int32), world1, 0)
    with pytest.raises(ValueError, match=r"argument 'ids': expected a Tensor, got list"):
        sdcp.topk_merge(torch.zeros(2, 8), [[0]], world1, 4)
    tag = r"argument 'tag': expected None or an int in \[0, 8388607\), got "
    with pytest.raises(ValueError, match=tag + "-1"):
        sdcp.cp_lse_ag_out_rs(out, lse, world1, tag=-1)
    with pytest.raises(ValueError, match=tag + "bool"):
        sdcp.topk_merge(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int32), world1, 4, tag=False)
    with pytest.raises(ValueError, match=tag + "8388607"):
        sdcp.all_gather(out, world1, tag=2**23 - 1)
    with pytest.raises(ValueError, match=r"argument 'dim': expected an int in \[-3, 3\), got 3"):
        sdcp.all_gather(out, world1, dim=3)
    with pytest.raises(ValueError, match=r"argument 'input_': expected a tensor with at least one dimension"):
        sdcp.all_gather(torch.tensor(1.0), world1)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    pe, pos, cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"argument 'out_dtype': expected .*, got torch.float32"):
        sdcp.query_gather(q, pe, pos, cache, group=world1, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"argument 'rope_style'"):
        sdcp.query_gather(q, pe, pos, cache, group=world1, rope_style="gptj")
    with pytest.raises(ValueError, match=r"argument 'q_pe': expected 3 dimensions, got"):
        sdcp.query_gather(q, pe[0], pos, cache, group=world1)
    with pytest.raises(ValueError, match=r"argument 'max_rows': expected an int >= 1, got 0"):
        sdcp.prepare_output_lse(world1, max_rows=0, total_heads=4, head_dim=32)
    with pytest.raises(ValueError, match=r"argument 'row_shape': expected an int, got float"):
        sdcp.prepare_all_gather(world1, max_rows=4, row_shape=(2.0,), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'device': expected a cpu or cuda device, got meta"):
        sdcp.prepare_topk(world1, max_rows=4, k=8, device="meta")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'backend'"):
        sdcp.prepare_topk(world1, max_rows=4, k=8, device="cpu", backend="host")
    assert sdcp.workspaces() == [], "argument errors must not create workspaces"


def test_compiles_fullgraph_after_prepare(world1):
    """The adapters trace without graph breaks once their workspaces exist; a
    missing one is an error inside the compiled region, never a creation."""
    try:
        sdcp.prepare_output_lse(world1, max_rows=8, total_heads=4, head_dim=32, device="cpu")
        sdcp.prepare_topk(world1, max_rows=8, k=4, candidates_per_rank=8, device="cpu")
        sdcp.prepare_all_gather(world1, max_rows=8, row_shape=(4, 32), dtype=torch.bfloat16, device="cpu")

        def step(out, lse, scores, ids):
            combined, combined_lse = sdcp.cp_lse_ag_out_rs(out, lse, world1, return_lse=True,
                                                           is_lse_base_on_e=False)
            return sdcp.all_gather(combined, world1, dim=1), combined_lse, sdcp.topk_merge(scores, ids, world1, 4)

        out, lse = _partials(1, 3, 4, 32, seed=3)
        shards = _candidates(1, 3, 8, seed=3)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        got, want = compiled(out[0], lse[0], *shards[0]), step(out[0], lse[0], *shards[0])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=False))
        _check_output(0, 1, got[0], got[1], out, lse, base2=True)
        assert len(sdcp.workspaces()) == 3

        unprepared = torch.compile(lambda o, l: sdcp.cp_lse_ag_out_rs(o, l, world1), fullgraph=True,
                                   backend="aot_eager")
        o, l = _partials(1, 3, 8, 32, seed=4)
        with pytest.raises(Exception) as info:
            unprepared(o[0], l[0])
        text = "".join(traceback.format_exception(info.value))
        assert "prepare_output_lse" in text and "torch.compile tracing" in text, text
        assert len(sdcp.workspaces()) == 3
    finally:
        sdcp.teardown()


# ---------------------------------------------------------------------------
# CUDA graph capture (one GPU, one rank).
# ---------------------------------------------------------------------------


def _capture_worker(rank, world):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t, h, d = 4, 8, 128
    out, lse = _partials(1, t, h, d, seed=5)
    static_out, static_lse = out[0].to(device), lse[0].to(device)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare_output_lse") as info, torch.cuda.graph(graph):
        sdcp.cp_lse_ag_out_rs(static_out, static_lse, None)
    assert "CUDA graph capture" in str(info.value) and "prepare_output_lse" in str(info.value), str(info.value)
    assert sdcp.workspaces() == []

    sdcp.prepare_output_lse(None, max_rows=8, total_heads=h, head_dim=d, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream
        sdcp.cp_lse_ag_out_rs(static_out, static_lse, None, return_lse=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = sdcp.cp_lse_ag_out_rs(static_out, static_lse, None, return_lse=True)
    for i in range(3):
        out, lse = _partials(1, t, h, d, seed=50 + i)
        static_out.copy_(out[0])
        static_lse.copy_(lse[0])
        graph.replay()
        torch.cuda.synchronize()
        _check_output(0, 1, result[0].cpu(), result[1].cpu(), out, lse, base2=False)
    del graph
    sdcp.teardown()
    return True


@requires_gpus(1)
def test_capture_without_prepare_is_an_error_cuda():
    assert run_workers(_capture_worker, 1, timeout=300) == [True]
