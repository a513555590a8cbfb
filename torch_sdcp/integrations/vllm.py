"""torch_sdcp as a vLLM plugin: peer-memory DCP boundaries behind vLLM's own
call sites.

Registered as the ``vllm.general_plugins`` entry point ``torch_sdcp`` (vLLM
calls :func:`register` in every process before it builds a model). Nothing
happens unless ``SDCP_VLLM=1``; then, on a vLLM version this module knows
(:data:`SUPPORTED_VLLM_VERSIONS`), it patches:

- ``vllm.v1.attention.ops.dcp.MLADCPManager._init_combine``: the Output/LSE
  combine of both ``--dcp-comm-backend`` values (``ag_rs``:
  :func:`cp_lse_ag_out_rs`, ``a2a``: :func:`dcp_a2a_lse_reduce`, both with
  vLLM's exact signatures and masking) runs on ``OutputLSEWorkspace``;
- ``vllm.v1.attention.ops.dcp.MLADCPManager._init_query_gather``: the query
  gather on heads runs on ``QueryWorkspace.all_gather_heads`` (data-as-flag,
  straight into the final layout; ``ExchangeWorkspace`` plus a layout copy for
  a dtype without an all-ones NaN) (:func:`gather_query`);
- ``vllm.model_executor.layers.sparse_attn_indexer._merge_dcp_topk_global``
  (and every module that imported it by name): the sparse indexer's top-K
  merge runs on ``TopKWorkspace`` (:func:`merge_dcp_topk_global`);
- ``vllm.v1.attention.ops.dcp.MLADCPManager.__init__`` is wrapped only to read
  the model's ``index_topk`` and prepare the top-K workspaces.

Workspaces are created when vLLM builds ``MLADCPManager`` (model load, before
profiling and CUDA-graph capture), bootstrapped over the DCP group's CPU
(gloo) group, one set per micro-batch (dual-batch overlap), sized by vLLM's
own DCP row bound (``MLADCPManager.max_num_tokens``, speculative tokens
included; 512 with default settings), with a start-up-safe wait bound
(``SDCP_VLLM_TIMEOUT_S``, default 600 s). A call with more rows than the
bound, or a group without usable peer memory, runs vLLM's own original
function, logged once per reason. :func:`uninstall` restores every original.

This module is the patching; the replacements themselves (vLLM's call shapes
over the integration core) are in :mod:`torch_sdcp.integrations.vllm_calls`,
re-exported here. Neither imports vLLM at import time; see docs/VLLM.md.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

from torch_sdcp.integrations._core import OUTPUT_DTYPES
from torch_sdcp.integrations.vllm_calls import (  # the replacements, re-exported
    DEFAULT_TIMEOUT_S,
    ENV_TIMEOUT_S,
    _face,
    _hooks,
    configure,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    gather_heads,
    gather_query,
    mask_empty_shards,
    merge_dcp_topk_global,
    teardown,
    try_prepare_output_lse,
    try_prepare_query_gather,
    try_prepare_topk,
    workspaces,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_ENABLE",
    "ENV_MAX_ROWS",
    "ENV_TIMEOUT_S",
    "PATCHED",
    "SUPPORTED_VLLM_VERSIONS",
    "VLLM_SIGNATURES",
    "configure",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "enabled",
    "gather_heads",
    "gather_query",
    "install",
    "is_installed",
    "mask_empty_shards",
    "merge_dcp_topk_global",
    "register",
    "teardown",
    "try_prepare_output_lse",
    "try_prepare_query_gather",
    "try_prepare_topk",
    "uninstall",
    "workspaces",
]

ENV_ENABLE = "SDCP_VLLM"
ENV_MAX_ROWS = "SDCP_VLLM_MAX_ROWS"

# Releases whose call sites docs/VLLM.md and test/test_vllm_conformance.py were
# checked against. Any other version is refused: a logged error, no patching.
SUPPORTED_VLLM_VERSIONS = ("0.33.0",)

_DCP = "vllm.v1.attention.ops.dcp"
_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
_UBATCHING = "vllm.v1.worker.ubatching"
_PARALLEL_STATE = "vllm.distributed.parallel_state"

# What install() replaces: (module, attribute path).
PATCHED = (
    (_DCP, "MLADCPManager.__init__"),
    (_DCP, "MLADCPManager._init_combine"),
    (_DCP, "MLADCPManager._init_query_gather"),
    (_INDEXER, "_merge_dcp_topk_global"),
)

# Every vLLM function this module replaces, wraps, mirrors or calls, with the
# parameter list it was written against (annotations left out). The
# conformance test reads the installed vLLM's sources and compares.
VLLM_SIGNATURES = {
    (_DCP, "cp_lse_ag_out_rs"): "(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, "
                                "is_lse_base_on_e=True, seq_lens=None, query_start_loc=None)",
    (_DCP, "dcp_a2a_lse_reduce"): "(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False, "
                                  "is_lse_base_on_e=True, seq_lens=None, query_start_loc=None)",
    (_DCP, "MLADCPManager.__init__"): "(self, vllm_config, device, num_heads, query_head_dim, output_head_dim, "
                                      "query_dtype, output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp)",
    (_DCP, "MLADCPManager._init_combine"): "(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)",
    (_DCP, "MLADCPManager._init_query_gather"): "(self, num_heads, head_dim, dtype)",
    (_DCP, "MLADCPManager._gather_query"): "(self, query)",
    (_DCP, "reserve_query_head_storage"): "(query, padded_num_heads)",
    (_INDEXER, "_merge_dcp_topk_global"): "(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, "
                                          "cp_interleave, row_starts=None)",
    (_UBATCHING, "dbo_current_ubatch_id"): "()",
    (_PARALLEL_STATE, "get_dcp_group"): "()",
}

# Attributes of MLADCPManager the patched methods read (set in its __init__
# before _init_combine runs; the conformance test checks that too).
MANAGER_ATTRIBUTES = ("group", "device", "num_ubatches", "max_num_tokens", "use_a2a", "padded_num_heads")


# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def enabled() -> bool:
    """Whether ``SDCP_VLLM`` switches the plugin on (off when unset). An
    unrecognised value is logged and counts as off."""
    value = os.environ.get(ENV_ENABLE, "").strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        _log_once("error", "bad-setting", "torch_sdcp: %s=%r is not one of %s (on) or %s (off); the vLLM plugin "
                  "stays off", ENV_ENABLE, os.environ.get(ENV_ENABLE), "/".join(_TRUE[:2]), "/".join(_FALSE[1:3]))
    return False


def _row_bound(engine_bound: int) -> int:
    """The rows bound of the workspaces: vLLM's DCP bound, capped by
    ``SDCP_VLLM_MAX_ROWS`` when set."""
    cap = os.environ.get(ENV_MAX_ROWS)
    bound = int(engine_bound)
    if cap is not None and cap.strip():
        try:
            cap_rows = int(cap)
        except ValueError:
            raise ValueError(f"torch_sdcp: environment variable {ENV_MAX_ROWS}: expected a positive int, "
                             f"got {cap!r}") from None
        if cap_rows < 1:
            raise ValueError(f"torch_sdcp: environment variable {ENV_MAX_ROWS}: expected a positive int, "
                             f"got {cap!r}")
        bound = min(bound, cap_rows)
    if bound < 1:
        raise ValueError(f"torch_sdcp: the DCP rows bound must be positive, got {bound}")
    return bound


# ---------------------------------------------------------------------------
# Process state
# ---------------------------------------------------------------------------


class _State:
    """What install() did: the patches to undo, and the vllm_config of the
    MLADCPManager being built (per thread)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        # (owner object, attribute name, original value, replacement) in patch order.
        self.patches: list[tuple[Any, str, Any, Any]] = []
        self.config = threading.local()


