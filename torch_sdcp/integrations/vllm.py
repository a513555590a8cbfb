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

This module never imports vLLM at import time; see docs/VLLM.md.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ENV_ENABLE", "ENV_MAX_ROWS", "ENV_TIMEOUT_S", "SUPPORTED_VLLM_VERSIONS", "PATCHED", "VLLM_SIGNATURES",
    "register", "install", "uninstall", "is_installed", "enabled", "configure", "teardown", "workspaces",
    "prepare_output_lse", "prepare_query_gather", "prepare_topk", "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce",
    "gather_query", "gather_heads", "merge_dcp_topk_global", "mask_empty_shards",
]

ENV_ENABLE = "SDCP_VLLM"
ENV_MAX_ROWS = "SDCP_VLLM_MAX_ROWS"
ENV_TIMEOUT_S = "SDCP_VLLM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # engines skew by many seconds at start; NCCL itself waits 10 minutes

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

_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------
# Settings and logging
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


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"torch_sdcp: environment variable {name}: expected a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"torch_sdcp: environment variable {name}: expected > 0, got {raw!r}")
    return value


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


def _get_logger() -> logging.Logger:
    """vLLM's logger conventions when vLLM is importable (init_logger, under
    the ``vllm`` logger so that vLLM's handler and VLLM_LOGGING_LEVEL apply),
    the ``torch_sdcp`` logger otherwise."""
    if _state.logger is None:
        if "vllm" in sys.modules:
            try:
                from vllm.logger import init_logger

                _state.logger = init_logger("vllm." + __name__)
            except Exception:  # noqa: BLE001  (a vLLM without init_logger: plain logging)
                _state.logger = logging.getLogger("torch_sdcp")
        else:
            _state.logger = logging.getLogger("torch_sdcp")
    return _state.logger


def _log_once(level: str, reason: Any, msg: str, *args: Any) -> None:
    """Log ``msg`` once per ``reason`` (per process)."""
    with _state.lock:
        if reason in _state.logged:
            return
        _state.logged.add(reason)
    logger = _get_logger()
    once = getattr(logger, f"{level}_once", None)
    if once is not None and callable(once):
        once(msg, *args)
    else:
        getattr(logger, level)(msg, *args)


# ---------------------------------------------------------------------------
# Process state
# ---------------------------------------------------------------------------


class _Entry(NamedTuple):
    workspace: Any
    max_rows: int


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.logger: Optional[logging.Logger] = None
        self.logged: set = set()
        self.installed = False
        # (owner object, attribute name, original value, replacement) in patch order.
        self.patches: List[Tuple[Any, str, Any, Any]] = []
        self.originals: Dict[str, Callable] = {}
        self.ubatch_id: Callable[[], int] = lambda: 0
        self.dcp_group: Optional[Callable[[], Any]] = None
        self.registry: Dict[tuple, _Entry] = {}
        self.unavailable: set = set()  # keys whose group failed the peer-memory gate
        self.config = threading.local()  # the vllm_config of the MLADCPManager being built


_state = _State()


def configure(*, ubatch_id: Optional[Callable[[], int]] = None, dcp_group: Optional[Callable[[], Any]] = None,
              originals: Optional[Dict[str, Callable]] = None) -> None:
    """Set, without vLLM, what :func:`install` reads from vLLM: the current
    micro-batch id (``dbo_current_ubatch_id``), the DCP group
    (``get_dcp_group``) and the fallback functions by name
    (``cp_lse_ag_out_rs``, ``dcp_a2a_lse_reduce``, ``_merge_dcp_topk_global``).
    For engines that call the boundary functions themselves."""
    with _state.lock:
        if ubatch_id is not None:
            _state.ubatch_id = ubatch_id
        if dcp_group is not None:
            _state.dcp_group = dcp_group
        if originals:
            _state.originals.update(originals)


def workspaces() -> List[Any]:
    """Every workspace this module prepared in this process."""
    with _state.lock:
        return [e.workspace for e in _state.registry.values()]


def teardown() -> None:
    """Close every prepared workspace (collective: every rank calls it, at
    shutdown, outside capture) and forget them."""
    with _state.lock:
        entries = list(_state.registry.values())
        _state.registry.clear()
        _state.unavailable.clear()
    seen = set()
    for e in entries:
        if id(e.workspace) not in seen:
            seen.add(id(e.workspace))
            e.workspace.close()


