"""torch_sdcp as a vLLM plugin: peer-memory DCP boundaries behind vLLM's own
call sites.

vLLM loads the entry point :func:`torch_sdcp_plugins.vllm.register` in every
process; it imports this module only when ``SDCP_VLLM=1`` and the settings
are valid, then calls :func:`install`, which, on a vLLM release it knows
(:func:`supported_version`: 0.33.x and 0.34.x, one table of vLLM's
signatures per series in :mod:`torch_sdcp.integrations.vllm_versions`), patches:

- ``MLADCPManager._init_combine`` (``vllm.v1.attention.ops.dcp``): the
  Output/LSE combine of both ``--dcp-comm-backend`` values (``ag_rs``:
  :func:`cp_lse_ag_out_rs`, ``a2a``: :func:`dcp_a2a_lse_reduce`, vLLM's
  signatures and masking, 0.34's ``out=``) on ``OutputLSEWorkspace``, and on
  0.34 with ``a2a`` the manager's ``v_up_proj_combine`` (the combine after
  the V up-projection, :func:`dcp_a2a_v_up_proj_lse_reduce`);
- ``MLADCPManager._init_query_gather``: the query gather on heads on
  ``QueryWorkspace`` (:func:`gather_query`), prepared for every manager: the
  attention class vLLM picks decides whether it gathers (GLM-5 on CUDA does,
  whatever ``dcp_q_replicate`` says); on 0.34 its bound is the manager's
  ``direct_query_gather_max_tokens``, so ``prepare_mqa_query`` gathers early;
- ``_merge_dcp_topk_global`` (``vllm.model_executor.layers.sparse_attn_indexer``
  and every module that imported it by name): the top-K merge on
  ``TopKWorkspace`` (:func:`merge_dcp_topk_global`; 0.34's parameters and
  selection key included), and on 0.34 ``_get_direct_dcp_topk_workspace``,
  so that vLLM's direct top-K is not created while the plugin's runs;
- ``MLADCPManager.__init__``, wrapped to read the model's ``index_topk``,
  prepare the top-K workspaces and log each seam on or off, with why, once
  per DCP group;
- the layers that build a manager, ``MLAAttention.__init__``
  (``vllm.model_executor.layers.attention.mla_attention``) and Kimi-K3's
  ``MultiHeadLatentAttention.__init__`` (``vllm.models.kimi_k3.nvidia.mla``,
  patched when imported, not imported for it), wrapped to pass the layer's
  ``prefix`` to its manager (:mod:`.vllm_layers`): the combine and query
  gather carry its index as their call tag (:func:`layer_index`), so a layer
  skipped or reordered on one rank is named on every rank (a manager built
  outside them calls untagged); the top-K merge, called without its layer,
  the layer its indexer op resolved (``_resolve_layer_name``, wrapped);
- ``Worker.sample_tokens`` (``vllm.v1.worker.gpu_worker``, patched when the
  first manager is built, in the worker): the per-step health check over
  every live workspace, after the step's synchronisation (for an async
  output: after its ``get_output`` waited), so that a recorded failure
  raises through vLLM's error path instead of returning tokens;
- ``destroy_model_parallel`` (``vllm.distributed.parallel_state`` and its
  re-exports): closes every workspace before vLLM destroys its groups.

``SDCP_VLLM_SEAMS`` (``combine,query,topk``, default all) selects the seams;
an explicit ``VLLM_USE_DIRECT_DCP_A2A`` / ``VLLM_USE_DIRECT_DCP_Q_GATHER``
keeps that seam vLLM's. Workspaces are created at model load (before
profiling and capture) over the DCP group's gloo group, one per micro-batch,
sized by vLLM's DCP row bound (``MLADCPManager.max_num_tokens``, capped by
``SDCP_VLLM_MAX_ROWS``), waiting at most ``SDCP_VLLM_TIMEOUT_S``. More rows
than the bound, or no peer memory, run vLLM's own function, logged once.
The replacements are in :mod:`torch_sdcp.integrations.vllm_calls`,
re-exported here, what the settings and vLLM's configuration decide in
:mod:`torch_sdcp.integrations.vllm_config`; none imports vLLM at import time
(docs/VLLM.md).
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

from torch_sdcp.integrations import vllm_topk
from torch_sdcp.integrations._engine import SeamPlan
from torch_sdcp.integrations.vllm_calls import (  # the replacements, re-exported
    DEFAULT_TIMEOUT_S,
    ENV_TIMEOUT_S,
    V_UP_PROJ_FIRST_MIN_TOKENS,
    configure,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    dcp_a2a_v_up_proj_lse_reduce,
    engine,
    face,
    gather_heads,
    gather_query,
    mask_empty_shards,
    teardown,
    try_prepare_output_lse,
    try_prepare_query_gather,
    try_prepare_topk,
    workspaces,
)
from torch_sdcp.integrations.vllm_config import (
    SUPPORTED_VLLM_SERIES,
    SUPPORTED_VLLM_VERSIONS,
    configured_off,
    enable_hint,
    layer_index,
    row_bound,
    series_of,
    supported_version,
    topk_geometry,
    v_head_dim,
)
from torch_sdcp.integrations.vllm_layers import building_layer_tag, layer_constructor
from torch_sdcp.integrations.vllm_patches import AfterImport, by_name_copies, patch, resolve, restore
from torch_sdcp.integrations.vllm_step import check_step, destroy_model_parallel, worker_sample_tokens
from torch_sdcp.integrations.vllm_topk import direct_topk_workspace, merge_dcp_topk_global
from torch_sdcp.integrations.vllm_versions import (
    DCP,
    GPU_WORKER,
    INDEXER,
    KIMI_K3_MLA,
    MANAGER_ATTRIBUTES_BY_SERIES,
    MLA_ATTENTION,
    PARALLEL_STATE,
    UBATCHING,
    VLLM_SIGNATURES_BY_SERIES,
)
from torch_sdcp_settings import VLLM

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_ENABLE", "ENV_MAX_ROWS", "ENV_SEAMS", "ENV_TIMEOUT_S", "MANAGER_ATTRIBUTES_BY_SERIES",
    "PATCHED", "SUPPORTED_VLLM_SERIES", "SUPPORTED_VLLM_VERSIONS", "VLLM_SIGNATURES", "VLLM_SIGNATURES_BY_SERIES",
    "check_step", "configure", "configured_off", "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce",
    "dcp_a2a_v_up_proj_lse_reduce", "enable_hint", "gather_heads", "gather_query", "install", "is_installed",
    "layer_index", "mask_empty_shards", "merge_dcp_topk_global", "row_bound", "series_of", "supported_version",
    "teardown", "try_prepare_output_lse", "try_prepare_query_gather", "try_prepare_topk", "uninstall", "workspaces",
]

ENV_ENABLE = VLLM.ENABLE
ENV_MAX_ROWS = VLLM.MAX_ROWS
ENV_SEAMS = VLLM.SEAMS

_DCP, _INDEXER, _UBATCHING, _PARALLEL_STATE, _GPU_WORKER = DCP, INDEXER, UBATCHING, PARALLEL_STATE, GPU_WORKER

# What install() replaces: (module, attribute path). The worker's step is
# patched when the first MLADCPManager is built (in a worker process only);
# Kimi-K3's layer when its module is imported (now, if it already is);
# vLLM 0.34's direct top-K getter only where its table has it.
PATCHED = (
    (_DCP, "MLADCPManager.__init__"),
    (_DCP, "MLADCPManager._init_combine"),
    (_DCP, "MLADCPManager._init_query_gather"),
    (_INDEXER, "_merge_dcp_topk_global"),
    (_PARALLEL_STATE, "destroy_model_parallel"),
    (_GPU_WORKER, "Worker.sample_tokens"),
    (_INDEXER, "_get_direct_dcp_topk_workspace"),
    (MLA_ATTENTION, "MLAAttention.__init__"),
    (KIMI_K3_MLA, "MultiHeadLatentAttention.__init__"),
)
_AT_INSTALL = tuple(p for p in PATCHED if p[0] not in (_GPU_WORKER, KIMI_K3_MLA))
_LAYERS = ("MLAAttention.__init__", "MultiHeadLatentAttention.__init__")  # wrapped, not replaced
_TOPK_PATCHES = ("_merge_dcp_topk_global", "_get_direct_dcp_topk_workspace")
# Functions other vLLM modules import by name: their copies are patched too.
_BY_NAME = ("_merge_dcp_topk_global", "destroy_model_parallel")

# The functions of each release series (vllm_versions.VLLM_SIGNATURES_BY_SERIES);
# VLLM_SIGNATURES and MANAGER_ATTRIBUTES keep the names of 0.33's.
VLLM_SIGNATURES = VLLM_SIGNATURES_BY_SERIES["0.33"]
MANAGER_ATTRIBUTES = MANAGER_ATTRIBUTES_BY_SERIES["0.33"]["_init_combine"]


# ---------------------------------------------------------------------------
# Process state
# ---------------------------------------------------------------------------


class _State:
    """What install() did: the patches to undo, and the vllm_config and seam
    decisions of the MLADCPManager being built (per thread)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        # (owner object, attribute name, original value, replacement) in patch order.
        self.patches: list[tuple[Any, str, Any, Any]] = []
        self.config = threading.local()
        self.step_check: str | None = None  # None: not patched yet; "" patched; else why it could not be
        self.series = "0.33"  # the installed vLLM's table (vllm_versions)
        self.at_import: AfterImport | None = None  # patches Kimi-K3's layer when its module is imported


