"""torch_sdcp behind SGLang's MLA DCP decode seams: the SGLang face over the
integration core (:mod:`torch_sdcp.integrations._core`).

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
SGLang's own function, logged once per reason. See docs/SGLANG.md. Nothing
here imports SGLang at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torch_sdcp.integrations._core import OUTPUT_DTYPES, EngineHooks, Face, Seam, Site, normalise_device, query_direct
from torch_sdcp.integrations._engine import (
    SeamPlan,
    accepted_version,
    engine_logger,
    query_geometry,
    workspace_options,
)
from torch_sdcp_settings import SGLANG

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_MAX_ROWS", "ENV_TIMEOUT_S", "HOOKS", "SGLANG_SIGNATURES", "SUPPORTED_SGLANG_VERSIONS",
    "all_gather_q_for_mla_decode", "check", "configure", "cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "install",
    "is_installed", "prepare", "teardown", "workspaces",
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
_RUNTIME = "sglang.srt.runtime_context"
_REGISTRY = "sglang.srt.plugins.hook_registry"
_OWN_PATH = "SGLang's own"
_COMBINES = ("ag_rs", "a2a")  # fi_a2a is a peer-memory kernel already: it stays SGLang's

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
    (_RUNTIME, "get_parallel"): "()",
}


# ---------------------------------------------------------------------------
# The face
# ---------------------------------------------------------------------------


_face = Face("sglang", via="cpu_group", create_missing=False, make_logger=engine_logger("sglang"),
             options=workspace_options(SGLANG))
_log_once = _face.log_once


class _Hooks(EngineHooks):
    """What the calls read from SGLang, and whether install() patched it."""

    def __init__(self) -> None:
        super().__init__()
        self.installed = False
        # Made before SGLang sized its KV pool: the rows bound used, by model
        # runner, and the workspaces (by id) whose bytes SGLang counted.
        self.early_rows: dict[int, int] = {}
        self.early: set[int] = set()


_hooks = _Hooks()


def configure(*, dcp_group: Callable[[], Any] | None = None, originals: dict[str, Callable] | None = None) -> None:
    """Set, without SGLang, what :func:`install` reads from it: the DCP group
    (``get_parallel().dcp_group``) and the fallbacks by name
    (``cp_lse_ag_out_rs_mla``, ``dcp_a2a_lse_reduce``,
    ``all_gather_q_for_mla_decode``)."""
    _hooks.configure(dcp_group, originals)


def workspaces() -> list[Any]:
    """Every workspace this face prepared in this process."""
    return _face.workspaces()


def teardown() -> None:
    """Close every prepared workspace (collective: every DCP rank, at
    shutdown, outside capture) and forget them. Idempotent."""
    _forget_early()
    _face.teardown()


def _forget_early() -> None:
    _hooks.early_rows.clear()
    _hooks.early.clear()


def check() -> None:
    """Raise if a live workspace of this face recorded a failure on this
    rank (a call failed, timed out or a peer aborted it): the core's
    :func:`~torch_sdcp.integrations._core.check_live_workspaces`. Never
    synchronises (it reads the error record the kernels keep in host-mapped
    memory), so it costs microseconds per step and sees failures inside
    replayed CUDA graphs."""
    _face.check()


def prepare(group: Any, *, max_rows: int, local_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
            device: Any, combine: bool = True, query: bool = True) -> dict[str, bool]:
    """Prepare (collectively: every rank of ``group``, same order) the
    workspaces of one MLA geometry: the Output/LSE combine of
    ``local_heads x N`` heads of ``kv_lora_rank`` and the query gather of
    ``local_heads`` heads of ``rope_dim + kv_lora_rank``, both for up to
    ``max_rows`` rows of ``dtype``. Returns which boundaries run on peer
    memory; the others keep SGLang's own path (logged once)."""
    g = _face.group(group, "group")
    dev = normalise_device(device)
    done = {"output_lse": False, "query": False}
    if combine and dtype in OUTPUT_DTYPES:
        done["output_lse"] = _face.try_prepare(
            "output_lse", g, {"total_heads": local_heads * g.world, "head_dim": kv_lora_rank, "dtype": dtype}, dev,
            max_rows, 1, _OWN_PATH)
    width = rope_dim + kv_lora_rank
    if query and query_direct(width, dtype):
        done["query"] = _face.try_prepare("query", g, query_geometry(local_heads, width, dtype), dev, max_rows, 1,
                                          _OWN_PATH)
    return done


