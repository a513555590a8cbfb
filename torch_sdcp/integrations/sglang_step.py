"""The SGLang plugin's hooks around the calls: the workspaces made before
SGLang sizes its KV pool or at warm-up (before CUDA-graph capture) with the
start-up line per DCP group, the health check before every forward and
before a batch's outputs leave, and the local release at SGLang's abort.
Registered by torch_sdcp.integrations.sglang; nothing here imports SGLang at
import time."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from torch_sdcp.integrations._engine import SeamPlan
from torch_sdcp.integrations.sglang_calls import check, engine, face, forget_early, prepare, workspaces
from torch_sdcp_settings import SGLANG

__all__ = ["RUNTIME", "after_pre_initialize", "before_alloc_memory_pool", "before_forward", "before_results",
           "before_shutdown", "seam_plan"]

RUNTIME = "sglang.srt.runtime_context"
_COMBINES = ("ag_rs", "a2a")  # fi_a2a is a peer-memory kernel already: it stays SGLang's


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
    runtime = importlib.import_module(RUNTIME)
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


def seam_plan(parallel: Any, group: Any) -> SeamPlan:
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


def before_alloc_memory_pool(mr: Any, *args: Any, **kwargs: Any) -> None:
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
        parallel = importlib.import_module(RUNTIME).get_parallel()
        if not parallel.dcp_enabled:
            return
        plan = seam_plan(parallel, parallel.dcp_group)
        combine, query = "combine" not in plan.seams, "query" not in plan.seams
        geometries = _mla_geometries(mr.model)
        if not (combine or query) or not geometries:
            return
        rows = _rows_before_the_pool(mr)
        if rows is None:
            face.log_once("warning", "late", "torch_sdcp: the rows bound is known only after SGLang sized its KV pool "
                      "(no CUDA graphs and no --max-running-requests): the workspaces are made at warm-up, outside "
                      "SGLang's memory budget")
            return
        before = {id(ws) for ws in workspaces()}
        for heads, rank, rope in geometries:
            prepare(parallel.dcp_group, max_rows=rows, local_heads=heads, kv_lora_rank=rank, rope_dim=rope,
                    dtype=mr.model_config.dtype, device=mr.device, combine=combine, query=query)
        made = [ws for ws in workspaces() if id(ws) not in before]
        engine.early_rows[id(mr)] = rows
        engine.early.update(id(ws) for ws in made)
        if made:
            face.log_once("info", "early", "torch_sdcp: %d workspace(s), %d bytes per rank, made before SGLang sizes "
                      "its KV pool (counted in its budget), %d rows", len(made), _bytes(made), rows)
    except Exception as e:
        face.log_once("error", ("early-failed", type(e).__name__), "torch_sdcp: making the SGLang DCP workspaces "
                  "before the KV pool failed (%s: %s); they are tried again at warm-up", type(e).__name__, e)


def _bytes(made: list[Any]) -> int:
    """Physical bytes per rank of ``made`` (granularity-rounded)."""
    return sum(int(getattr(ws, "physical_bytes", 0) or getattr(ws, "nbytes_per_rank", 0)) for ws in made)


def _log_outside_budget(mr: Any) -> None:
    """One warning when workspaces were made after SGLang sized its KV pool:
    their bytes, and the ``--mem-fraction-static`` that keeps SGLang's
    headroom (``pre_model_load_memory x (1 - fraction)``) whole."""
    late = [ws for ws in workspaces() if ws.peer and id(ws) not in engine.early]
    if not late:
        return
    nbytes = _bytes(late)
    advice = ""
    pre, fraction = getattr(mr, "pre_model_load_memory", None), getattr(mr, "mem_fraction_static", None)
    if isinstance(pre, (int, float)) and isinstance(fraction, (int, float)) and pre > 0:
        advice = (f"; to keep it, lower --mem-fraction-static by {nbytes / 2**30 / pre:.4f} "
                  f"({fraction:g} -> {fraction - nbytes / 2**30 / pre:.4f})")
    face.log_once("warning", ("outside-budget", nbytes), "torch_sdcp: %d workspace(s), %d bytes per rank, were made "
              "after SGLang sized its KV pool: they come out of the --mem-fraction-static headroom%s", len(late),
              nbytes, advice)


def after_pre_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang's pre-capture workspace initialisation (SGLang's logging
    is configured by then): this face's workspaces for every DCP MLA
    geometry of the runner's model, and one line per DCP group naming each
    seam on or off, why, and what turns it on. Never raises into SGLang
    (a failure is logged and SGLang keeps its own paths), except in the
    ``SDCP_SGLANG=require`` mode, where a selected seam that stays SGLang's
    fails start-up."""
    try:
        parallel = importlib.import_module(RUNTIME).get_parallel()
        if not parallel.dcp_enabled:
            face.log_once("info", "dcp-off", "torch_sdcp: SGLang runs without DCP: nothing to replace (%s=%s)",
                      SGLANG.ENABLE, SGLANG.mode()[0])
            return
        group, mr = parallel.dcp_group, runner.model_runner
        plan = seam_plan(parallel, group)
        combine, query = "combine" not in plan.seams, "query" not in plan.seams
        if combine or query:
            bound = engine.early_rows.get(id(mr)) or _row_bound(runner)
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
        plan.emit(lambda level, text: face.log_once(level, ("plan", plan.group), "%s", text))
        _log_outside_budget(mr)
    except Exception as e:
        if SGLANG.required():
            raise
        face.log_once("error", ("prepare-failed", type(e).__name__), "torch_sdcp: preparing the SGLang DCP workspaces "
                  "failed (%s: %s); SGLang keeps its own DCP paths", type(e).__name__, e)


def before_forward(*args: Any, **kwargs: Any) -> None:
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


def before_results(*args: Any, **kwargs: Any) -> None:
    """Before ``Scheduler.process_batch_result(batch, result)``, which every
    event loop calls to turn a batch's result into outputs (the overlap loop
    one step late, after the next batch's forward was launched): once the
    step's kernels finished (:func:`_wait_for_step`), :func:`check`. A
    failure recorded by this batch's calls then raises before any of its
    outputs is streamed. Nothing runs while this face holds no peer
    workspace."""
    if not any(ws.peer for ws in face.workspaces()):
        return
    result = kwargs["result"] if "result" in kwargs else args[2] if len(args) > 2 else None
    _wait_for_step(result)
    check()


def before_shutdown(*args: Any, **kwargs: Any) -> None:
    """Before SGLang's ``abort_distributed_environment``, a deliberately
    local teardown: every workspace released on this rank without waiting for
    any peer (a collective close could block the whole timeout)."""
    forget_early()
    face.release_local("SGLang aborts its distributed environment")