# ---------------------------------------------------------------------------
# Groups, devices and workspace keys
# ---------------------------------------------------------------------------


def _group_parts(group: Any) -> Tuple[Any, Any, int, int]:
    """(key, bootstrap process group, world size, rank) of a vLLM
    GroupCoordinator (its ``cpu_group``, gloo) or of a process group."""
    if isinstance(group, dist.ProcessGroup) or group is None:
        pg = group
        return ("pg", id(pg)), pg, dist.get_world_size(pg), dist.get_rank(pg)
    cpu = getattr(group, "cpu_group", None)
    if cpu is None:
        raise TypeError(f"torch_sdcp: argument 'cp_group': expected a vLLM GroupCoordinator (with a cpu_group) "
                        f"or a ProcessGroup, got {type(group).__name__}")
    name = getattr(group, "unique_name", None)
    return ("coordinator", name if name is not None else id(group)), cpu, int(group.world_size), \
        int(group.rank_in_group)


def _device_key(device: Any) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def _ubatch() -> int:
    return int(_state.ubatch_id())


def _lookup(kind: str, group_key: tuple, geometry: tuple, device: Any) -> Optional[_Entry]:
    ubatch = _ubatch()
    entry = _state.registry.get((kind, group_key, geometry, _device_key(device), ubatch))
    if entry is None and ubatch > 0 and (kind, group_key, geometry, _device_key(device), 0) in _state.registry:
        raise RuntimeError(f"torch_sdcp: micro-batch {ubatch} has no {kind} workspace: the workspaces were "
                           "prepared for fewer micro-batches (num_ubatches) than the engine runs")
    return entry


def _prepare(kind: str, group: Any, geometry: tuple, device: Any, max_rows: int, num_ubatches: int,
             make: Callable[[Any, int, torch.device, dict], Any]) -> bool:
    """Create (collectively, every rank of ``group``) one workspace per
    micro-batch, or keep the ones already there. False when the group cannot
    use peer memory (then nothing is registered)."""
    if not isinstance(num_ubatches, int) or num_ubatches < 1:
        raise ValueError(f"torch_sdcp: argument 'num_ubatches': expected a positive int, got {num_ubatches!r}")
    gkey, pg, world, rank = _group_parts(group)
    dkey = _device_key(device)
    dev = torch.device(dkey)
    options = dict(backend="cuda" if dev.type == "cuda" else "host", device=dev,
                   timeout_s=_env_float(ENV_TIMEOUT_S, DEFAULT_TIMEOUT_S), fallback=True)
    with _state.lock:
        if (kind, gkey, geometry, dkey) in _state.unavailable:
            return False
        for ub in range(num_ubatches):
            key = (kind, gkey, geometry, dkey, ub)
            entry = _state.registry.get(key)
            if entry is not None:
                if entry.max_rows != max_rows:
                    _log_once("warning", ("bound", key, max_rows), "torch_sdcp: the %s workspace of micro-batch %d "
                              "keeps its rows bound %d (asked for %d): it may already be captured", kind, ub,
                              entry.max_rows, max_rows)
                continue
            ws = make(pg, max_rows, dev, options)
            if not ws.peer:
                # The gate is collective: every rank got here and agrees.
                ws.close()
                _state.unavailable.add((kind, gkey, geometry, dkey))
                _log_once("warning", ("unavailable", kind), "torch_sdcp: peer memory is unavailable for the DCP "
                          "group (rank %d of %d, %s); the %s boundary keeps vLLM's own path", rank, world, dkey,
                          kind)
                return False
            _state.registry[key] = _Entry(ws, max_rows)
    return True


def prepare_output_lse(group: Any, *, max_rows: int, total_heads: int, head_dim: int, dtype: torch.dtype,
                       device: Any, num_ubatches: int = 1) -> bool:
    """Prepare the Output/LSE workspaces (one per micro-batch) for partial
    outputs ``[T <= max_rows, total_heads, head_dim]`` of ``dtype``."""
    from torch_sdcp.workspaces import OutputLSEWorkspace

    return _prepare("output_lse", group, (total_heads, head_dim, dtype), device, max_rows, num_ubatches,
                    lambda pg, rows, dev, opts: OutputLSEWorkspace(pg, rows, total_heads, head_dim, dtype=dtype,
                                                                   **opts))


