"""A stand-in for the parts of vLLM 0.33.0 and 0.34.0 the vLLM plugin touches (module
paths, signatures, the by-name imports of the top-K merge, the DCP manager,
the worker's step, the shutdown call), whose DCP functions are vLLM's own in
plain torch over gloo: the reference the plugin's results are compared with.
Built from one small helper per vLLM module; used by test_vllm_plugin.py and
test_vllm_lifecycle.py; holds no tests. test_vllm_conformance.py checks the
signatures against vLLM's sources. ``build_fake_vllm(version)``: a 0.34
version gives 0.34's shapes (the combine's ``out=``, the combine after the V
up-projection, the merge's three parameters and its key, the direct top-K
getter, the manager's ``v_up_proj_combine`` and
``direct_query_gather_max_tokens``, MLAAttention's two parameters). The two
layers that build a manager: ``Layer``.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import threading
import types

import torch
import torch.distributed as dist
from _engine_stand_in import Collect, InModules, all_gather_bytes, packages

from torch_sdcp import collective

DCP = "vllm.v1.attention.ops.dcp"
INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
GLM_INDEXER = "vllm.models.glm5next.nvidia.sparse_indexer"  # a model module that imports the merge by name
PARALLEL_STATE = "vllm.distributed.parallel_state"
GPU_WORKER = "vllm.v1.worker.gpu_worker"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
KIMI_K3_MLA = "vllm.models.kimi_k3.nvidia.mla"
VLLM_MODULES = (
    "vllm", "vllm.logger", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops", DCP,
    "vllm.v1.worker", "vllm.v1.worker.ubatching", GPU_WORKER, "vllm.distributed", PARALLEL_STATE,
    "vllm.model_executor", "vllm.model_executor.layers", INDEXER, "vllm.model_executor.layers.attention",
    MLA_ATTENTION, "vllm.models", "vllm.models.glm5next", "vllm.models.glm5next.nvidia", GLM_INDEXER,
    "vllm.models.kimi_k3", "vllm.models.kimi_k3.nvidia", KIMI_K3_MLA,
)

BOUND = 512  # vLLM's default DCP workspace bound (get_dcp_workspace_max_num_tokens)
H_LOC, D, W, P = 2, 32, 48, 8  # local heads, latent dim, query width, padded query heads

_Collect = Collect  # the name the tests import


class Coordinator:
    """The part of vLLM's GroupCoordinator the DCP code uses. ``groups`` maps
    a micro-batch id to a gloo group for the collectives of the stand-in's own
    (fallback) functions: vLLM serialises its DBO threads around collectives,
    this stand-in gives each micro-batch its own group instead."""

    def __init__(self, cpu_group, groups, ubatch_id):
        self.cpu_group = cpu_group
        self.device_group = cpu_group
        self.groups = groups
        self.ubatch_id = ubatch_id
        self.world_size = dist.get_world_size(cpu_group)
        self.rank_in_group = dist.get_rank(cpu_group)
        self.unique_name = "dcp:0"

    def pg(self):
        return self.groups[self.ubatch_id()]

    def all_gather(self, x, dim=-1):
        return all_gather_bytes(x, self.world_size, self.pg(), dim)


def mask_loop(lse, seq_lens, qsl):
    """Empty-shard masking, row by row (the contract, written plainly)."""
    lse = lse.clone()
    if seq_lens is None:
        return lse
    starts, lens = qsl.tolist(), seq_lens.tolist()
    for t in range(lse.shape[0]):
        if not lens or t >= starts[-1] or lens[min(bisect.bisect_right(starts, t) - 1, len(lens) - 1)] == 0:
            lse[t] = -math.inf
    return lse


def vllm_select(scores, ids, k, score_bits=32):
    """vLLM's candidate selector as its key defines it: the fp32 score's bits
    made monotonic (so -0.0 < +0.0, +NaN above +inf, -NaN below -inf), of
    which 0.34 keeps the top ``score_bits`` (16 for bf16 logits), then the
    lower id; ids < 0 never beat a valid candidate. vLLM leaves the order
    within the selected set unspecified: this model returns it sorted."""
    bits = scores.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    skey = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000) >> (32 - score_bits)
    skey = torch.where(ids >= 0, skey, -1)
    order = torch.sort(ids.long(), dim=1, stable=True).indices
    order = order.gather(1, torch.sort(skey.gather(1, order), dim=1, descending=True, stable=True).indices)
    top = order[:, :k]
    out = torch.where(skey.gather(1, top) >= 0, ids.gather(1, top), -1).to(torch.int32)
    if out.shape[1] < k:
        out = torch.cat([out, out.new_full((out.shape[0], k - out.shape[1]), -1)], dim=1)
    return out


def is_034(ns):
    return ns.version.startswith("0.34")


# ---------------------------------------------------------------------------
# One helper per vLLM module
# ---------------------------------------------------------------------------


def _ubatch(ns):
    return getattr(ns.ubatch, "id", 0)


def _logger(ns, mod):
    def init_logger(name):
        logger = logging.getLogger(name)
        logger.warning_once = lambda msg, *a: logger.warning(msg, *a)
        logger.info_once = lambda msg, *a: logger.info(msg, *a)
        return logger

    mod.init_logger = init_logger


def _parallel_state(ns, mod, reexport):
    """get_dcp_group and destroy_model_parallel, re-exported by vllm.distributed as in vLLM."""

    def get_dcp_group():
        return ns.coordinator

    def destroy_model_parallel():
        ns.calls.append(("destroy_model_parallel", 0))
        ns.coordinator = None

    for m in (mod, reexport):
        m.get_dcp_group = get_dcp_group
        m.destroy_model_parallel = destroy_model_parallel


def _gpu_worker(ns, mod):
    class Worker:
        """vLLM's GPU worker: one step's output, synchronous or async
        (``get_output`` waits for the copy to the host)."""

        def __init__(self, output=None):
            self.output = output

        def sample_tokens(self, grammar_output):
            ns.calls.append(("sample_tokens", 0))
            return self.output

    mod.Worker = Worker


def _combines(ns, dcp):
    """vLLM's two Output/LSE combines: masking first, then the LSE-weighted sum."""

    def combine(name, cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                seq_lens=None, query_start_loc=None):
        ns.calls.append((name, _ubatch(ns)))
        out = cp_attn_out.squeeze(1) if cp_attn_out.dim() == 4 else cp_attn_out
        lse = mask_loop(cp_attn_lse.float(), seq_lens, query_start_loc)
        return collective.lse_all_gather_reduce_scatter(out, lse, base2=not is_lse_base_on_e,
                                                        return_lse=return_lse, group=cp_group.pg())

    def cp_lse_ag_out_rs(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                         seq_lens=None, query_start_loc=None):
        return combine("cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse,
                       is_lse_base_on_e, seq_lens, query_start_loc)

    def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                           seq_lens=None, query_start_loc=None):
        return combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse,
                       is_lse_base_on_e, seq_lens, query_start_loc)

    def dcp_a2a_lse_reduce_034(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, is_lse_base_on_e=True,
                               seq_lens=None, query_start_loc=None, out=None):
        result = combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse,
                         is_lse_base_on_e, seq_lens, query_start_loc)
        if out is None:
            return result
        out.copy_(result[0] if return_lse else result)
        return (out, result[1]) if return_lse else out

    def dcp_a2a_v_up_proj_lse_reduce(cp_attn_out, cp_attn_lse, w_uv, out, cp_group, is_lse_base_on_e=True,
                                     seq_lens=None, query_start_loc=None):
        """0.34: below 8 rows combine then project this rank's heads, else project then combine."""
        ns.calls.append(("dcp_a2a_v_up_proj_lse_reduce", _ubatch(ns)))
        rows, heads, _ = cp_attn_out.shape
        v = w_uv.shape[-1]
        if rows < 8:
            local = heads // cp_group.world_size
            r = cp_group.rank_in_group
            latent = dcp.dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=is_lse_base_on_e,
                                            seq_lens=seq_lens, query_start_loc=query_start_loc)
            torch.bmm(latent.transpose(0, 1), w_uv[r * local:(r + 1) * local],
                      out=out.view(rows, local, v).transpose(0, 1))
            return
        projected = cp_attn_out.new_empty((rows, heads, v))
        torch.bmm(cp_attn_out.transpose(0, 1), w_uv, out=projected.transpose(0, 1))
        dcp.dcp_a2a_lse_reduce(projected, cp_attn_lse, cp_group, is_lse_base_on_e=is_lse_base_on_e, seq_lens=seq_lens,
                               query_start_loc=query_start_loc, out=out.view(rows, -1, v))

    if is_034(ns):
        dcp.dcp_a2a_v_up_proj_lse_reduce = dcp_a2a_v_up_proj_lse_reduce

    def reserve_query_head_storage(query, padded_num_heads):
        flat = query.new_empty((query.shape[0] * padded_num_heads * query.shape[2],))
        out = flat[: query.numel()].view(query.shape)
        out.copy_(query)
        return out

    dcp.cp_lse_ag_out_rs = cp_lse_ag_out_rs
    dcp.dcp_a2a_lse_reduce = dcp_a2a_lse_reduce_034 if is_034(ns) else dcp_a2a_lse_reduce
    dcp.reserve_query_head_storage = reserve_query_head_storage