_state = _State()
_log_once = face.log_once  # once per reason, in vLLM's logger when vLLM is loaded
_wrap_layer = functools.partial(layer_constructor, building=_state.config, note=vllm_topk.note_layer_name)


# ---------------------------------------------------------------------------
# The patches
# ---------------------------------------------------------------------------


def _building() -> dict:
    """The manager being built on this thread: {"config": ..., "seams": {seam: (on, why)}}."""
    stack = getattr(_state.config, "stack", None)
    return stack[-1] if stack else {"config": None, "seams": {}}


def _decide(seam: str, on: bool, why: str) -> None:
    _building()["seams"][seam] = (on, why)


def _manager_init(self, *args, **kwargs):
    """Wraps MLADCPManager.__init__: lets the patched _init_* see the
    vllm_config and the building layer's call tag (None: untagged), prepares
    the top-K workspaces (shared by every layer); logs the seams per group."""
    original = engine.originals["MLADCPManager.__init__"]
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    stack = getattr(_state.config, "stack", None)
    if stack is None:
        stack = _state.config.stack = []
    building = {"config": vllm_config, "seams": {}, "tag": building_layer_tag(_state.config)}
    stack.append(building)
    try:
        _install_step_check()
        original(self, *args, **kwargs)
        _prepare_topk(self, vllm_config)
    finally:
        stack.pop()
    seams = building["seams"]
    seams.setdefault("query", (False, "no query gather (PCP)"))
    name = str(getattr(self.group, "unique_name", id(self.group)))
    plan = SeamPlan(VLLM, name, self.group.world_size)
    for seam, (on, why) in seams.items():
        plan.decide(seam, on, why, *enable_hint(seam, why))
    plan.emit(lambda level, text: _log_once(level, ("seams", name), "%s", text))