_state = _State()
_log_once = _face.log_once  # once per reason, in vLLM's logger when vLLM is loaded


# ---------------------------------------------------------------------------
# The patches
# ---------------------------------------------------------------------------


def _topk_geometry(vllm_config: Any) -> int | None:
    """``index_topk`` of the model in the units the merge runs in (pool ids
    for index_kpool models), or None for a model without a sparse indexer."""
    try:
        hf = vllm_config.model_config.hf_text_config
    except AttributeError:
        return None
    topk = getattr(hf, "index_topk", None)
    if not isinstance(topk, int) or topk <= 0:
        return None
    kpool = getattr(hf, "index_kpool", None) or 1
    return topk // kpool if kpool > 1 else topk


def _q_replicated(vllm_config: Any) -> bool:
    parallel = getattr(vllm_config, "parallel_config", None)
    return bool(getattr(parallel, "dcp_q_replicate", False))


def _manager_init(self, *args, **kwargs):
    """Wraps MLADCPManager.__init__: lets the patched _init_* see the
    vllm_config, then prepares the top-K workspaces of a sparse-indexer
    model (every layer of a model shares them)."""
    original = _hooks.originals["MLADCPManager.__init__"]
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    stack = getattr(_state.config, "stack", None)
    if stack is None:
        stack = _state.config.stack = []
    stack.append(vllm_config)
    try:
        original(self, *args, **kwargs)
    finally:
        stack.pop()
    k = _topk_geometry(vllm_config)
    if k is not None and self.group.world_size > 1:
        bound = _row_bound(self.max_num_tokens)
        if try_prepare_topk(self.group, max_rows=bound, k=k, device=self.device, num_ubatches=self.num_ubatches):
            _log_once("info", ("installed", "topk"), "torch_sdcp: sparse-indexer top-K merge on peer memory "
                      "(k=%d, %d rows, %d micro-batch(es))", k, bound, self.num_ubatches)


