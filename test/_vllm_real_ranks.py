"""One rank of test_vllm_real.py's two-rank case, in a process of its own:
vLLM's own distributed state on gloo (CPU), the plugin loaded by vLLM's
``load_general_plugins``, a real ``MLADCPManager`` per DCP backend, and the
patched seams (host backend) compared with vLLM's own functions on the same
inputs: the combine of both backends (both LSE bases, masked and not) within
one bf16 ulp of vLLM's plain-torch combine and vLLM's own mask, the query
gather bitwise equal to the manager's own ``_gather_query``, the top-K merge
exactly equal to a plain-torch merge (vLLM's own merge and its Triton
combines need a GPU); a real ``MLAAttention`` (vLLM's CPU backends) builds
its manager with the layer index of its ``prefix`` as the call tag, a
manager built outside a layer calls untagged.

    RANK=r WORLD_SIZE=2 MASTER_PORT=p python test/_vllm_real_ranks.py

prints ``rank r: <n> checks passed`` and exits 0, or raises.
"""

from __future__ import annotations

import logging
import os

import torch

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
LOCAL_HEADS, KV_LORA, ROPE = 4, 512, 64  # per rank after TP; GLM-5 / DeepSeek-V3.2 head widths
ROWS = 5


class Kept(logging.Handler):
    """The messages of vLLM's logger tree (the plugin logs there)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """|got - want| <= one bf16 ulp of the larger magnitude, NaN where NaN."""
    g, w = got.float(), want.float()
    same_nan = torch.isnan(g) == torch.isnan(w)
    mag = torch.maximum(g.abs(), w.abs()).nan_to_num(0.0).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    close = ((g - w).abs() <= ulp) | (torch.isnan(g) & torch.isnan(w))
    return bool(same_nan.all() and close.all())


def main() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.model_executor.layers.sparse_attn_indexer as indexer
    import vllm.v1.attention.ops.dcp as dcp
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from torch_sdcp.integrations import vllm as plugin

    assert plugin.is_installed(), "load_general_plugins did not install the plugin"
    logged = Kept()
    logging.getLogger("vllm").addHandler(logged)
    logging.getLogger("vllm").setLevel(logging.INFO)  # as vLLM's engine configures it
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))  # no GPU: vLLM cannot infer the platform
    config.parallel_config.tensor_parallel_size = WORLD
    config.parallel_config.decode_context_parallel_size = WORLD
    checks = 0
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=WORLD, rank=RANK, local_rank=RANK, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        ps.initialize_model_parallel(tensor_model_parallel_size=WORLD, decode_context_model_parallel_size=WORLD,
                                     backend="gloo")
        group = ps.get_dcp_group()
        g = torch.Generator().manual_seed(1234 + RANK)
        for backend in ("ag_rs", "a2a"):
            config.parallel_config.dcp_comm_backend = backend
            for base_e in (True, False):
                manager = dcp.MLADCPManager(config, torch.device("cpu"), LOCAL_HEADS, KV_LORA + ROPE, KV_LORA,
                                            torch.bfloat16, torch.bfloat16, None, base_e, False)
                ours = plugin.dcp_a2a_lse_reduce if backend == "a2a" else plugin.cp_lse_ag_out_rs
                assert manager.combine.func is ours, f"{backend}: the manager's combine is {manager.combine}"
                for masked in (False, True):
                    out = (torch.randn(ROWS, LOCAL_HEADS * WORLD, KV_LORA, generator=g) * 2).to(torch.bfloat16)
                    lse = torch.randn(ROWS, LOCAL_HEADS * WORLD, generator=g) * 4
                    kw = {}
                    if masked:  # three requests; this rank holds no KV of request 1 (rank 0) or 2 (rank 1)
                        kw = {"seq_lens": torch.tensor([3, 0, 5] if RANK == 0 else [2, 4, 0], dtype=torch.int32),
                              "query_start_loc": torch.tensor([0, 1, 3, ROWS], dtype=torch.int32)}
                    mine = manager.combine(out.clone(), lse.clone(), **kw)
                    theirs = vllm_combine(dcp, group, out, lse, base_e, kw)
                    assert mine.shape == theirs.shape, (backend, mine.shape, theirs.shape)
                    assert within_one_ulp(mine, theirs), (backend, base_e, masked, (mine.float() - theirs.float())
                                                          .abs().max())
                    checks += 1
            query = (torch.randn(ROWS, LOCAL_HEADS, KV_LORA + ROPE, generator=g)).to(torch.bfloat16)
            assert manager.query_gather is not None
            mine_q = manager.query_gather(query)
            theirs_q = manager._gather_query(query)
            assert torch.equal(mine_q, theirs_q), "query gather differs from vLLM's _gather_query"
            assert (manager.combine.keywords["tag"], manager.query_gather.keywords["tag"]) == (None, None)
            checks += 1
        checks += check_topk(indexer, plugin, group)
        checks += check_layer_tag()
        seams = [m for m in logged.messages if "DCP group" in m]  # info_once: the node's first rank logs it
        assert len(seams) == (RANK == 0) and all("combine ON" in m and "query ON" in m for m in seams), seams
        checks += 1
        plugin.teardown()
    print(f"rank {RANK}: {checks} checks passed", flush=True)


def vllm_combine(dcp, group, out, lse, base_e, kw):
    """vLLM's own result of either backend (the same combine; only the
    collectives differ): vLLM's mask (mask_dcp_empty_shards_) and vLLM's
    plain-torch reference of the combine (_lse_weighted_combine) over the
    gathered partials. vLLM's Triton kernels cannot run here: without a GPU
    vLLM replaces triton.jit with a placeholder."""
    lse = lse.clone()
    dcp.mask_dcp_empty_shards_(lse, kw.get("seq_lens"), kw.get("query_start_loc"))
    outs = group.all_gather(out.unsqueeze(0), dim=0)
    lses = group.all_gather(lse.unsqueeze(0), dim=0)
    combined = dcp._lse_weighted_combine(outs, lses, is_lse_base_on_e=base_e)
    heads = out.shape[1] // WORLD
    return combined[:, RANK * heads:(RANK + 1) * heads].to(out.dtype)


def check_layer_tag() -> int:
    """A real MLAAttention built as a model builds it (its name as ``prefix``,
    vLLM's CPU MLA decode and prefill backends: the platform cannot be
    inferred without a GPU): the wrapped constructor passes the layer's index
    to the manager it builds, as the call tag of its combine and query gather."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    nope, v_head, layer = 128, 128, 7
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the layer's activation dtype, as a bf16 model sets it
    try:
        kv_b_proj = ColumnParallelLinear(KV_LORA, LOCAL_HEADS * WORLD * (nope + v_head), bias=False,
                                         prefix=f"model.layers.{layer}.self_attn.kv_b_proj")
        attn = MLAAttention(LOCAL_HEADS, nope ** -0.5, nope, ROPE, v_head, None, KV_LORA, kv_b_proj,
                            prefix=f"model.layers.{layer}.self_attn.attn", attn_backend=AMXMLABackend,
                            prefill_backend_cls=CPUSDPAMLAPrefillBackend)
    finally:
        torch.set_default_dtype(dtype)
    manager = attn.dcp_manager
    assert manager is not None, "a DCP group of 2 and no MLADCPManager"
    assert manager.query_gather is not None
    tags = (manager.combine.keywords["tag"], manager.query_gather.keywords["tag"])
    assert tags == (layer, layer), f"MLAAttention model.layers.{layer}: the manager's call tags are {tags}"
    return 1


