"""What an engine plugin would do, without the engine and without a GPU:

    python -m torch_sdcp.plugin_check --engine vllm --decode-context-parallel-size 4 \\
        --dcp-comm-backend a2a --num-heads 64 --rows 1024 --index-topk 2048
    python -m torch_sdcp.plugin_check --engine sglang --dcp-size 8 --dcp-comm-backend fi_a2a \\
        --dcp-replicate-q-proj --num-heads 128 --rows 512

prints the plugin's settings (``SDCP_VLLM*`` / ``SDCP_SGLANG*`` of the
environment, validated as the plugin validates them), the start-up line the
plugin would log for the DCP group (each seam on or off, why, what turns it
on), the rows bound, and the bytes per rank of every workspace it would
create (the C++ layout's region sizes, per micro-batch), then exits 0, or 1
when the ``require`` mode would stop the start-up or a setting is bad. For
either engine it also says what the engine decides before the plugin runs:
a ``VLLM_PLUGINS`` / ``SGLANG_PLUGINS`` that leaves the plugin out, and an
installed engine whose version the plugin refuses (in the ``require`` mode either exits 1: the
plugin cannot stop a start-up it is not loaded into, or is refused by).

The engine's configuration is given here as the engine's flags that matter
(this does not run the engine's own argument resolution); for vLLM the rows
bound and the gathered query's dtype are derived from vLLM's own flags as
vLLM derives them, when given (``plugin_check_engine``), and a ``--rows`` or
``--query-dtype`` that differs is said. Peer memory is
assumed unless ``--gate`` is given: then the workspaces' own peer-memory gate
runs on this node, one process per rank of the DCP group on GPUs
``0 .. N-1`` (as the engine's first DCP group would), and a gate that fails
turns every seam off, with its reason.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from torch_sdcp.cli_types import positive_int, positive_seconds
from torch_sdcp.plugin_check_engine import add_vllm_flags, check_vllm_flags, vllm_query_dtype, vllm_rows_bound
from torch_sdcp.plugin_check_env import engine_environment
from torch_sdcp_settings import MODES, SGLANG, VLLM, EngineSettings

__all__ = ["main", "report"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}


#: The DCP communication backends each engine knows (its --dcp-comm-backend).
_COMM_BACKENDS = {"vllm": ("ag_rs", "a2a"), "sglang": ("ag_rs", "a2a", "fi_a2a")}




def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_sdcp.plugin_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # Required, but checked after the parse: an unknown option, or --gate alone, is then reported as such.
    p.add_argument("--engine", choices=tuple(_COMM_BACKENDS), default=None, help="required: vllm or sglang")
    p.add_argument("--decode-context-parallel-size", "--dcp-size", "-dcp", dest="world", type=positive_int,
                   default=2, help="ranks of the DCP group (default 2)")
    p.add_argument("--dcp-comm-backend", default="ag_rs", help="vLLM: ag_rs or a2a; SGLang: ag_rs, a2a or fi_a2a")
    p.add_argument("--dcp-replicate-q-proj", action="store_true", help="SGLang: the query projection is replicated")
    p.add_argument("--prefill-context-parallel", action="store_true", help="vLLM: PCP is on")
    p.add_argument("--num-heads", type=positive_int, default=128, help="attention heads of the model (all ranks)")
    p.add_argument("--kv-lora-rank", type=positive_int, default=512)
    p.add_argument("--qk-rope-head-dim", type=positive_int, default=64)
    p.add_argument("--index-topk", type=positive_int, default=None, help="the sparse indexer's top-K (DSA models)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16", help="the attention output's dtype")
    p.add_argument("--query-dtype", choices=tuple(_DTYPES), default=None,
                   help="vLLM: the gathered query's dtype (default: --dtype)")
    p.add_argument("--rows", type=positive_int, default=None,
                   help="the engine's DCP rows bound (widest decode batch; default 1024); with vLLM's flags below, "
                        "vLLM's derivation wins and a difference is said")
    p.add_argument("--num-ubatches", type=positive_int, default=1, help="vLLM: micro-batches (dual-batch overlap: 2)")
    p.add_argument("--gate", action="store_true",
                   help="run the peer-memory gate on this node's GPUs 0..N-1 (N: the DCP size), as start-up would")
    p.add_argument("--gate-backend", choices=("cuda", "host"), default="cuda",
                   help="host: the shared-memory backend (the gate's plumbing on a machine without GPUs)")
    p.add_argument("--gate-timeout-s", type=positive_seconds, default=120.0, help="bound of the whole gate run")
    # The engine's own options of the plugin (SGLang's --sdcp, ...): given, each wins over its variable, as in the
    # engine; checked by the settings' parsers (a bad value: exit 1, as a bad variable).
    for settings in (SGLANG, VLLM):
        for env, option in settings.options.items():
            p.add_argument(option, dest=_option_dest(option), default=None, metavar="VALUE",
                           help=f"{settings.engine}: the plugin's {option} (default: {env})")
    add_vllm_flags(p)
    return p


def _option_dest(option: str) -> str:
    return "engine_" + option.lstrip("-").replace("-", "_")


def _engine_options(args: argparse.Namespace, settings: EngineSettings) -> dict[str, str]:
    """{variable: value} of the engine's own plugin options given on the command line."""
    given = {env: getattr(args, _option_dest(option), None) for env, option in settings.options.items()}
    return {env: value for env, value in given.items() if value is not None}