def _current_config() -> Any:
    stack = getattr(_state.config, "stack", None)
    return stack[-1] if stack else None


def _manager_init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
    """Replaces MLADCPManager._init_combine: the same partial vLLM builds,
    over this module's functions. PCP, a single rank, an unsupported dtype or
    no peer memory keep vLLM's own choice."""
    original = _hooks.originals["MLADCPManager._init_combine"]
    world = self.group.world_size
    if use_pcp or world <= 1 or dtype not in OUTPUT_DTYPES:
        return original(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)
    bound = _row_bound(self.max_num_tokens)
    if not try_prepare_output_lse(self.group, max_rows=bound, total_heads=num_heads * world, head_dim=head_dim,
                                  dtype=dtype, device=self.device, num_ubatches=self.num_ubatches):
        return original(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)
    fn = dcp_a2a_lse_reduce if self.use_a2a else cp_lse_ag_out_rs
    _log_once("info", ("installed", "output_lse"), "torch_sdcp: MLA DCP Output/LSE combine (%s) on peer memory "
              "(%d heads x %d, %d rows, %d micro-batch(es))", "a2a" if self.use_a2a else "ag_rs",
              num_heads * world, head_dim, bound, self.num_ubatches)
    return functools.partial(fn, cp_group=self.group, is_lse_base_on_e=is_lse_base_on_e)


def _manager_init_query_gather(self, num_heads, head_dim, dtype):
    """Replaces MLADCPManager._init_query_gather: the gather on heads through
    peer memory, with the manager's own _gather_query as the fallback. With
    query replication (no gather happens) vLLM's choice is kept."""
    original = _hooks.originals["MLADCPManager._init_query_gather"]
    if self.group.world_size <= 1 or _q_replicated(_current_config()):
        return original(self, num_heads, head_dim, dtype)
    bound = _row_bound(self.max_num_tokens)
    if not try_prepare_query_gather(self.group, max_rows=bound, local_heads=num_heads, width=head_dim,
                                    dtype=dtype, device=self.device, num_ubatches=self.num_ubatches):
        return original(self, num_heads, head_dim, dtype)
    _log_once("info", ("installed", "query"), "torch_sdcp: MLA DCP query gather on peer memory (%d x %d heads "
              "x %d of %s, %d rows, %d micro-batch(es))", self.group.world_size, num_heads, head_dim, dtype, bound,
              self.num_ubatches)
    return functools.partial(gather_query, cp_group=self.group, padded_num_heads=self.padded_num_heads,
                             fallback=self._gather_query)