def check_topk(indexer, plugin, group) -> int:
    """The patched top-K merge (vLLM's own needs CuteDSL, a GPU) against a
    plain-torch merge of every rank's candidates: score descending, lower
    global id first on ties, -1 padded; ties and short candidate lists
    included."""
    from torch_sdcp import reference

    k, length = 8, 40
    assert plugin.try_prepare_topk(group, max_rows=ROWS, k=k, device=torch.device("cpu"), num_ubatches=1)
    g = torch.Generator().manual_seed(99 + RANK)
    logits = torch.randn(ROWS, length, generator=g)
    logits[0, :6] = 1.0  # ties within and across ranks
    local = torch.topk(logits, k, dim=1).indices.to(torch.int32)
    local[1, -3:] = -1  # a rank with fewer candidates
    merged = local.clone()
    indexer._merge_dcp_topk_global(logits, merged, k, RANK, WORLD, 1)
    every_logits = group.all_gather(logits.unsqueeze(0), dim=0)
    every_local = group.all_gather(local.unsqueeze(0), dim=0)
    for t in range(ROWS):
        candidates = sorted((-float(every_logits[r, t, j]), int(reference.token_global_index(j, r, WORLD)))
                            for r in range(WORLD) for j in every_local[r, t].tolist() if j >= 0)
        want = [gid for _, gid in candidates[:k]]
        want += [-1] * (k - len(want))
        assert merged[t].tolist() == want, (t, merged[t].tolist(), want)
    return 1


if __name__ == "__main__":
    main()
