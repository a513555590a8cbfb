"""The vLLM releases the plugin patches, one table per release series: every
vLLM function the plugin replaces, wraps, mirrors or calls, with the
parameter list it was written against (annotations left out), and the
``MLADCPManager`` attributes the patched hooks read or set. The conformance
test (test/test_vllm_conformance.py) reads the installed vLLM's sources and
compares them with the table of its series. docs/VLLM.md ("Versions") says
what changed between the series. No state; never imports vLLM."""

from __future__ import annotations

from torch_sdcp.integrations._engine import accepted_version

__all__ = ["DCP", "GPU_WORKER", "INDEXER", "KIMI_K3_MLA", "MANAGER_ATTRIBUTES_BY_SERIES", "MLA_ATTENTION",
           "PARALLEL_STATE", "SUPPORTED_VLLM_SERIES", "SUPPORTED_VLLM_VERSIONS", "UBATCHING",
           "VLLM_SIGNATURES_BY_SERIES", "series_of", "supported_version"]

DCP = "vllm.v1.attention.ops.dcp"
INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
UBATCHING = "vllm.v1.worker.ubatching"
PARALLEL_STATE = "vllm.distributed.parallel_state"
GPU_WORKER = "vllm.v1.worker.gpu_worker"
# The two layers that build an MLADCPManager (each passes its name as ``prefix``).
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
KIMI_K3_MLA = "vllm.models.kimi_k3.nvidia.mla"

_COMBINE = ("(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True, seq_lens=None, "
            "query_start_loc=None")
_MLA_LAYER = ("(self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank, kv_lora_rank, "
              "kv_b_proj, dcp_q_replicate=False, cache_config=None, quant_config=None, prefix='', attn_backend=None, "
              "use_sparse=False, indexer=None, topk_indices_buffer=None, index_group_builder=None, "
              "non_causal_multi_token_decode=False, ")
_MERGE = "(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts=None"

_SIGNATURES_033 = {
    (DCP, "cp_lse_ag_out_rs"): _COMBINE + ")",
    (DCP, "dcp_a2a_lse_reduce"): _COMBINE + ")",
    (DCP, "MLADCPManager.__init__"): "(self, vllm_config, device, num_heads, query_head_dim, output_head_dim, "
                                     "query_dtype, output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp)",
    (DCP, "MLADCPManager._init_combine"): "(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)",
    (DCP, "MLADCPManager._init_query_gather"): "(self, num_heads, head_dim, dtype)",
    (DCP, "MLADCPManager._gather_query"): "(self, query)",
    (DCP, "reserve_query_head_storage"): "(query, padded_num_heads)",
    (INDEXER, "_merge_dcp_topk_global"): _MERGE + ")",
    (UBATCHING, "dbo_current_ubatch_id"): "()",
    (PARALLEL_STATE, "get_dcp_group"): "()",
    (PARALLEL_STATE, "destroy_model_parallel"): "()",
    (GPU_WORKER, "Worker.sample_tokens"): "(self, grammar_output)",
    (MLA_ATTENTION, "MLAAttention.__init__"): _MLA_LAYER + "sliding_window=None, prefill_backend_cls=None, "
                                                           "**extra_impl_args)",
    (KIMI_K3_MLA, "MultiHeadLatentAttention.__init__"): "(self, config, hidden_size, num_heads, qk_nope_head_dim, "
                                                        "qk_rope_head_dim, v_head_dim, q_lora_rank, kv_lora_rank, "
                                                        "use_output_gate=False, cache_config=None, quant_config=None, "
                                                        "prefix='', aux_stream=None, use_rope=False, "
                                                        "non_causal_multi_token_decode=False, run_gemm_rs_ar=False)",
}

# 0.34.0: the combine writes into ``out``; the merge keys by the logits' dtype
# and the positions' bits and may run on vLLM's direct top-K workspace; the
# combine after the V up-projection; the direct top-K workspace's getter;
# MLAAttention's shardq_eligible and kv_sharing_target_layer_name.
_SIGNATURES_034 = {
    **_SIGNATURES_033,
    (DCP, "dcp_a2a_lse_reduce"): _COMBINE + ", out=None)",
    (DCP, "dcp_a2a_v_up_proj_lse_reduce"): "(cp_attn_out, cp_attn_lse, w_uv, out, cp_group, is_lse_base_on_e=True, "
                                           "seq_lens=None, query_start_loc=None)",
    (INDEXER, "_merge_dcp_topk_global"): _MERGE + ", logits_dtype=torch.float32, num_positions=None, "
                                                  "direct_max_rows=0)",
    (INDEXER, "_get_direct_dcp_topk_workspace"): "(device, max_rows, topk_tokens)",
    (MLA_ATTENTION, "MLAAttention.__init__"): _MLA_LAYER + "shardq_eligible=False, sliding_window=None, "
                                                           "prefill_backend_cls=None, "
                                                           "kv_sharing_target_layer_name=None, **extra_impl_args)",
}

VLLM_SIGNATURES_BY_SERIES = {"0.33": _SIGNATURES_033, "0.34": _SIGNATURES_034}

# Attributes of MLADCPManager the patched hooks read (and, on 0.34, set: the
# V up-projection combine and the early query gather's bound), assigned by
# its __init__ before it calls _init_combine / _init_query_gather.
_ATTRIBUTES_033 = ("group", "device", "num_ubatches", "max_num_tokens", "use_a2a", "padded_num_heads")
MANAGER_ATTRIBUTES_BY_SERIES: dict[str, dict[str, tuple[str, ...]]] = {
    "0.33": {"_init_combine": _ATTRIBUTES_033, "_init_query_gather": _ATTRIBUTES_033},
    "0.34": {"_init_combine": (*_ATTRIBUTES_033, "v_up_proj_combine"),
             "_init_query_gather": (*_ATTRIBUTES_033, "direct_query_gather_max_tokens")},
}

# Releases whose call sites docs/VLLM.md and test/test_vllm_conformance.py were
# checked against; the patch releases of their series are accepted too (the
# conformance suite must pass against a patch release before it is used).
SUPPORTED_VLLM_VERSIONS = ("0.33.0", "0.34.0")
SUPPORTED_VLLM_SERIES = tuple(VLLM_SIGNATURES_BY_SERIES)


def series_of(version: str) -> str | None:
    """The table ``version`` uses (``"0.33"``, ``"0.34"``), or None for a
    version the plugin refuses: a checked release, its post releases, or a
    patch release of a supported series (local suffixes ignored)."""
    for series in SUPPORTED_VLLM_SERIES:
        pinned = tuple(v for v in SUPPORTED_VLLM_VERSIONS if v.startswith(series + "."))
        if accepted_version(version, pinned, series):
            return series
    return None


def supported_version(version: str) -> bool:
    """Whether the plugin patches vLLM ``version`` (see :func:`series_of`)."""
    return series_of(version) is not None