def _manager(ns, dcp, get_dcp_group):
    """MLADCPManager: the attributes the plugin reads, _init_combine and
    _init_query_gather as vLLM builds them."""

    class MLADCPManager:
        def __init__(self, vllm_config, device, num_heads, query_head_dim, output_head_dim, query_dtype,
                     output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp):
            pc = vllm_config.parallel_config
            self.group = get_dcp_group()
            self.device = torch.device(device)
            self.num_ubatches = max(pc.num_ubatches, 1)
            self.max_num_tokens = vllm_config.dcp_max_num_tokens
            self.use_a2a = pc.dcp_comm_backend == "a2a"
            self.padded_num_heads = padded_num_heads
            if is_034(ns):
                self.v_up_proj_combine = None
            self.combine = self._init_combine(num_heads, output_head_dim, output_dtype, is_lse_base_on_e, use_pcp)
            if is_034(ns):
                self.direct_query_gather_max_tokens = 0
            self.query_gather = None if use_pcp else self._init_query_gather(num_heads, query_head_dim,
                                                                              query_dtype)

        def _init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
            ns.calls.append(("_init_combine", _ubatch(ns)))
            if is_034(ns) and self.use_a2a and not use_pcp:
                self.v_up_proj_combine = functools.partial(dcp.dcp_a2a_v_up_proj_lse_reduce, cp_group=self.group,
                                                           is_lse_base_on_e=is_lse_base_on_e)
            fn = dcp.dcp_a2a_lse_reduce if self.use_a2a else dcp.cp_lse_ag_out_rs
            return functools.partial(fn, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e)

        def _init_query_gather(self, num_heads, head_dim, dtype):
            ns.calls.append(("_init_query_gather", _ubatch(ns)))
            return self._gather_query

        def _gather_query(self, query):
            ns.calls.append(("_gather_query", _ubatch(ns)))
            query = self.group.all_gather(query, dim=1)
            if self.padded_num_heads is not None:
                query = dcp.reserve_query_head_storage(query, self.padded_num_heads)
            return query

    dcp.MLADCPManager = MLADCPManager


