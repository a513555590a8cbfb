"""torch_sdcp behind SGLang's MLA DCP decode seams: the SGLang plugin, over the
integration core (:mod:`torch_sdcp.integrations._face`).

Loaded by the ``sglang.srt.plugins`` entry point ``torch_sdcp``
(:mod:`torch_sdcp_plugins.sglang`) when ``SDCP_SGLANG=1``. :func:`install`
registers :data:`HOOKS` with SGLang's own hook registry (which also rewrites
the modules that imported a function by name): both Output/LSE combines
(``ag_rs``: ``cp_lse_ag_out_rs_mla``, head-major ``[H/N, B, D]``; ``a2a``:
``dcp_a2a_lse_reduce``, ``[B, H/N, D]``) on ``OutputLSEWorkspace``, the query
gather ``all_gather_q_for_mla_decode`` on ``QueryWorkspace.all_gather_heads``,
the workspaces before ``ModelRunner.alloc_memory_pool`` (so that SGLang's KV
sizing counts their bytes; sized by the CUDA-graph configuration's widest
decode batch) or, when that bound is not known yet, after
``BaseRunner._pre_initialize_fi_a2a_workspace`` (warm-up, before CUDA-graph
capture; sized by SGLang's widest decode batch),
:func:`check` before every ``ModelRunner.forward`` and, after the step's own
synchronisation, before ``Scheduler.process_batch_result`` emits a batch's
outputs, and a local release (no barrier, no wait on a peer) before
``abort_distributed_environment``.

A call this face does not cover (``fi_a2a``, a world of one, an fp8 output, a
geometry without a workspace, more rows than the bound, no peer memory) runs
SGLang's own function, logged once per reason. See docs/SGLANG.md. The
replacements are in :mod:`torch_sdcp.integrations.sglang_calls`, the hooks
around them in :mod:`torch_sdcp.integrations.sglang_step`, both re-exported
here; none imports SGLang at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch_sdcp.integrations._engine import accepted_version
from torch_sdcp.integrations.sglang_calls import (  # the replacements, re-exported
    REPLACED,
    all_gather_q_for_mla_decode,
    check,
    configure,
    cp_lse_ag_out_rs_mla,
    dcp_a2a_lse_reduce,
    engine,
    face,
    in_layer,
    prepare,
    teardown,
    workspaces,
)
from torch_sdcp.integrations.sglang_step import (
    RUNTIME,
    after_pre_initialize,
    before_alloc_memory_pool,
    before_forward,
    before_results,
    before_shutdown,
    seam_plan,
)
from torch_sdcp_settings import SGLANG

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_MAX_ROWS", "ENV_TIMEOUT_S", "HOOKS", "SGLANG_SIGNATURES", "SUPPORTED_SGLANG_VERSIONS",
    "all_gather_q_for_mla_decode", "check", "configure", "cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "install",
    "is_installed", "prepare", "seam_plan", "teardown", "workspaces",
]

ENV_MAX_ROWS = SGLANG.MAX_ROWS
ENV_TIMEOUT_S = SGLANG.TIMEOUT_S
DEFAULT_TIMEOUT_S = SGLANG.default_timeout_s

# Releases whose seams docs/SGLANG.md and test/test_sglang_conformance.py were checked against.
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

_COMM = "sglang.srt.layers.dcp.comm"
_RUNNER = "sglang.srt.model_executor.runner.base_runner"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
_SCHEDULER = "sglang.srt.managers.scheduler"
_REGISTRY = "sglang.srt.plugins.hook_registry"
_FORWARD_MLA = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla"

# Every SGLang function this face replaces, hooks or calls, with the parameter
# list it was written against (annotations left out); the conformance test
# compares them with SGLang's sources.
SGLANG_SIGNATURES = {
    (_COMM, "cp_lse_ag_out_rs_mla"): "(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=False)",
    (_COMM, "dcp_a2a_lse_reduce"): "(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=True, "
                                   "cuda_graph_buffers=None, comm_backend='a2a')",
    (_COMM, "all_gather_q_for_mla_decode"): "(q_nope_out, q_pe)",
    (_RUNNER, "BaseRunner._pre_initialize_fi_a2a_workspace"): "(self)",
    (_RUNNER, "BaseRunner._widest_decode_rows"): "(self)",
    (_MODEL_RUNNER, "ModelRunner.forward"): "(self, forward_batch, skip_attn_backend_init=None, "
                                            "pp_proxy_tensors=None, reinit_attn_backend=False, split_forward_count=1)",
    (_MODEL_RUNNER, "ModelRunner.decode_num_tokens_per_req"): "(self, *, num_draft_tokens=None)",
    (_MODEL_RUNNER, "ModelRunner.alloc_memory_pool"): "(self, memory_pool_config=None, *, "
                                                      "draft_parallel_layout=None)",
    (_PARALLEL_STATE, "abort_distributed_environment"): "()",
    (_SCHEDULER, "Scheduler.process_batch_result"): "(self, batch, result)",
    (RUNTIME, "get_parallel"): "()",
    (_FORWARD_MLA, "DeepseekMLAForwardMixin.forward_absorb_prepare"): "(self, positions, hidden_states, "
        "forward_batch, zero_allocator, llama_4_scaling=None, prev_topk_indices=None)",
    (_FORWARD_MLA, "DeepseekMLAForwardMixin.forward_absorb_core"): "(self, q_pe, k_pe, q_nope_out, k_nope, "
        "forward_batch, zero_allocator, positions, topk_indices, llama_4_scaling, fusion_plan=None, "
        "attention_output_gate=None)",
}


# (target, SGLang HookType name, hook); the three replacements are looked up at install().
HOOKS: tuple[tuple[str, str, Callable], ...] = (
    (f"{_COMM}.cp_lse_ag_out_rs_mla", "REPLACE", cp_lse_ag_out_rs_mla),
    (f"{_COMM}.dcp_a2a_lse_reduce", "REPLACE", dcp_a2a_lse_reduce),
    (f"{_COMM}.all_gather_q_for_mla_decode", "REPLACE", all_gather_q_for_mla_decode),
    (f"{_MODEL_RUNNER}.ModelRunner.alloc_memory_pool", "BEFORE", before_alloc_memory_pool),
    (f"{_RUNNER}.BaseRunner._pre_initialize_fi_a2a_workspace", "AFTER", after_pre_initialize),
    (f"{_MODEL_RUNNER}.ModelRunner.forward", "BEFORE", before_forward),
    (f"{_SCHEDULER}.Scheduler.process_batch_result", "BEFORE", before_results),
    (f"{_PARALLEL_STATE}.abort_distributed_environment", "BEFORE", before_shutdown),
    # The methods that call the seams, around which the layer's index is their call tag.
    (f"{_FORWARD_MLA}.DeepseekMLAForwardMixin.forward_absorb_prepare", "AROUND", in_layer),
    (f"{_FORWARD_MLA}.DeepseekMLAForwardMixin.forward_absorb_core", "AROUND", in_layer),
)


def is_installed() -> bool:
    return engine.installed


def _sglang_version() -> str:
    return str(getattr(importlib.import_module("sglang.version"), "__version__", "unknown"))


def install() -> bool:
    """Register this face's hooks with SGLang's hook registry (idempotent;
    SGLang applies them after its plugins ran). On a version not in
    :data:`SUPPORTED_SGLANG_VERSIONS`, or when a seam is missing, logs an
    error and registers nothing."""
    with engine.lock:
        if engine.installed:
            return True
        version = _sglang_version()
        if not accepted_version(version, SUPPORTED_SGLANG_VERSIONS):
            face.log_once("error", ("version", version), "torch_sdcp: SGLang %s is not a version this plugin knows "
                      "(supported: %s and their .postN releases); nothing is replaced and SGLang runs its own DCP "
                      "paths. Check the seams with test/test_sglang_conformance.py before adding a version.", version,
                      ", ".join(SUPPORTED_SGLANG_VERSIONS))
            return False
        try:
            comm = importlib.import_module(_COMM)
            registry = importlib.import_module(_REGISTRY)
            originals = {name: getattr(comm, name) for name in REPLACED}
            get_parallel = importlib.import_module(RUNTIME).get_parallel
        except (ImportError, AttributeError) as e:
            face.log_once("error", ("seams", version), "torch_sdcp: SGLang %s lacks a DCP seam this plugin replaces "
                      "(%s: %s); nothing is replaced", version, type(e).__name__, e)
            return False
        configure(dcp_group=lambda: get_parallel().dcp_group, originals=originals)
        for target, kind, hook in HOOKS:
            registry.HookRegistry.register(target, hook, getattr(registry.HookType, kind))
        engine.installed = True
    face.log_once("info", ("install", version), "torch_sdcp: registered behind SGLang %s's MLA DCP combine (ag_rs, "
              "a2a) and query gather (SDCP_SGLANG=1)", version)
    return True