# ---------------------------------------------------------------------------
# The replacements: SGLang's signatures, shapes and layouts
# ---------------------------------------------------------------------------


def _fallback(name: str) -> Callable:
    original = _hooks.originals.get(name)
    return original if original is not None else _COLLECTIVE[name]


def _pg(cp_group: Any) -> Any:
    return getattr(cp_group, "device_group", cp_group)


def _collective_ag_rs(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=False):
    from torch_sdcp import collective

    out = collective.lse_all_gather_correct_reduce_scatter(cp_attn_out, cp_attn_lse.float(),
                                                           base2=not is_lse_base_on_e, group=_pg(cp_group))
    return out.transpose(0, 1)  # the head-major [H/N, B, D] storage the collective wrote


def _collective_a2a(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=True, cuda_graph_buffers=None,
                    comm_backend="a2a"):
    from torch_sdcp import collective

    out = collective.lse_all_gather_correct_reduce_scatter(cp_attn_out, cp_attn_lse.float(),
                                                           base2=not is_lse_base_on_e, group=_pg(cp_group))
    return out.contiguous()


def _collective_query(q_nope_out, q_pe):
    from torch_sdcp import collective

    if _hooks.dcp_group is None:
        raise RuntimeError("torch_sdcp: all_gather_q_for_mla_decode has no DCP group: install() the plugin in "
                           "SGLang, or configure(dcp_group=...) first")
    combined = torch.cat([q_pe, q_nope_out], dim=-1)
    return _split(collective.all_gather_heads(combined, _pg(_hooks.dcp_group())), q_pe.shape[-1])


_COLLECTIVE: dict[str, Callable] = {"cp_lse_ag_out_rs_mla": _collective_ag_rs, "dcp_a2a_lse_reduce": _collective_a2a,
                                    "all_gather_q_for_mla_decode": _collective_query}


def _combine_inputs(cp_attn_out: Tensor, cp_attn_lse: Tensor) -> tuple[Tensor, Tensor] | None:
    """(out [B, H, D], lse [B, H] fp32) as the peer path takes them, or None
    for what only SGLang's own function handles (another rank count, an fp8
    output, an LSE that is not [B, H] up to a 1-sized dimension)."""
    if cp_attn_out.dim() != 3 or cp_attn_out.dtype not in OUTPUT_DTYPES:
        return None
    lse = cp_attn_lse
    if lse.dim() == 3 and 1 in lse.shape[1:]:
        lse = lse.squeeze(-1) if lse.shape[-1] == 1 else lse.squeeze(1)
    if tuple(lse.shape) != tuple(cp_attn_out.shape[:2]):
        return None
    return cp_attn_out, lse