def _parse(argv: list[str]) -> argparse.Namespace:
    """The options, every bad one a usage error naming it (exit 2): unknown
    options first, then a missing --engine, then the values that depend on
    each other."""
    p = _parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}"
                + ("" if args.engine else " (and the required --engine vllm|sglang is missing)"))
    if args.engine is None:
        p.error("argument --engine: expected vllm or sglang, got none"
                + (" (--gate runs the peer-memory gate of that engine's DCP group: it needs --engine)"
                   if args.gate else ""))
    for other in (SGLANG, VLLM):
        if other.engine.lower() != args.engine and _engine_options(args, other):
            names = ", ".join(other.options[e] for e in _engine_options(args, other))
            p.error(f"argument {names}: {other.engine}'s option, expected with --engine {other.engine.lower()}, "
                    f"got --engine {args.engine}")
    check_vllm_flags(p, args)
    known = _COMM_BACKENDS[args.engine]
    if args.dcp_comm_backend not in known:
        p.error(f"argument --dcp-comm-backend: expected one of {', '.join(known)} with --engine {args.engine}, "
                f"got {args.dcp_comm_backend!r}")
    if args.num_heads % args.world:
        p.error(f"argument --num-heads: expected a multiple of the DCP size {args.world} "
                f"(--decode-context-parallel-size), got {args.num_heads}")
    return args


def _engine_rows(args: argparse.Namespace) -> tuple[int, list[str]]:
    """(the engine's rows bound, lines on where it comes from): vLLM's own
    derivation when its flags give it (a --rows that differs is said: start-up
    uses vLLM's), else --rows (default 1024)."""
    derived = vllm_rows_bound(args) if args.engine == "vllm" else None
    if derived is None or derived.rows is None:
        return args.rows or 1024, derived.lines if derived else []
    if args.rows is not None and args.rows != derived.rows:
        return derived.rows, [f"--rows {args.rows} differs from the bound vLLM derives from its flags, {derived.rows}: "
                              f"start-up uses vLLM's {derived.rows}", *derived.lines]
    return derived.rows, derived.lines


def _query_dtype(args: argparse.Namespace) -> tuple[torch.dtype, list[str]]:
    """(the gathered query's dtype the query workspace is sized for, lines):
    with --kv-cache-dtype, what vLLM gives the query (a --query-dtype that it
    cannot be is said: start-up uses vLLM's); of two candidates, the one
    --query-dtype names, else the model's (the wider)."""
    if args.kv_cache_dtype is None:
        return _DTYPES[args.query_dtype or args.dtype], []
    candidates, how = vllm_query_dtype(args.kv_cache_dtype, args.dtype)
    if args.query_dtype in candidates or args.query_dtype is None:
        chosen = args.query_dtype or args.dtype
        return _DTYPES[chosen], [f"query dtype: {how}" + ("" if len(candidates) == 1 else
                                                           f"; the query workspace is sized for {chosen}")]
    return _DTYPES[candidates[-1]], [
        f"query dtype: {how}",
        f"--query-dtype {args.query_dtype} differs from what vLLM gives the query with --kv-cache-dtype "
        f"{args.kv_cache_dtype} ({' or '.join(candidates)}): start-up uses vLLM's; the query workspace is sized "
        f"for {candidates[-1]}"]


