"""What the vLLM plugin decides from its settings and vLLM's configuration
alone, before any peer memory is tried: the versions it patches, why a seam
stays vLLM's, the workspaces' rows bound, the model's top-K, the layer index
a manager's calls are tagged with, and what turns a seam on. No state; read
by the manager's hooks (:mod:`torch_sdcp.integrations.vllm`) and by
``python -m torch_sdcp.plugin_check``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch_sdcp._checks import CALL_TAG_LIMIT
from torch_sdcp.integrations._boundaries import OUTPUT_DTYPES
from torch_sdcp.integrations.vllm_versions import (
    SUPPORTED_VLLM_SERIES,
    SUPPORTED_VLLM_VERSIONS,
    series_of,
    supported_version,
)
from torch_sdcp_settings import VLLM

__all__ = ["ENV_DIRECT", "SUPPORTED_VLLM_SERIES", "SUPPORTED_VLLM_VERSIONS", "configured_off",
           "enable_hint", "layer_index", "layer_tag", "row_bound", "series_of", "supported_version", "topk_geometry",
           "v_head_dim"]

# vLLM's own switches of its direct (symmetric-memory) paths: set by the user, the seam stays vLLM's.
ENV_DIRECT = {"combine": "VLLM_USE_DIRECT_DCP_A2A", "query": "VLLM_USE_DIRECT_DCP_Q_GATHER"}


def row_bound(engine_bound: int) -> int:
    """The rows bound of the workspaces: vLLM's DCP bound, capped by
    ``SDCP_VLLM_MAX_ROWS`` when set."""
    cap = VLLM.max_rows_cap()
    bound = int(engine_bound) if cap is None else min(int(engine_bound), cap)
    if bound < 1:
        raise ValueError(f"torch_sdcp: the DCP rows bound must be positive, got {bound}")
    return bound


def configured_off(seam: str, *, world: int, use_a2a: bool = True, use_pcp: bool = False,
                   dtype: Any = None, topk: int | None = 1) -> str | None:
    """Why ``seam`` stays vLLM's by configuration alone (settings, vLLM's
    switches, PCP, one rank, the output dtype, no sparse indexer), or None:
    what the manager's hooks decide before peer memory is tried, and what
    ``python -m torch_sdcp.plugin_check`` reports."""
    off = _seam_off(seam, use_a2a)
    if off is not None:
        return off
    if seam == "topk" and topk is None:
        return "no sparse indexer"
    if use_pcp and seam != "topk":
        return "PCP" if seam == "combine" else "no query gather (PCP)"
    if world <= 1:
        return "single rank"
    if seam == "combine" and dtype is not None and dtype not in OUTPUT_DTYPES:
        return f"dtype {dtype}"
    return None


def _seam_off(seam: str, use_a2a: bool = True) -> str | None:
    """Why ``seam`` stays vLLM's by setting, or None. vLLM's direct-path
    switch of the combine matters with the a2a backend only."""
    if seam not in VLLM.seams():
        return f"not in {VLLM.SEAMS}"
    direct = ENV_DIRECT.get(seam)
    if direct is not None and os.environ.get(direct, "").strip() and (seam != "combine" or use_a2a):
        return f"{direct}={os.environ[direct]} set by the user"
    return None


def topk_geometry(vllm_config: Any) -> int | None:
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


def v_head_dim(vllm_config: Any) -> int | None:
    """The model's V head dimension (``v_head_dim``: the width of the values
    after the up-projection, 128 for DeepSeek-V3 and GLM-5), or None."""
    try:
        v = vllm_config.model_config.hf_text_config.v_head_dim
    except AttributeError:
        return None
    return v if isinstance(v, int) and v > 0 else None


def layer_index(name: object) -> int | None:
    """The layer index in a vLLM layer name (``model.layers.3.self_attn.attn``
    -> 3): its one integer part, as vLLM's ``extract_layer_index`` reads it;
    None for anything else (no integer part, or several)."""
    if not isinstance(name, str):
        return None
    found = [int(part) for part in name.split(".") if part.isdigit()]
    return found[0] if len(found) == 1 else None


def layer_tag(name: object, note: Callable[[str, int | None], None] | None = None) -> int | None:
    """The call tag of a vLLM layer name: its layer index (:func:`layer_index`)
    when it has one integer part. With several (LongCat-Flash names its two
    attention layers of a decoder layer ``model.layers.3.self_attn.0`` and
    ``...self_attn.1``), the parts in base 1000 (3000, 3001), so that the tag
    still differs per layer, and ``note(name, tag)`` is called; None without
    an integer part or with one of 1000 or more."""
    index = layer_index(name)
    if index is not None or not isinstance(name, str):
        return index
    parts = [int(part) for part in name.split(".") if part.isdigit()]
    if not parts:
        return None
    tag = 0
    for part in parts:
        tag = tag * 1000 + part
    result = tag if max(parts) < 1000 and tag < CALL_TAG_LIMIT else None
    if note is not None:
        note(name, result)
    return result


def enable_hint(seam: str, why: str) -> tuple[str, bool]:
    """(what turns ``seam`` on, whether it applies to the model at all) for a seam off for ``why``."""
    if why.startswith("not in "):
        return f"add {seam} to {VLLM.SEAMS}", True
    if why.endswith("set by the user"):
        return f"unset {why.split('=')[0]}", True
    if why == "no sparse indexer":
        return "", False  # a model without DSA: nothing to take
    if "PCP" in why:
        return "run without prefill context parallelism", seam != "query"
    if why == "single rank":
        return "--decode-context-parallel-size 2 or more", True
    if why == "peer memory unavailable":
        return "a DCP group inside one node whose GPUs map each other's memory", True
    return "", True