def _prepare_topk(self, vllm_config: Any) -> None:
    k = topk_geometry(vllm_config)
    off = _state.step_check or configured_off("topk", world=self.group.world_size, topk=k)
    if off is not None or k is None:
        _decide("topk", False, off or "")
        return
    bound = row_bound(self.max_num_tokens)
    if try_prepare_topk(self.group, max_rows=bound, k=k, device=self.device, num_ubatches=self.num_ubatches):
        _decide("topk", True, f"peer memory, k={k}, {bound} rows, {self.num_ubatches} micro-batch(es)")
    else:
        _decide("topk", False, "peer memory unavailable")


def _manager_init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
    """Replaces MLADCPManager._init_combine: the same partial vLLM builds,
    over this module's functions. PCP, a single rank, an unsupported dtype,
    a setting or no peer memory keep vLLM's own choice."""
    original = engine.originals["MLADCPManager._init_combine"]
    world = self.group.world_size
    off = _state.step_check or configured_off("combine", world=world, use_a2a=self.use_a2a, use_pcp=use_pcp,
                                              dtype=dtype)
    bound = row_bound(self.max_num_tokens)
    if off is None and not try_prepare_output_lse(self.group, max_rows=bound, total_heads=num_heads * world,
                                                  head_dim=head_dim, dtype=dtype, device=self.device,
                                                  num_ubatches=self.num_ubatches):
        off = "peer memory unavailable"
    if off is not None:
        _decide("combine", False, off)
        return original(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)
    backend = "a2a" if self.use_a2a else "ag_rs"
    _decide("combine", True, f"peer memory in place of {backend}, {num_heads * world} heads x {head_dim}, "
            f"{bound} rows, {self.num_ubatches} micro-batch(es)")
    if self.use_a2a and "dcp_a2a_v_up_proj_lse_reduce" in engine.originals:
        self.v_up_proj_combine = _v_up_proj_combine(self, num_heads, dtype, is_lse_base_on_e, bound)
    fn = dcp_a2a_lse_reduce if self.use_a2a else cp_lse_ag_out_rs
    return functools.partial(fn, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e, tag=_building().get("tag"))