def _query_row_bytes(local_heads: int, width: int, dtype: torch.dtype) -> int:
    return local_heads * width * torch.empty((), dtype=dtype).element_size()


def _query_direct(width: int, dtype: torch.dtype) -> bool:
    """Whether the query gather runs on a QueryWorkspace (data-as-flag, final
    layout, 1x bytes): a dtype whose all-ones element is NaN (vLLM passes
    float8_e4m3fn or the model dtype) and heads of whole 16-byte vectors.
    Anything else (float8_e4m3fnuz, raw bytes, odd widths) keeps the tagged
    ExchangeWorkspace, which moves any bytes."""
    from torch_sdcp import ops

    return dtype in ops.QUERY_GATHER_DTYPES and width * torch.empty((), dtype=dtype).element_size() % 16 == 0


def prepare_query_gather(group: Any, *, max_rows: int, local_heads: int, width: int, dtype: torch.dtype,
                         device: Any, num_ubatches: int = 1) -> bool:
    """Prepare the query-gather workspaces (one per micro-batch) for queries
    ``[T <= max_rows, local_heads, width]`` of ``dtype``: ``QueryWorkspace``
    (gather-only, no RoPE part), or ``ExchangeWorkspace`` where the dtype or
    width rules it out (see :func:`gather_heads`)."""
    from torch_sdcp.workspaces import ExchangeWorkspace, QueryWorkspace

    if _query_direct(width, dtype):
        def make(pg, rows, dev, opts):
            return QueryWorkspace(pg, rows, local_heads, nope_dim=width, rope_dim=0, dtype=dtype, **opts)
    else:
        nbytes = max_rows * _query_row_bytes(local_heads, width, dtype)

        def make(pg, rows, dev, opts):
            return ExchangeWorkspace(pg, nbytes, **opts)
    return _prepare("query", group, (local_heads, width, dtype), device, max_rows, num_ubatches, make)


def prepare_topk(group: Any, *, max_rows: int, k: int, candidates_per_rank: Optional[int] = None, device: Any,
                 num_ubatches: int = 1) -> bool:
    """Prepare the top-K workspaces (one per micro-batch) for ``[T <= max_rows,
    candidates_per_rank]`` local candidates (default ``k``) selecting ``k``."""
    from torch_sdcp.workspaces import TopKWorkspace

    c = k if candidates_per_rank is None else candidates_per_rank
    return _prepare("topk", group, (k, c), device, max_rows, num_ubatches,
                    lambda pg, rows, dev, opts: TopKWorkspace(pg, rows, k, candidates_per_rank=c, **opts))


# ---------------------------------------------------------------------------
# Output/LSE
# ---------------------------------------------------------------------------


def _check_mask_args(seq_lens: Optional[Tensor], query_start_loc: Optional[Tensor]) -> bool:
    """True when masking is asked for. Shapes only: no device work."""
    if seq_lens is None and query_start_loc is None:
        return False
    if seq_lens is None or query_start_loc is None:
        raise ValueError("torch_sdcp: arguments 'seq_lens' and 'query_start_loc': expected both or neither, got "
                         f"seq_lens={'None' if seq_lens is None else 'a tensor'}, "
                         f"query_start_loc={'None' if query_start_loc is None else 'a tensor'}")
    if seq_lens.dim() != 1 or query_start_loc.dim() != 1 or query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError("torch_sdcp: argument 'query_start_loc': expected a 1-D tensor of len(seq_lens) + 1 "
                         f"boundaries for a 1-D seq_lens, got shapes {list(query_start_loc.shape)} and "
                         f"{list(seq_lens.shape)}")
    return True