def _layers(ns, mla, kimi, dcp):
    """The two layers that build an MLADCPManager, with vLLM's parameter
    lists: each keeps its name (``prefix``) and builds its manager with its
    ``num_heads`` and, here, the manager's other arguments (MLAAttention's
    ``**extra_impl_args``, Kimi-K3's ``config``; vLLM's read them from its
    configuration)."""

    def build(layer, name, num_heads, manager_kwargs):  # one call below the constructor
        layer.layer_name = name
        layer.dcp_manager = dcp.MLADCPManager(num_heads=num_heads, **manager_kwargs)

    class MLAAttention:
        def __init__(self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank,
                     kv_lora_rank, kv_b_proj, dcp_q_replicate=False, cache_config=None, quant_config=None, prefix="",
                     attn_backend=None, use_sparse=False, indexer=None, topk_indices_buffer=None,
                     index_group_builder=None, non_causal_multi_token_decode=False, sliding_window=None,
                     prefill_backend_cls=None, **extra_impl_args):
            build(self, prefix, num_heads, extra_impl_args)

    class MLAAttention034:
        def __init__(self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank,
                     kv_lora_rank, kv_b_proj, dcp_q_replicate=False, cache_config=None, quant_config=None, prefix="",
                     attn_backend=None, use_sparse=False, indexer=None, topk_indices_buffer=None,
                     index_group_builder=None, non_causal_multi_token_decode=False, shardq_eligible=False,
                     sliding_window=None, prefill_backend_cls=None, kv_sharing_target_layer_name=None,
                     **extra_impl_args):
            build(self, prefix, num_heads, extra_impl_args)

    class MultiHeadLatentAttention:
        def __init__(self, config, hidden_size, num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                     q_lora_rank, kv_lora_rank, use_output_gate=False, cache_config=None, quant_config=None,
                     prefix="", aux_stream=None, use_rope=False, non_causal_multi_token_decode=False,
                     run_gemm_rs_ar=False):
            build(self, prefix, num_heads, config)

    MLAAttention034.__name__ = MLAAttention034.__qualname__ = "MLAAttention"
    mla.MLAAttention = MLAAttention034 if is_034(ns) else MLAAttention
    kimi.MultiHeadLatentAttention = MultiHeadLatentAttention