def _v_up_proj_combine(self, num_heads, dtype, is_lse_base_on_e, bound):
    """vLLM 0.34, ``a2a`` without PCP (vLLM sets ``v_up_proj_combine`` then,
    unless its direct A2A workspace runs, which the plugin's combine replaces):
    the combine after the V up-projection on an Output/LSE workspace of
    head_dim ``v_head_dim``; without that dimension or peer memory, vLLM's own
    function (NCCL), as vLLM would set it."""
    v = v_head_dim(_building()["config"])
    world = self.group.world_size
    why = None if v is not None else "the model has no v_head_dim"
    if why is None and not try_prepare_output_lse(self.group, max_rows=bound, total_heads=num_heads * world,
                                                  head_dim=v, dtype=dtype, device=self.device,
                                                  num_ubatches=self.num_ubatches):
        why = "peer memory unavailable"
    if why is not None:
        _log_once("warning", ("v-up", why), "torch_sdcp: the combine after the V up-projection "
                  "(MLADCPManager.v_up_proj_combine) stays vLLM's: %s", why)
        return functools.partial(engine.originals["dcp_a2a_v_up_proj_lse_reduce"], cp_group=self.group,
                                 is_lse_base_on_e=is_lse_base_on_e)
    seams = _building()["seams"]
    on, text = seams["combine"]
    seams["combine"] = (on, f"{text}; from {V_UP_PROJ_FIRST_MIN_TOKENS} rows on after the V up-projection, "
                        f"{num_heads * world} heads x {v}")
    return functools.partial(dcp_a2a_v_up_proj_lse_reduce, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e,
                             tag=_building().get("tag"))


def _manager_init_query_gather(self, num_heads, head_dim, dtype):
    """Replaces MLADCPManager._init_query_gather: the gather on heads through
    peer memory, with the manager's own _gather_query as the fallback.
    Prepared for every manager: whether the model gathers is the attention
    class's choice (GLM-5's DeepseekV32Attention always does; deepseek_v2
    models follow VLLM_DCP_Q_REPLICATE over the config), not the config's."""
    original = engine.originals["MLADCPManager._init_query_gather"]
    off = _state.step_check or configured_off("query", world=self.group.world_size)
    bound = row_bound(self.max_num_tokens)
    if off is None and not try_prepare_query_gather(self.group, max_rows=bound, local_heads=num_heads,
                                                    width=head_dim, dtype=dtype, device=self.device,
                                                    num_ubatches=self.num_ubatches):
        off = "peer memory unavailable"
    if off is not None:
        _decide("query", False, off)
        return original(self, num_heads, head_dim, dtype)
    early = ""
    if hasattr(self, "direct_query_gather_max_tokens"):  # vLLM 0.34: prepare_mqa_query gathers up to it, early
        self.direct_query_gather_max_tokens = bound
        early = f", issued early by prepare_mqa_query up to {bound} rows"
    _decide("query", True, f"peer memory, {self.group.world_size} x {num_heads} heads x {head_dim} of {dtype}, "
            f"{bound} rows, {self.num_ubatches} micro-batch(es); used where the attention class gathers{early}")
    return functools.partial(gather_query, cp_group=self.group, padded_num_heads=self.padded_num_heads,
                             fallback=self._gather_query, tag=_building().get("tag"))


# ---------------------------------------------------------------------------
# The step's health check and teardown
# ---------------------------------------------------------------------------


def _install_step_check() -> None:
    """Patch the worker's step (once, in the process that builds managers).
    If it cannot be patched, the seams stay vLLM's: without the check a
    failure inside a replayed graph could return wrong tokens."""
    with _state.lock:
        if _state.step_check is not None or not _state.installed:
            return
        try:
            patch(importlib.import_module(_GPU_WORKER), "Worker.sample_tokens", lambda _: worker_sample_tokens,
                  _state.patches, engine.originals)
        except Exception as e:
            _state.step_check = f"no step health check: {type(e).__name__}: {e}"
            _log_once("error", "step-check", "torch_sdcp: cannot patch %s.Worker.sample_tokens (%s); every seam "
                      "stays vLLM's", _GPU_WORKER, _state.step_check)
            return
        _state.step_check = ""


def _wrap_kimi_layer(module: Any) -> None:
    """Wraps Kimi-K3's layer constructor, once its module is imported; never
    raises into vLLM's import: unwrapped, its managers call untagged."""
    with _state.lock:
        try:
            if _state.installed:
                patch(module, _LAYERS[1], _wrap_layer, _state.patches)
        except Exception as e:
            _log_once("warning", ("layer", KIMI_K3_MLA), "torch_sdcp: cannot wrap %s.%s (%s: %s); the DCP calls "
                      "of its layers carry no layer tag", KIMI_K3_MLA, _LAYERS[1], type(e).__name__, e)