def mask_empty_shards(lse: Tensor, seq_lens: Optional[Tensor], query_start_loc: Optional[Tensor]) -> Tensor:
    """``lse [T, H]`` with -inf in every row that must get no weight: rows at
    or past ``query_start_loc[-1]`` (CUDA-graph padding) and rows of requests
    whose local ``seq_len`` is 0 (an empty KV shard). Out of place; no host
    synchronisation and no data-dependent shape, so it can be captured.
    Without ``seq_lens``/``query_start_loc`` returns ``lse`` itself."""
    if not _check_mask_args(seq_lens, query_start_loc):
        return lse
    rows = lse.shape[0]
    if seq_lens.numel() == 0:  # no local request at all (warm-up): every row is empty
        return torch.full_like(lse, -math.inf)
    qsl = query_start_loc.to(lse.device)
    row = torch.arange(rows, device=lse.device, dtype=qsl.dtype)
    # Request of each row: the number of request ends at or before it.
    request = torch.bucketize(row, qsl[1:], right=True).clamp_max(seq_lens.numel() - 1)
    empty = (row >= qsl[-1]) | (seq_lens.to(lse.device).index_select(0, request) == 0)
    return lse.masked_fill(empty.unsqueeze(-1), -math.inf)


def _squeeze_inputs(out: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    if out.dim() == 4 and out.shape[1] == 1:  # [B, 1, H, D]
        out = out.squeeze(1)
    if lse.dim() == 3 and lse.shape[-1] == 1:  # [B, H, 1]
        lse = lse.squeeze(-1)
    elif lse.dim() == 3 and lse.shape[1] == 1:  # [B, 1, H]
        lse = lse.squeeze(1)
    if out.dim() != 3:
        raise ValueError(f"torch_sdcp: argument 'cp_attn_out': expected [B, H, D] or [B, 1, H, D], got shape "
                         f"{list(out.shape)}")
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"torch_sdcp: argument 'cp_attn_lse': expected shape {list(out.shape[:2])} (or with a "
                         f"1-sized extra dimension), got shape {list(lse.shape)}")
    return out, lse


def _collective_combine(cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e, seq_lens,
                        query_start_loc):
    """The fallback when vLLM's own function is not known (the plugin used
    without vLLM): the same masking, then torch_sdcp's collective path."""
    from torch_sdcp import collective

    out, lse = _squeeze_inputs(cp_attn_out, cp_attn_lse)
    lse = mask_empty_shards(lse.float(), seq_lens, query_start_loc)
    pg = getattr(cp_group, "device_group", cp_group)
    return collective.lse_all_gather_correct_reduce_scatter(out, lse, base2=not is_lse_base_on_e,
                                                            return_lse=return_lse, group=pg)


def _combine(fallback_name: str, cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any,
             return_lse: bool, is_lse_base_on_e: bool, seq_lens: Optional[Tensor],
             query_start_loc: Optional[Tensor]):
    args = (cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    fallback = _state.originals.get(fallback_name, _collective_combine)
    gkey, _, world, _ = _group_parts(cp_group)
    if world == 1:
        return fallback(*args)
    _check_mask_args(seq_lens, query_start_loc)
    out, lse = _squeeze_inputs(cp_attn_out, cp_attn_lse)
    rows, heads, dim = out.shape
    entry = _lookup("output_lse", gkey, (heads, dim, out.dtype), out.device)
    if entry is None:
        _log_once("warning", ("no-workspace", "output_lse", heads, dim, out.dtype), "torch_sdcp: no Output/LSE "
                  "workspace for %d heads x %d of %s (not prepared, or peer memory unavailable); %s takes vLLM's "
                  "own path", heads, dim, out.dtype, fallback_name)
        return fallback(*args)
    if rows > entry.max_rows:
        _log_once("warning", ("rows", "output_lse"), "torch_sdcp: %d rows exceed the Output/LSE bound of %d; "
                  "such calls take vLLM's own %s", rows, entry.max_rows, fallback_name)
        return fallback(*args)
    lse = mask_empty_shards(lse.float(), seq_lens, query_start_loc)
    return entry.workspace.combine(out.contiguous(), lse.contiguous(), lse_base="e" if is_lse_base_on_e else "2",
                                   return_lse=return_lse)


def cp_lse_ag_out_rs(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                     return_lse: bool = False, is_lse_base_on_e: bool = True, seq_lens: Optional[Tensor] = None,
                     query_start_loc: Optional[Tensor] = None):
    """vLLM's ``cp_lse_ag_out_rs`` (``--dcp-comm-backend ag_rs``) on peer
    memory. ``cp_attn_out [B, H, D]`` (or ``[B, 1, H, D]``) and
    ``cp_attn_lse [B, H]`` of this rank's KV shard -> this rank's heads
    ``[B, H/N, D]`` (and their global LSE ``[B, H/N]`` fp32 with
    ``return_lse``). With ``seq_lens``/``query_start_loc``, rows of empty
    shards and padding rows get LSE -inf first (no weight). ``ctx`` (vLLM's
    Triton kernel cache) is accepted and ignored. Rows above the prepared
    bound, or no prepared workspace, run vLLM's own function."""
    return _combine("cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e,
                    seq_lens, query_start_loc)


def dcp_a2a_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                       return_lse: bool = False, is_lse_base_on_e: bool = True, seq_lens: Optional[Tensor] = None,
                       query_start_loc: Optional[Tensor] = None):
    """vLLM's ``dcp_a2a_lse_reduce`` (``--dcp-comm-backend a2a``) on peer
    memory: the same inputs, masking and result as :func:`cp_lse_ag_out_rs`
    (the two backends differ in how vLLM moves data, not in what they
    compute). Falls back to vLLM's own ``dcp_a2a_lse_reduce``."""
    return _combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse, is_lse_base_on_e,
                    seq_lens, query_start_loc)