_SEAMS = {name: Seam("output_lse", name, _OWN_PATH, missing=f"{name} takes {_OWN_PATH} path")
          for name in ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce")}
_QUERY = Seam("query", "all_gather_q_for_mla_decode", _OWN_PATH, missing=f"the query gather takes {_OWN_PATH} path")


def _combine(name: str, fallback: Callable[[], Tensor], cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any,
             is_lse_base_on_e: bool) -> Tensor | None:
    """The combine on the Output/LSE workspace: this rank's heads [B, H/N, D]
    contiguous, or None when this face does not cover the call."""
    group = _face.group(cp_group, "cp_group")
    if group.world == 1:
        return None
    inputs = _combine_inputs(cp_attn_out, cp_attn_lse)
    if inputs is None:
        _log_once("warning", ("uncovered", name, cp_attn_out.dtype, cp_attn_out.dim()), "torch_sdcp: %s of %s %s "
                  "with LSE %s is not covered; it takes %s path", name, list(cp_attn_out.shape), cp_attn_out.dtype,
                  list(cp_attn_lse.shape), _OWN_PATH)
        return None
    out, lse = inputs
    rows, heads, dim = out.shape
    if rows == 0:
        return None
    base = "e" if is_lse_base_on_e else "2"
    site = Site(group, {"total_heads": heads, "head_dim": dim, "dtype": out.dtype}, out.device)
    return _face.call(_SEAMS[name], site, rows,
                      lambda ws: ws.combine(out.contiguous(), lse.float().contiguous(), lse_base=base), fallback)


def cp_lse_ag_out_rs_mla(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                         is_lse_base_on_e: bool = False) -> Tensor:
    """SGLang's ``cp_lse_ag_out_rs_mla`` (``--dcp-comm-backend ag_rs``) on peer
    memory: ``cp_attn_out [B, H, D]`` and ``cp_attn_lse [B, H]`` of this rank's
    KV shard -> this rank's heads, head-major ``[H/N, B, D]`` (the caller
    transposes; here a transposed view of contiguous ``[B, H/N, D]``, so the
    caller's transpose is contiguous). LSE base 2 unless ``is_lse_base_on_e``.
    NaN and +inf LSEs are empty shards, as in SGLang's kernel; ``ctx`` (its
    Triton kernel cache) is accepted and ignored."""
    args = (cp_attn_out, cp_attn_lse, cp_group, ctx, is_lse_base_on_e)
    own = _fallback("cp_lse_ag_out_rs_mla")
    marker: list = []

    def fallback():
        marker.append(True)
        return own(*args)

    out = _combine("cp_lse_ag_out_rs_mla", fallback, cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e)
    if out is None:
        return own(*args)
    return out if marker else out.transpose(0, 1)


def dcp_a2a_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, is_lse_base_on_e: bool = True,
                       cuda_graph_buffers: dict | None = None, comm_backend: str = "a2a") -> Tensor:
    """SGLang's ``dcp_a2a_lse_reduce`` (``--dcp-comm-backend a2a``) on peer
    memory: the same inputs as :func:`cp_lse_ag_out_rs_mla`, this rank's heads
    ``[B, H/N, D]`` contiguous. ``cuda_graph_buffers`` (SGLang's staging
    buffers) are not needed and ignored; ``comm_backend="fi_a2a"`` (FlashInfer's
    MNNVL kernel) runs SGLang's own function."""
    args = (cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e, cuda_graph_buffers, comm_backend)
    own = _fallback("dcp_a2a_lse_reduce")
    if comm_backend != "a2a" or cp_attn_lse.dtype != torch.float32:  # SGLang's own checks and kernels
        return own(*args)
    out = _combine("dcp_a2a_lse_reduce", lambda: own(*args), cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e)
    return own(*args) if out is None else out


def _split(gathered: Tensor, rope_dim: int) -> tuple[Tensor, Tensor]:
    """(q_nope_out, q_pe) views of the gathered cat([q_pe, q_nope]) heads."""
    return gathered[..., rope_dim:], gathered[..., :rope_dim]