# ---------------------------------------------------------------------------
# Install
# ---------------------------------------------------------------------------


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_installed() -> bool:
    return _state.installed


def _direct_topk_workspace(device, max_rows, topk_tokens):
    """Replaces vLLM 0.34's ``_get_direct_dcp_topk_workspace``
    (:func:`torch_sdcp.integrations.vllm_topk.direct_topk_workspace`), after
    the step's health check is in place (without it the seam stays vLLM's)."""
    _install_step_check()
    return direct_topk_workspace(device, max_rows, topk_tokens, off=_state.step_check or None)


_REPLACEMENTS = {
    "MLADCPManager.__init__": _manager_init,
    "MLADCPManager._init_combine": _manager_init_combine,
    "MLADCPManager._init_query_gather": _manager_init_query_gather,
    "_merge_dcp_topk_global": merge_dcp_topk_global,
    "destroy_model_parallel": destroy_model_parallel,
    "_get_direct_dcp_topk_workspace": _direct_topk_workspace,
}


def install() -> bool:
    """Patch vLLM (idempotent). Returns True when the patches are in place.
    On a vLLM version :func:`supported_version` refuses, or when a target is
    missing, logs an error naming the version and patches nothing."""
    with _state.lock:
        if _state.installed:
            return True
        version = _vllm_version()
        series = series_of(version)
        if series is None:
            _log_once("error", ("version", version), "torch_sdcp: vLLM %s is not a version this plugin knows "
                      "(supported: %s and their patch releases); nothing is patched and vLLM runs its own DCP "
                      "paths. Check the call sites with test/test_vllm_conformance.py before adding a version.",
                      version, ", ".join(SUPPORTED_VLLM_VERSIONS))
            return False
        table = VLLM_SIGNATURES_BY_SERIES[series]
        try:
            modules = {name: importlib.import_module(name) for name in (_DCP, _INDEXER, _UBATCHING,
                                                                          _PARALLEL_STATE, MLA_ATTENTION)}
            wanted = [(name, path) for name, path in _AT_INSTALL if (name, path) in table
                      and (path not in _TOPK_PATCHES or "topk" in VLLM.seams())]
            targets = {path: resolve(modules[name], path) for name, path in wanted}
            patches = [(owner, name, value, _wrap_layer(value) if path in _LAYERS else _REPLACEMENTS[path])
                       for path, (owner, name, value) in targets.items()]
            originals = {name: getattr(modules[_DCP], name) for name in
                         ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "dcp_a2a_v_up_proj_lse_reduce")
                         if (_DCP, name) in table}
            ubatch_id = modules[_UBATCHING].dbo_current_ubatch_id
            dcp_group = modules[_PARALLEL_STATE].get_dcp_group
        except (ImportError, AttributeError, KeyError, ValueError) as e:
            _log_once("error", ("targets", version), "torch_sdcp: vLLM %s lacks a DCP call site this plugin "
                      "patches (%s: %s); nothing is patched", version, type(e).__name__, e)
            return False
        originals.update({path: value for path, (_, _, value) in targets.items()})
        patches += by_name_copies(patches, originals, _REPLACEMENTS, _BY_NAME)  # they hold the original
        patches += vllm_topk.layer_name_patches(patches)  # the indexer ops' layer: their merges' call tag
        for owner, name, _, new in patches:
            setattr(owner, name, new)
        _state.patches = patches
        _state.step_check = None
        _state.series = series
        configure(ubatch_id=ubatch_id, dcp_group=dcp_group, originals=originals)
        _state.installed = True
        kimi = (KIMI_K3_MLA, _LAYERS[1]) in table  # its module is not imported here: that imports the whole model
        _state.at_import = AfterImport.now_or_later(KIMI_K3_MLA, _wrap_kimi_layer) if kimi else None
    _log_once("info", ("install", version), "torch_sdcp: installed behind vLLM %s's MLA DCP combine, query gather "
              "and sparse-indexer top-K merge (%s=1, seams: %s; the %s table)", version, ENV_ENABLE,
              ",".join(VLLM.seams()), series)
    return True


def uninstall() -> None:
    """Restore every original (idempotent). Managers built while installed
    keep their combine and query gather; prepared workspaces stay until
    :func:`teardown`."""
    with _state.lock:
        if not _state.installed:
            return
        if _state.at_import is not None:
            _state.at_import.remove()
        restore(_state.patches, lambda owner, name: _log_once(
            "warning", ("uninstall", id(owner), name), "torch_sdcp: %s.%s was replaced again after install(); "
            "left as it is", getattr(owner, "__name__", owner), name))
        _state.patches = []
        _state.installed = False
        _state.step_check = None