# ---------------------------------------------------------------------------
# Query
# ---------------------------------------------------------------------------


def _storage(rows: int, heads: int, width: int, padded_num_heads: Optional[int], like: Tensor) -> Tensor:
    """A packed ``[rows, heads, width]`` tensor whose storage holds
    ``padded_num_heads`` heads per row (vLLM's reserve_query_head_storage:
    fixed-head kernels may read past the gathered heads)."""
    if padded_num_heads is None:
        return like.new_empty((rows, heads, width))
    if padded_num_heads < heads:
        raise ValueError(f"torch_sdcp: argument 'padded_num_heads': expected at least the {heads} gathered heads, "
                         f"got {padded_num_heads}")
    flat = like.new_empty((rows * padded_num_heads * width,))
    return flat[: rows * heads * width].view(rows, heads, width)


def gather_heads(workspace: Any, query: Tensor, padded_num_heads: Optional[int] = None) -> Tensor:
    """``[T, H_loc, W]`` on every rank -> ``[T, N*H_loc, W]``, head
    ``src*H_loc + h``: ``all_gather(query, dim=1)``, with ``padded_num_heads``
    heads of storage per row when asked.

    On a ``QueryWorkspace`` (the dtypes whose all-ones element is NaN): one
    data-as-flag kernel stores each rank's heads straight into every peer's
    buffer and its own heads into the result; every non-NaN value is
    bit-exact, and an aligned 4-byte word of all-ones bytes (a NaN) arrives as
    the canonical NaN word. On an ``ExchangeWorkspace`` (any other dtype): a
    tagged peer all-gather of the raw bytes (``[N, T, H_loc, W]``) and one
    layout copy, bit-exact for every byte."""
    from torch_sdcp.workspaces import QueryWorkspace

    rows, local_heads, width = query.shape
    out = _storage(rows, workspace.world_size * local_heads, width, padded_num_heads, query)
    if isinstance(workspace, QueryWorkspace):
        return workspace.all_gather_heads(query.contiguous(), out=out)
    raw = query.contiguous().view(torch.uint8)  # bytes: float8 and bf16 alike
    stacked = workspace.all_gather(raw)  # [N, T, H_loc, W * element size]
    out.view(torch.uint8).view(rows, stacked.shape[0], local_heads, -1).copy_(stacked.permute(1, 0, 2, 3))
    return out


def _collective_gather_query(query: Tensor, cp_group: Any, padded_num_heads: Optional[int]) -> Tensor:
    pg = getattr(cp_group, "device_group", cp_group)
    n = dist.get_world_size(pg)
    raw = query.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(parts, raw, group=pg)
    rows, local_heads, width = query.shape
    out = _storage(rows, n * local_heads, width, padded_num_heads, query)
    out.view(torch.uint8).view(rows, n, local_heads, -1).copy_(torch.stack(parts, dim=1))
    return out