def _resolve(module: Any, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, current value) of ``path`` ("Class.method" or "function") in ``module``."""
    owner = module
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    name = parts[-1]
    value = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return owner, name, value


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_installed() -> bool:
    return _state.installed


def install() -> bool:
    """Patch vLLM (idempotent). Returns True when the patches are in place.
    On a vLLM version not in :data:`SUPPORTED_VLLM_VERSIONS`, or when a
    target is missing, logs an error naming the version and patches nothing."""
    import importlib

    with _state.lock:
        if _state.installed:
            return True
        version = _vllm_version()
        if version.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
            _log_once("error", ("version", version), "torch_sdcp: vLLM %s is not a version this plugin knows "
                      "(supported: %s); nothing is patched and vLLM runs its own DCP paths. Check the call sites "
                      "with test/test_vllm_conformance.py before adding a version.", version,
                      ", ".join(SUPPORTED_VLLM_VERSIONS))
            return False
        try:
            modules = {name: importlib.import_module(name) for name in (_DCP, _INDEXER, _UBATCHING,
                                                                          _PARALLEL_STATE)}
            targets = [(name, path, *_resolve(modules[name], path)) for name, path in PATCHED]
            originals = {
                "cp_lse_ag_out_rs": modules[_DCP].cp_lse_ag_out_rs,
                "dcp_a2a_lse_reduce": modules[_DCP].dcp_a2a_lse_reduce,
            }
            ubatch_id = modules[_UBATCHING].dbo_current_ubatch_id
            dcp_group = modules[_PARALLEL_STATE].get_dcp_group
        except (ImportError, AttributeError, KeyError) as e:
            _log_once("error", ("targets", version), "torch_sdcp: vLLM %s lacks a DCP call site this plugin "
                      "patches (%s: %s); nothing is patched", version, type(e).__name__, e)
            return False
        replacements = {
            "MLADCPManager.__init__": _manager_init,
            "MLADCPManager._init_combine": _manager_init_combine,
            "MLADCPManager._init_query_gather": _manager_init_query_gather,
            "_merge_dcp_topk_global": merge_dcp_topk_global,
        }
        patches = []
        for _, path, owner, name, value in targets:
            originals[path] = value
            patches.append((owner, name, value, replacements[path]))
        # Modules that imported the merge by name before now hold the original.
        merge = originals["_merge_dcp_topk_global"]
        indexer = modules[_INDEXER]
        for mod in list(sys.modules.values()):
            if mod is None or mod is indexer or not getattr(mod, "__name__", "").startswith("vllm"):
                continue
            if getattr(mod, "_merge_dcp_topk_global", None) is merge:
                patches.append((mod, "_merge_dcp_topk_global", merge, merge_dcp_topk_global))
        for owner, name, _, new in patches:
            setattr(owner, name, new)
        _state.patches = patches
        configure(ubatch_id=ubatch_id, dcp_group=dcp_group, originals=originals)
        _state.installed = True
    _log_once("info", ("install", version), "torch_sdcp: installed behind vLLM %s's MLA DCP combine, query gather "
              "and sparse-indexer top-K merge (%s=1)", version, ENV_ENABLE)
    return True


def uninstall() -> None:
    """Restore every original (idempotent). Managers built while installed
    keep their combine and query gather; prepared workspaces stay until
    :func:`teardown`."""
    with _state.lock:
        if not _state.installed:
            return
        for owner, name, original, new in reversed(_state.patches):
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if current is new:
                setattr(owner, name, original)
            else:
                _log_once("warning", ("uninstall", id(owner), name), "torch_sdcp: %s.%s was replaced again after "
                          "install(); left as it is", getattr(owner, "__name__", owner), name)
        _state.patches = []
        _state.installed = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every
    process. Does nothing unless ``SDCP_VLLM=1``."""
    if not enabled():
        return
    install()