def all_gather_q_for_mla_decode(q_nope_out: Tensor, q_pe: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's ``all_gather_q_for_mla_decode`` on peer memory:
    ``q_nope_out [B, H, Dn]`` and ``q_pe [B, H, R]`` on every DCP rank ->
    ``(q_nope_out [B, N*H, Dn], q_pe [B, N*H, R])``, head ``src*H + h``, two
    views of one gathered ``cat([q_pe, q_nope])`` buffer, every non-NaN value
    bit-exact. SGLang's buffer is head-major ``[N*H, B, R+Dn]``, this one
    token-major ``[B, N*H, R+Dn]``: the same shapes, dtype and values, the
    last dimension contiguous in both (docs/SGLANG.md)."""
    own = _fallback("all_gather_q_for_mla_decode")
    if _hooks.dcp_group is None or q_nope_out.dim() != 3 or q_pe.dim() != 3 or q_nope_out.shape[:2] != q_pe.shape[:2] \
            or q_nope_out.dtype != q_pe.dtype or q_nope_out.shape[0] == 0:
        return own(q_nope_out, q_pe)
    group = _face.group(_hooks.dcp_group(), "cp_group")
    if group.world == 1:
        return own(q_nope_out, q_pe)
    rows, heads, _ = q_nope_out.shape
    rope_dim = q_pe.shape[-1]
    width = rope_dim + q_nope_out.shape[-1]

    def peer(ws):
        return _split(ws.all_gather_heads(torch.cat([q_pe, q_nope_out], dim=-1)), rope_dim)

    return _face.call(_QUERY, Site(group, query_geometry(heads, width, q_pe.dtype), q_pe.device), rows, peer,
                      lambda: own(q_nope_out, q_pe))


# ---------------------------------------------------------------------------
# The hooks: warm-up (before capture), every step, shutdown
# ---------------------------------------------------------------------------


def _row_bound(runner: Any) -> int:
    """SGLang's widest decode batch in rows (captured batch sizes x tokens per
    request), or without CUDA graphs max_running_requests x tokens per
    request; capped by ``SDCP_SGLANG_MAX_ROWS``."""
    rows = runner._widest_decode_rows()
    if rows is None:
        mr = runner.model_runner
        rows = int(mr.max_running_requests) * int(mr.decode_num_tokens_per_req())
    cap = SGLANG.max_rows_cap()
    return min(int(rows), cap) if cap else int(rows)


def _rows_before_the_pool(mr: Any) -> int | None:
    """An upper bound of :func:`_row_bound` that is known before SGLang sizes
    its KV pool, or None. With CUDA graphs: the largest decode batch size of
    the CUDA-graph configuration times tokens per request (SGLang's
    ``get_batch_sizes_to_capture`` only filters that list, by alignment and
    by the request pool the KV sizing makes); without: the
    ``--max-running-requests`` the user set (else SGLang derives it from the
    pool: None). Capped by ``SDCP_SGLANG_MAX_ROWS``."""
    runtime = importlib.import_module(_RUNTIME)
    graphs = runtime.get_exec().graph.cuda_graph_config
    if graphs is not None:
        sizes = list(graphs.decode.bs or ())
        rows = max(sizes) * int(mr.decode_num_tokens_per_req()) if sizes else None
    else:
        requests = runtime.get_schedule().max_running_requests
        rows = int(requests) * int(mr.decode_num_tokens_per_req()) if requests else None
    if rows is None:
        return None
    cap = SGLANG.max_rows_cap()
    return min(int(rows), cap) if cap else int(rows)


def _mla_geometries(model: Any) -> list[tuple[int, int, int]]:
    """(local heads, kv_lora_rank, qk_rope_head_dim) of every MLA attention
    module of ``model`` that runs DCP (``dcp_size > 1``), without repeats."""
    found: list[tuple[int, int, int]] = []
    for module in model.modules():
        if getattr(module, "dcp_size", 1) > 1 and hasattr(module, "kv_lora_rank"):
            g = (int(module.num_local_heads), int(module.kv_lora_rank), int(module.qk_rope_head_dim))
            if g not in found:
                found.append(g)
    return found


# How to turn a seam on, per reason it is off (the start-up line names it).
_SEAMS_OPTION = SGLANG.options[SGLANG.SEAMS]
_ENABLE_COMBINE = "--dcp-comm-backend ag_rs or a2a"
_ENABLE_QUERY = ("--no-dcp-replicate-q-proj (DSA models such as DeepSeek-V3.2 and GLM-5, and Kimi-K3, replicate "
                 "the query projection by default)")


def _plan(parallel: Any, group: Any) -> SeamPlan:
    """The seams' decisions by setting, before any workspace exists."""
    plan = SeamPlan(SGLANG, str(getattr(group, "unique_name", "dcp")), int(getattr(group, "world_size", 0)))
    selected = SGLANG.seams()
    backend = parallel.dcp_comm_backend
    if "combine" not in selected:
        plan.decide("combine", False, f"not in {SGLANG.SEAMS}", f"add combine to {SGLANG.SEAMS} or {_SEAMS_OPTION}")
    elif backend not in _COMBINES:
        plan.decide("combine", False, f"--dcp-comm-backend {backend} stays SGLang's", _ENABLE_COMBINE)
    if "query" not in selected:
        plan.decide("query", False, f"not in {SGLANG.SEAMS}", f"add query to {SGLANG.SEAMS} or {_SEAMS_OPTION}")
    elif parallel.dcp_replicate_q_proj:
        plan.decide("query", False, "--dcp-replicate-q-proj: no query gather", _ENABLE_QUERY)
    return plan