def gather_query(query: Tensor, cp_group: Any, padded_num_heads: Optional[int] = None,
                 fallback: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """The MLA DCP query gather on heads: an already-roped (and possibly
    FP8-quantised) ``query [T, H_loc, W]`` -> ``[T, N*H_loc, W]``, equal to
    ``cp_group.all_gather(query, dim=1)`` with every non-NaN value bit-exact
    (see :func:`gather_heads`); with
    ``padded_num_heads`` the result's storage has that many heads per row.
    Rows above the prepared bound, or no prepared workspace, call
    ``fallback(query)`` (the manager's own ``_gather_query`` when patched
    into vLLM) or torch.distributed's all_gather."""
    if query.dim() != 3:
        raise ValueError(f"torch_sdcp: argument 'query': expected [T, H_loc, W], got shape {list(query.shape)}")

    def slow():
        if fallback is not None:
            return fallback(query)
        return _collective_gather_query(query, cp_group, padded_num_heads)

    gkey, _, world, _ = _group_parts(cp_group)
    rows, local_heads, width = query.shape
    entry = _lookup("query", gkey, (local_heads, width, query.dtype), query.device)
    if entry is None:
        _log_once("warning", ("no-workspace", "query", local_heads, width, query.dtype), "torch_sdcp: no query "
                  "workspace for %d heads x %d of %s (not prepared, or peer memory unavailable); the query gather "
                  "takes vLLM's own path", local_heads, width, query.dtype)
        return slow()
    if rows > entry.max_rows:
        _log_once("warning", ("rows", "query"), "torch_sdcp: %d rows exceed the query-gather bound of %d; such "
                  "calls take vLLM's own all_gather", rows, entry.max_rows)
        return slow()
    if rows == 0:
        return _storage(0, world * local_heads, width, padded_num_heads, query)
    return gather_heads(entry.workspace, query, padded_num_heads)


# ---------------------------------------------------------------------------
# Top-K (sparse attention indexer)
# ---------------------------------------------------------------------------


def _local_candidates(logits: Tensor, topk_indices: Tensor, dcp_rank: int, dcp_world_size: int,
                      cp_interleave: int, row_starts: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(scores fp32 [T, C], global ids int32 [T, C], -1 = none) of this rank's
    local top-K positions: the score at ``row_start + position`` (column
    clamped to the row as vLLM does), the global token through the KV
    interleave (``torch_sdcp.reference.token_global_index``)."""
    from torch_sdcp import reference

    rows = topk_indices.shape[0]
    local = topk_indices.long()
    valid = local >= 0
    pos = local.clamp_min(0)
    if logits.shape[1] == 0:
        scores = torch.full(local.shape, -math.inf, dtype=torch.float32, device=local.device)
    else:
        col = pos if row_starts is None else pos + row_starts[:rows].to(local.device).long().unsqueeze(1)
        col = col.clamp(0, logits.shape[1] - 1)
        scores = logits[:rows].gather(1, col).float().masked_fill(~valid, -math.inf)
    ids = reference.token_global_index(pos, dcp_rank, dcp_world_size, cp_interleave)
    ids = torch.where(valid, ids, -1).to(torch.int32)
    return scores.contiguous(), ids.contiguous()


def _collective_merge(logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave,
                      row_starts=None) -> None:
    from torch_sdcp import collective, reference

    if _state.dcp_group is None:
        raise RuntimeError("torch_sdcp: merge_dcp_topk_global has no DCP group: install() the plugin in vLLM, or "
                           "configure(dcp_group=...) first")
    group = _state.dcp_group()
    scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    pg = getattr(group, "device_group", group)
    topk_indices.copy_(collective.topk_all_gather_merge(scores, ids, topk_tokens, group=pg))


def merge_dcp_topk_global(logits: Tensor, topk_indices: Tensor, topk_tokens: int, dcp_rank: int,
                          dcp_world_size: int, cp_interleave: int, row_starts: Optional[Tensor] = None) -> None:
    """vLLM's ``_merge_dcp_topk_global`` on peer memory: ``logits`` fp32 rows
    (``row_starts`` offsets, optional), ``topk_indices [T, C]`` int32 LOCAL
    positions in this rank's KV shard (-1 = none) -> overwritten IN PLACE with
    the global top-``topk_tokens`` token ids of the DCP group (-1 padded),
    the same set and order on every rank.

    Selection: the same set as vLLM's merge wherever both define it (see
    docs/VLLM.md for the cases that differ: -0.0 vs +0.0, NaN scores, ids at
    or above 2^24); order: score descending, lower global id first on ties
    (vLLM's selector leaves the order within the set unspecified)."""
    if dcp_world_size <= 1:
        return
    fallback = _state.originals.get("_merge_dcp_topk_global", _collective_merge)
    args = (logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    if _state.dcp_group is None:
        return fallback(*args)
    gkey, _, world, rank = _group_parts(_state.dcp_group())
    if (world, rank) != (dcp_world_size, dcp_rank):
        raise ValueError(f"torch_sdcp: arguments 'dcp_rank'/'dcp_world_size': expected the DCP group's "
                         f"{rank}/{world}, got {dcp_rank}/{dcp_world_size}")
    if topk_indices.dim() != 2 or topk_indices.dtype != torch.int32:
        raise ValueError(f"torch_sdcp: argument 'topk_indices': expected a 2-D int32 tensor, got shape "
                         f"{list(topk_indices.shape)} of {topk_indices.dtype}")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"torch_sdcp: argument 'logits': expected a 2-D float32 tensor, got shape "
                         f"{list(logits.shape)} of {logits.dtype}")
    rows, c = topk_indices.shape
    entry = _lookup("topk", gkey, (topk_tokens, c), topk_indices.device)
    if entry is None:
        _log_once("warning", ("no-workspace", "topk", topk_tokens, c), "torch_sdcp: no top-K workspace for k=%d "
                  "over %d local candidates (not prepared, or peer memory unavailable); the top-K merge takes "
                  "vLLM's own path", topk_tokens, c)
        return fallback(*args)
    if rows > entry.max_rows:
        _log_once("warning", ("rows", "topk"), "torch_sdcp: %d rows exceed the top-K bound of %d; such calls "
                  "(prefill chunks) take vLLM's own _merge_dcp_topk_global", rows, entry.max_rows)
        return fallback(*args)
    if rows == 0:
        return None
    scores, ids = _local_candidates(logits, topk_indices, dcp_rank, dcp_world_size, cp_interleave, row_starts)
    topk_indices.copy_(entry.workspace.merge(scores, ids))
    return None


# ---------------------------------------------------------------------------
# The patches
# ---------------------------------------------------------------------------


def _topk_geometry(vllm_config: Any) -> Optional[int]:
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
    original = _state.originals["MLADCPManager.__init__"]
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
        if prepare_topk(self.group, max_rows=bound, k=k, device=self.device, num_ubatches=self.num_ubatches):
            _log_once("info", ("installed", "topk"), "torch_sdcp: sparse-indexer top-K merge on peer memory "
                      "(k=%d, %d rows, %d micro-batch(es))", k, bound, self.num_ubatches)


def _current_config() -> Any:
    stack = getattr(_state.config, "stack", None)
    return stack[-1] if stack else None


def _manager_init_combine(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp):
    """Replaces MLADCPManager._init_combine: the same partial vLLM builds,
    over this module's functions. PCP, a single rank, an unsupported dtype or
    no peer memory keep vLLM's own choice."""
    original = _state.originals["MLADCPManager._init_combine"]
    world = self.group.world_size
    if use_pcp or world <= 1 or dtype not in _OUTPUT_DTYPES:
        return original(self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp)
    bound = _row_bound(self.max_num_tokens)
    if not prepare_output_lse(self.group, max_rows=bound, total_heads=num_heads * world, head_dim=head_dim,
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
    original = _state.originals["MLADCPManager._init_query_gather"]
    if self.group.world_size <= 1 or _q_replicated(_current_config()):
        return original(self, num_heads, head_dim, dtype)
    bound = _row_bound(self.max_num_tokens)
    if not prepare_query_gather(self.group, max_rows=bound, local_heads=num_heads, width=head_dim, dtype=dtype,
                                device=self.device, num_ubatches=self.num_ubatches):
        return original(self, num_heads, head_dim, dtype)
    _log_once("info", ("installed", "query"), "torch_sdcp: MLA DCP query gather on peer memory (%d x %d heads "
              "x %d of %s, %d rows, %d micro-batch(es))", self.group.world_size, num_heads, head_dim, dtype, bound,
              self.num_ubatches)
    return functools.partial(gather_query, cp_group=self.group, padded_num_heads=self.padded_num_heads,
                             fallback=self._gather_query)


def _resolve(module: Any, path: str) -> Tuple[Any, str, Any]:
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
        _state.originals.update(originals)
        _state.ubatch_id = ubatch_id
        _state.dcp_group = dcp_group
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