def _gate_rank(rank: int, world: int, store_path: str, backend: str, timeout_s: float, results: object) -> None:
    """One rank of the gate: a process group over a FileStore, then the
    smallest workspace (an exchange of 64 bytes) created and closed, which
    runs the same gate as every workspace an engine creates."""
    import torch.distributed as dist

    import torch_sdcp

    error = None
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        where: dict[str, object] = {"backend": "host"}
        if backend == "cuda":
            torch.cuda.set_device(rank)
            where = {"device": torch.device("cuda", rank)}
        with torch_sdcp.ExchangeWorkspace(None, 64, timeout_s=timeout_s, **where):
            pass
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, error))  # type: ignore[attr-defined]


def run_gate(world: int, backend: str = "cuda", timeout_s: float = 120.0) -> str | None:
    """The peer-memory gate on ``world`` ranks of this node (GPU ``r`` for
    rank ``r``): None when it passes, else why not (the first rank's error,
    a rank that did not finish within ``timeout_s``, or too few GPUs)."""
    if backend == "cuda":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world:
            return f"the gate needs {world} GPUs (one per rank), found {found}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdcp-gate-") as tmp:
        procs = [ctx.Process(target=_gate_rank, daemon=True,
                             args=(r, world, os.path.join(tmp, "store"), backend, timeout_s / 2, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        errors: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout_s
        while len(errors) < world and time.monotonic() < deadline:
            try:
                rank, error = results.get(timeout=0.2)
                errors[rank] = error
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    break
        for proc in procs:
            proc.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join()
    missing = [r for r in range(world) if r not in errors]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        return f"rank(s) {missing} did not finish within {timeout_s:g} s (exit codes {codes})"
    failed = [(r, e) for r, e in sorted(errors.items()) if e is not None]
    return None if not failed else f"rank {failed[0][0]}: {failed[0][1]}"


def _bytes(kind: str, params: list[int], world: int) -> int:
    from torch_sdcp.workspaces import WorkspaceKind, workspace_layout

    return int(workspace_layout(WorkspaceKind[kind], params, world).region_bytes)


def _element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def report(argv: Sequence[str]) -> tuple[int, str]:
    """(exit status, the report's text) for the command line ``argv``; the
    engine's own plugin options given there win over their variables while
    it runs, as in the engine."""
    args = _parse(list(argv))
    settings: EngineSettings = VLLM if args.engine == "vllm" else SGLANG
    given = _engine_options(args, settings)
    saved = {env: os.environ.get(env) for env in given}
    os.environ.update(given)
    try:
        return _report(args, settings)
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


def _report(args: argparse.Namespace, settings: EngineSettings) -> tuple[int, str]:
    lines = []
    try:
        settings.validate()
    except ValueError as e:
        return 1, str(e)
    mode, bad = settings.mode()
    if bad is not None:
        option = settings.options.get(settings.ENABLE)
        return 1, (f"torch_sdcp: {settings.ENABLE}{f' (or {option})' if option else ''}: expected one of "
                   f"{', '.join(MODES)} (or 1, 0), got {bad!r}; the plugin would stay off")
    lines.append(f"{settings.ENABLE}={mode}" + (f" (unrecognised value {bad!r}: off)" if bad is not None else "")
                 + f"; seams selected: {','.join(settings.seams()) or 'none'}; "
                 f"{settings.MAX_ROWS}={settings.max_rows_cap() or 'unset'}; "
                 f"{settings.TIMEOUT_S}={settings.timeout_s():g} s")
    world, heads = args.world, args.num_heads
    cap = settings.max_rows_cap()
    engine_rows, rows_lines = _engine_rows(args)
    rows = min(engine_rows, cap) if cap else engine_rows
    dtype = _DTYPES[args.dtype]
    local = heads // world
    from torch_sdcp.integrations._engine import SeamPlan

    plan = SeamPlan(settings, "dcp", world)
    sizes: dict[str, int] = {}
    found, without_plugin = engine_environment(args.engine)
    lines.extend(found)
    if args.engine == "vllm":

        from torch_sdcp.integrations import vllm

        qdtype, qdtype_lines = _query_dtype(args)
        rows_lines.extend(qdtype_lines)
        width = args.kv_lora_rank + args.qk_rope_head_dim
        topk = args.index_topk
        for seam in VLLM.all_seams:
            off = vllm.configured_off(seam, world=world, use_a2a=args.dcp_comm_backend == "a2a",
                                      use_pcp=args.prefill_context_parallel, dtype=dtype, topk=topk)
            if off is None:
                plan.decide(seam, True, "peer memory (if the node's gate passes)")
            else:
                plan.decide(seam, False, off, *vllm.enable_hint(seam, off))
        if plan.seams["combine"][0]:
            sizes["Output/LSE"] = _bytes("OUTPUT_LSE", [rows, heads, args.kv_lora_rank, _element(dtype)], world)
        if plan.seams["query"][0]:
            sizes["query"] = _bytes("QUERY", [rows, local, width, _element(qdtype)], world)
        if plan.seams["topk"][0] and topk is not None:
            sizes["top-K"] = _bytes("TOPK", [rows, topk, topk], world)
        ubatches = args.num_ubatches
    else:
        from types import SimpleNamespace

        from torch_sdcp.integrations import sglang

        parallel = SimpleNamespace(dcp_comm_backend=args.dcp_comm_backend,
                                   dcp_replicate_q_proj=args.dcp_replicate_q_proj)
        plan = sglang.seam_plan(parallel, SimpleNamespace(unique_name="dcp", world_size=world))
        for seam in SGLANG.all_seams:
            if seam in plan.seams:
                continue
            if world > 1:
                plan.decide(seam, True, "peer memory (if the node's gate passes)")
            else:
                plan.decide(seam, False, "single rank", "a DCP size of 2 or more")
        if plan.seams["combine"][0] and dtype in (torch.bfloat16, torch.float16, torch.float32):
            sizes["Output/LSE"] = _bytes("OUTPUT_LSE", [rows, heads, args.kv_lora_rank, _element(dtype)], world)
        if plan.seams["query"][0]:
            sizes["query"] = _bytes("QUERY", [rows, local, args.kv_lora_rank + args.qk_rope_head_dim,
                                              _element(dtype)], world)
        ubatches = 1
    if args.gate:
        reason = run_gate(world, args.gate_backend, args.gate_timeout_s) if world > 1 else None
        where = f"{world} GPUs" if args.gate_backend == "cuda" else f"{world} host ranks"
        if reason is None:
            lines.append(f"peer-memory gate: passed on {where}" if world > 1 else "peer-memory gate: one rank, none")
            for seam, (on, _, _) in list(plan.seams.items()):
                if on:
                    plan.decide(seam, True, f"peer memory (the gate passed on {where})")
        else:
            lines.append(f"peer-memory gate: failed on {where}: {reason}")
            for seam, (on, _, _) in list(plan.seams.items()):
                if on:
                    plan.decide(seam, False, "the peer-memory gate failed",
                                "one node whose GPUs map each other's memory")
            sizes.clear()
    if mode == "off":
        lines.append(f"the plugin is off ({settings.ENABLE} unset or off): nothing would be replaced; with "
                     f"{settings.ENABLE}=1:")
    lines.append(plan.line())
    lines.append(f"rows bound: {rows}" + (f" (the engine's {engine_rows}, capped by {settings.MAX_ROWS})"
                                          if cap and cap < engine_rows else ""))
    lines.extend(rows_lines)
    for name, n in sizes.items():
        lines.append(f"{name} workspace: {n} bytes per rank ({n / 2**20:.1f} MiB) per micro-batch")
    total = sum(sizes.values()) * ubatches
    lines.append(f"total per rank: {total} bytes ({total / 2**20:.1f} MiB), {ubatches} micro-batch(es)")
    refused = plan.refused()
    if without_plugin and mode == "require":
        lines.append(f"{settings.ENABLE}=require: the engine would run without the plugin (above); the plugin "
                     f"cannot stop a start-up it is not loaded into")
        return 1, "\n".join(lines)
    if refused and mode == "require":
        lines.append(f"{settings.ENABLE}=require: start-up would stop (seams {', '.join(refused)} cannot be taken)")
        return 1, "\n".join(lines)
    return 0, "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    status, text = report(sys.argv[1:] if argv is None else argv)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