# The devices whose runners SGLang warms up (BaseRunner._warmup returns at
# once on any other, so the pre-capture hook never runs there): only there are
# workspaces made before the KV pool, so that both hooks agree.
_WARMED_UP_ON: tuple[str, ...] = ("cuda",)


def _before_alloc_memory_pool(mr: Any, *args: Any, **kwargs: Any) -> None:
    """Before ``ModelRunner.alloc_memory_pool`` of the target model, where
    SGLang sizes the KV pool from the free GPU memory
    (``KVCacheConfigurator._profile_available_bytes``: free memory minus the
    ``--mem-fraction-static`` headroom): the workspaces of the model's DCP
    MLA geometries, so that their bytes are counted in SGLang's budget and do
    not come out of the headroom. The rows bound is then
    :func:`_rows_before_the_pool`; when it is not known yet, or for a draft
    model (its pool follows the target's sizing), the workspaces are made at
    warm-up as before. Never raises: a failure is logged, and the warm-up
    tries again (and applies the ``require`` mode)."""
    try:
        if getattr(mr, "is_draft_worker", False) or str(mr.device) not in _WARMED_UP_ON:
            return
        parallel = importlib.import_module(_RUNTIME).get_parallel()
        if not parallel.dcp_enabled:
            return
        plan = _plan(parallel, parallel.dcp_group)
        combine, query = "combine" not in plan.seams, "query" not in plan.seams
        geometries = _mla_geometries(mr.model)
        if not (combine or query) or not geometries:
            return
        rows = _rows_before_the_pool(mr)
        if rows is None:
            _log_once("warning", "late", "torch_sdcp: the rows bound is known only after SGLang sized its KV pool "
                      "(no CUDA graphs and no --max-running-requests): the workspaces are made at warm-up, outside "
                      "SGLang's memory budget")
            return
        before = {id(ws) for ws in workspaces()}
        for heads, rank, rope in geometries:
            prepare(parallel.dcp_group, max_rows=rows, local_heads=heads, kv_lora_rank=rank, rope_dim=rope,
                    dtype=mr.model_config.dtype, device=mr.device, combine=combine, query=query)
        made = [ws for ws in workspaces() if id(ws) not in before]
        _hooks.early_rows[id(mr)] = rows
        _hooks.early.update(id(ws) for ws in made)
        if made:
            _log_once("info", "early", "torch_sdcp: %d workspace(s), %d bytes per rank, made before SGLang sizes "
                      "its KV pool (counted in its budget), %d rows", len(made), _bytes(made), rows)
    except Exception as e:
        _log_once("error", ("early-failed", type(e).__name__), "torch_sdcp: making the SGLang DCP workspaces "
                  "before the KV pool failed (%s: %s); they are tried again at warm-up", type(e).__name__, e)


def _bytes(made: list[Any]) -> int:
    """Physical bytes per rank of ``made`` (granularity-rounded)."""
    return sum(int(getattr(ws, "physical_bytes", 0) or getattr(ws, "nbytes_per_rank", 0)) for ws in made)