def _indexer(ns, indexer, by_name):
    """_merge_dcp_topk_global (local positions in, global ids merged in
    place) and the decode step's call of it through the module global; on
    0.34 its three parameters, its key, and the direct top-K getter that the
    indexer's construction calls (``build_indexer``)."""

    def candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts):
        local = topk_indices.long()
        valid = local >= 0
        pos = local.clamp_min(0)
        start = 0 if row_starts is None else row_starts.long().unsqueeze(1)
        col = (pos + start).clamp_max(max(logits.shape[1] - 1, 0))
        score = logits[: local.shape[0]].gather(1, col).masked_fill(~valid, -math.inf)
        gid = (pos // cp_interleave) * (dcp_world_size * cp_interleave) + dcp_rank * cp_interleave \
            + pos % cp_interleave
        return score.contiguous(), torch.where(valid, gid, -1).to(torch.int32).contiguous()

    def merge(name, logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts,
              score_bits=32):
        ns.calls.append((name, _ubatch(ns)))
        score, gid = candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
        all_s = ns.coordinator.all_gather(score, dim=1)
        all_i = ns.coordinator.all_gather(gid, dim=1)
        topk_indices.copy_(vllm_select(all_s, all_i, topk_tokens, score_bits))

    def _merge_dcp_topk_global(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
                               row_starts=None):
        if dcp_world_size <= 1:
            return
        merge("_merge_dcp_topk_global", logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
              row_starts)

    def _merge_dcp_topk_global_034(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
                                   row_starts=None, logits_dtype=torch.float32, num_positions=None,
                                   direct_max_rows=0):
        if dcp_world_size <= 1:
            return
        score_bits = 16 if logits_dtype == torch.bfloat16 else 32
        name = "_merge_dcp_topk_global"
        if 0 < topk_indices.shape[0] <= direct_max_rows:
            workspace = indexer._get_direct_dcp_topk_workspace(topk_indices.device, direct_max_rows, topk_tokens)
            assert workspace is not None
            name = "direct_topk_merge"
        merge(name, logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts,
              score_bits)

    def _get_direct_dcp_topk_workspace(device, max_rows, topk_tokens):
        ns.calls.append(("_get_direct_dcp_topk_workspace", 0))
        return types.SimpleNamespace(max_rows=max_rows)

    def build_indexer(device, max_rows, topk_tokens):
        """SparseAttnIndexer.__init__'s DCP part (a2a, no DBO, CuTeDSL): its
        dcp_direct_topk_max_rows, through the module global."""
        return max_rows if indexer._get_direct_dcp_topk_workspace(device, max_rows, topk_tokens) is not None else 0

    def _resolve_layer_name(layer_name):
        return layer_name  # vLLM's unwraps a LayerName; names here are strings

    def sparse_attn_indexer_decode(logits, topk_indices_buffer, rows, topk_tokens, dcp_rank, dcp_world_size,
                                   cp_interleave, row_starts=None, k_cache_prefix="", **extra):
        """The decode step's call: the op resolves its layer's name first,
        then a view of the buffer, merged in place, through the module
        global (0.34: with its three parameters)."""
        indexer._resolve_layer_name(k_cache_prefix)
        topk_indices = topk_indices_buffer[:rows, :topk_tokens]
        indexer._merge_dcp_topk_global(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size,
                                       cp_interleave, row_starts=row_starts, **extra)
        return topk_indices_buffer

    merge_fn = _merge_dcp_topk_global_034 if is_034(ns) else _merge_dcp_topk_global
    indexer._merge_dcp_topk_global = merge_fn
    indexer.sparse_attn_indexer_decode = sparse_attn_indexer_decode
    indexer._resolve_layer_name = by_name._resolve_layer_name = _resolve_layer_name
    by_name._merge_dcp_topk_global = merge_fn
    if is_034(ns):
        indexer._get_direct_dcp_topk_workspace = _get_direct_dcp_topk_workspace
        indexer.build_indexer = build_indexer


def build_fake_vllm(version="0.33.0"):
    """Module objects standing in for vLLM (not yet in sys.modules), with
    ``calls`` (the stand-in's own functions that ran, with their micro-batch),
    ``ubatch`` (a thread-local micro-batch id) and ``coordinator`` (the DCP
    group ``get_dcp_group`` returns)."""
    mods = packages(VLLM_MODULES)
    ns = types.SimpleNamespace(mods=mods, calls=[], ubatch=threading.local(), coordinator=None, version=version)
    mods["vllm"].__version__ = version
    _logger(ns, mods["vllm.logger"])
    mods["vllm.v1.worker.ubatching"].dbo_current_ubatch_id = lambda: _ubatch(ns)
    _parallel_state(ns, mods[PARALLEL_STATE], mods["vllm.distributed"])
    _gpu_worker(ns, mods[GPU_WORKER])
    _combines(ns, mods[DCP])
    _manager(ns, mods[DCP], mods[PARALLEL_STATE].get_dcp_group)
    _indexer(ns, mods[INDEXER], mods[GLM_INDEXER])
    _layers(ns, mods[MLA_ATTENTION], mods[KIMI_K3_MLA], mods[DCP])
    return ns


def reset_plugin(plugin):
    """The plugin's process state as a fresh process has it."""
    from torch_sdcp.integrations import vllm_calls
    from torch_sdcp_plugins import vllm as entry

    plugin.uninstall()
    entry._logged.clear()
    vllm_calls.face.forget()
    vllm_calls.face.ubatch_id = lambda: 0
    vllm_calls.engine.originals.clear()
    vllm_calls.engine.dcp_group = None


class FakeVllm:
    """Context manager: the stand-in in sys.modules, the plugin's process
    state reset around it, sys.modules restored after."""

    def __init__(self, version="0.33.0"):
        self.ns = build_fake_vllm(version)
        self.modules = InModules(self.ns.mods)

    def __enter__(self):
        from torch_sdcp.integrations import vllm as plugin

        self.modules.__enter__()
        reset_plugin(plugin)
        return self.ns

    def __exit__(self, *exc):
        from torch_sdcp.integrations import vllm as plugin

        reset_plugin(plugin)
        self.modules.__exit__(*exc)


def config(num_ubatches=1, backend="ag_rs", index_topk=None, q_replicate=False, bound=BOUND, v_head_dim=None):
    """The part of a VllmConfig the manager and the plugin read."""
    hf = types.SimpleNamespace(index_topk=index_topk, v_head_dim=v_head_dim)
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(num_ubatches=num_ubatches, dcp_comm_backend=backend,
                                              dcp_q_replicate=q_replicate),
        model_config=types.SimpleNamespace(hf_text_config=hf), dcp_max_num_tokens=bound)


def Layer(ns, prefix, *, positional=False, kimi=False, **manager_kwargs):
    """An MLA attention layer as vLLM builds one (``MLAAttention``, or
    Kimi-K3's ``MultiHeadLatentAttention`` with ``kimi``), named ``prefix``
    (passed by keyword, or by position with ``positional``), with its own
    MLADCPManager (``.dcp_manager``) built from ``manager_kwargs``."""
    heads = manager_kwargs.pop("num_heads")
    if kimi:
        args = (manager_kwargs, 1, heads, 0, 0, 0, None, 0, False, None, None)
        cls, manager_kwargs = ns.mods[KIMI_K3_MLA].MultiHeadLatentAttention, {}
    else:
        args = (heads, 1.0, 0, 0, 0, None, 0, None, False, None, None)
        cls = ns.mods[MLA_ATTENTION].MLAAttention
    return cls(*args, prefix, **manager_kwargs) if positional else cls(*args, prefix=prefix, **manager_kwargs)