def _log_outside_budget(mr: Any) -> None:
    """One warning when workspaces were made after SGLang sized its KV pool:
    their bytes, and the ``--mem-fraction-static`` that keeps SGLang's
    headroom (``pre_model_load_memory x (1 - fraction)``) whole."""
    late = [ws for ws in workspaces() if ws.peer and id(ws) not in _hooks.early]
    if not late:
        return
    nbytes = _bytes(late)
    advice = ""
    pre, fraction = getattr(mr, "pre_model_load_memory", None), getattr(mr, "mem_fraction_static", None)
    if isinstance(pre, (int, float)) and isinstance(fraction, (int, float)) and pre > 0:
        advice = (f"; to keep it, lower --mem-fraction-static by {nbytes / 2**30 / pre:.4f} "
                  f"({fraction:g} -> {fraction - nbytes / 2**30 / pre:.4f})")
    _log_once("warning", ("outside-budget", nbytes), "torch_sdcp: %d workspace(s), %d bytes per rank, were made "
              "after SGLang sized its KV pool: they come out of the --mem-fraction-static headroom%s", len(late),
              nbytes, advice)


def _after_pre_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang's pre-capture workspace initialisation (SGLang's logging
    is configured by then): this face's workspaces for every DCP MLA
    geometry of the runner's model, and one line per DCP group naming each
    seam on or off, why, and what turns it on. Never raises into SGLang
    (a failure is logged and SGLang keeps its own paths), except in the
    ``SDCP_SGLANG=require`` mode, where a selected seam that stays SGLang's
    fails start-up."""
    try:
        parallel = importlib.import_module(_RUNTIME).get_parallel()
        if not parallel.dcp_enabled:
            _log_once("info", "dcp-off", "torch_sdcp: SGLang runs without DCP: nothing to replace (%s=%s)",
                      SGLANG.ENABLE, SGLANG.mode()[0])
            return
        group, mr = parallel.dcp_group, runner.model_runner
        plan = _plan(parallel, group)
        combine, query = "combine" not in plan.seams, "query" not in plan.seams
        if combine or query:
            bound = _hooks.early_rows.get(id(mr)) or _row_bound(runner)
            dtype = mr.model_config.dtype
            done = {"output_lse": False, "query": False}
            geometries = _mla_geometries(mr.model)
            for heads, rank, rope in geometries:
                got = prepare(group, max_rows=bound, local_heads=heads, kv_lora_rank=rank, rope_dim=rope,
                              dtype=dtype, device=mr.device, combine=combine, query=query)
                done = {k: done[k] or got[k] for k in done}
            shape = ", ".join(f"{h} local heads x {r} + {e}" for h, r, e in geometries) or "no DCP MLA layer"
            for seam, kind, wanted in (("combine", "output_lse", combine), ("query", "query", query)):
                if not wanted:
                    continue
                if done[kind]:
                    plan.decide(seam, True, f"peer memory, {bound} rows, {shape}")
                elif not geometries:
                    plan.decide(seam, False, "no DCP MLA layer in the model", "")
                else:
                    plan.decide(seam, False, f"peer memory unavailable or a geometry not covered ({shape}, {dtype})",
                                "a DCP group inside one node whose GPUs map each other's memory, bf16/fp16/fp32")
        plan.emit(lambda level, text: _log_once(level, ("plan", plan.group), "%s", text))
        _log_outside_budget(mr)
    except Exception as e:
        if SGLANG.required():
            raise
        _log_once("error", ("prepare-failed", type(e).__name__), "torch_sdcp: preparing the SGLang DCP workspaces "
                  "failed (%s: %s); SGLang keeps its own DCP paths", type(e).__name__, e)


def _before_forward(*args: Any, **kwargs: Any) -> None:
    check()  # a poisoned workspace fails the step, on every rank (the failing call aborted the peers)


def _wait_for_step(result: Any) -> None:
    """The step's own synchronisation, as SGLang's result processors do it
    first (``SchedulerBatchResultProcessor.process_batch_result_decode``,
    ``_prefill``, ``_idle``): wait for ``result.copy_done`` (the event, or the
    async copy worker's ``HostCopyDone``, that ``Scheduler.run_batch`` records
    after the batch's forward and its device-to-host copy) when there is one;
    without it (the normal loop, where the processors' ``tolist()`` waits for
    the scheduler's current stream) the current CUDA stream. Waiting here, a
    few statements earlier, adds no synchronisation: the processor's own wait
    then returns at once."""
    done = getattr(result, "copy_done", None)
    if done is not None:
        done.synchronize()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _before_results(*args: Any, **kwargs: Any) -> None:
    """Before ``Scheduler.process_batch_result(batch, result)``, which every
    event loop calls to turn a batch's result into outputs (the overlap loop
    one step late, after the next batch's forward was launched): once the
    step's kernels finished (:func:`_wait_for_step`), :func:`check`. A
    failure recorded by this batch's calls then raises before any of its
    outputs is streamed. Nothing runs while this face holds no peer
    workspace."""
    if not any(ws.peer for ws in _face.workspaces()):
        return
    result = kwargs["result"] if "result" in kwargs else args[2] if len(args) > 2 else None
    _wait_for_step(result)
    check()


def _before_shutdown(*args: Any, **kwargs: Any) -> None:
    """Before SGLang's ``abort_distributed_environment``, a deliberately
    local teardown: every workspace released on this rank without waiting for
    any peer (a collective close could block the whole timeout)."""
    _forget_early()
    _face.release_local("SGLang aborts its distributed environment")


# (target, SGLang HookType name, hook); the three replacements are looked up at install().
HOOKS: tuple[tuple[str, str, Callable], ...] = (
    (f"{_COMM}.cp_lse_ag_out_rs_mla", "REPLACE", cp_lse_ag_out_rs_mla),
    (f"{_COMM}.dcp_a2a_lse_reduce", "REPLACE", dcp_a2a_lse_reduce),
    (f"{_COMM}.all_gather_q_for_mla_decode", "REPLACE", all_gather_q_for_mla_decode),
    (f"{_MODEL_RUNNER}.ModelRunner.alloc_memory_pool", "BEFORE", _before_alloc_memory_pool),
    (f"{_RUNNER}.BaseRunner._pre_initialize_fi_a2a_workspace", "AFTER", _after_pre_initialize),
    (f"{_MODEL_RUNNER}.ModelRunner.forward", "BEFORE", _before_forward),
    (f"{_SCHEDULER}.Scheduler.process_batch_result", "BEFORE", _before_results),
    (f"{_PARALLEL_STATE}.abort_distributed_environment", "BEFORE", _before_shutdown),
)


def is_installed() -> bool:
    return _hooks.installed


def _sglang_version() -> str:
    return str(getattr(importlib.import_module("sglang.version"), "__version__", "unknown"))


def install() -> bool:
    """Register this face's hooks with SGLang's hook registry (idempotent;
    SGLang applies them after its plugins ran). On a version not in
    :data:`SUPPORTED_SGLANG_VERSIONS`, or when a seam is missing, logs an
    error and registers nothing."""
    with _hooks.lock:
        if _hooks.installed:
            return True
        version = _sglang_version()
        if not accepted_version(version, SUPPORTED_SGLANG_VERSIONS):
            _log_once("error", ("version", version), "torch_sdcp: SGLang %s is not a version this plugin knows "
                      "(supported: %s and their .postN releases); nothing is replaced and SGLang runs its own DCP "
                      "paths. Check the seams with test/test_sglang_conformance.py before adding a version.", version,
                      ", ".join(SUPPORTED_SGLANG_VERSIONS))
            return False
        try:
            comm = importlib.import_module(_COMM)
            registry = importlib.import_module(_REGISTRY)
            originals = {name: getattr(comm, name) for name in _COLLECTIVE}
            get_parallel = importlib.import_module(_RUNTIME).get_parallel
        except (ImportError, AttributeError) as e:
            _log_once("error", ("seams", version), "torch_sdcp: SGLang %s lacks a DCP seam this plugin replaces "
                      "(%s: %s); nothing is replaced", version, type(e).__name__, e)
            return False
        configure(dcp_group=lambda: get_parallel().dcp_group, originals=originals)
        for target, kind, hook in HOOKS:
            registry.HookRegistry.register(target, hook, getattr(registry.HookType, kind))
        _hooks.installed = True
    _log_once("info", ("install", version), "torch_sdcp: registered behind SGLang %s's MLA DCP combine (ag_rs, "
              "a2a) and query gather (SDCP_SGLANG=1)", version)
    return True
