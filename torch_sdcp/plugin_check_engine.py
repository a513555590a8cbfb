"""vLLM's own flags for ``python -m torch_sdcp.plugin_check``: the DCP rows
bound and the gathered query's dtype, derived from them as vLLM derives
them (``get_dcp_workspace_max_num_tokens`` and the MLA layer's
``query_dtype``), so that the check can say where its ``--rows`` or
``--query-dtype`` differs from what start-up will use.

The bound, as vLLM 0.34.0 computes it::

    min(max_num_batched_tokens, max(max_num_seqs * tokens_per_request, max_cudagraph_capture_size))

with ``tokens_per_request = 1 + num_speculative_tokens``, one more for a
plain draft model (``method`` ``draft_model``: its input keeps one unsliced
token), and ``max_cudagraph_capture_size`` the largest CUDA-graph size vLLM
captures (0 with ``--enforce-eager``). vLLM 0.33.0 adds no slot for a draft
model, but ``num_speculative_tokens`` slots for parallel drafting on its V1
model runner. Imports only the package's argparse types.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from torch_sdcp.cli_types import non_negative_int, positive_int

__all__ = ["KV_CACHE_DTYPES", "VLLM_FLAGS", "add_vllm_flags", "capture_size", "check_vllm_flags",
           "vllm_query_dtype", "vllm_rows_bound"]

#: vLLM's --kv-cache-dtype values (its CacheDType, the same in 0.33.0 and 0.34.0).
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
                   "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
#: The values whose cache is not quantized (vLLM's is_quantized_kv_cache is false for them).
_PLAIN_KV = ("auto", "float16", "bfloat16")

#: The vLLM flags read here, by their argparse dest.
VLLM_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
              "speculative_config": "--speculative-config", "spec_method": "--spec-method",
              "spec_tokens": "--spec-tokens", "max_cudagraph_capture_size": "--max-cudagraph-capture-size",
              "enforce_eager": "--enforce-eager", "kv_cache_dtype": "--kv-cache-dtype"}


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's own spellings of the flags the bound and the query dtype come from."""
    g = p.add_argument_group("vLLM's flags (the rows bound and the query dtype derived from them, as vLLM does)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--speculative-config", "-sc", type=_json_object, default=None,
                   help="JSON; its num_speculative_tokens and method are read")
    g.add_argument("--spec-method", default=None)
    g.add_argument("--spec-tokens", type=non_negative_int, default=None, help="num_speculative_tokens")
    g.add_argument("--max-cudagraph-capture-size", type=positive_int, default=None)
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)


def check_vllm_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) for vLLM's flags: given with another engine, a
    key given twice (vLLM refuses --spec-tokens with the JSON's
    num_speculative_tokens too), a num_speculative_tokens that is not an
    integer >= 0."""
    given = [flag for dest, flag in VLLM_FLAGS.items() if getattr(args, dest) is not None]
    if given and args.engine != "vllm":
        p.error(f"argument {', '.join(given)}: vLLM's option, expected with --engine vllm, got --engine {args.engine}")
    spec = args.speculative_config or {}
    for flag, key in (("--spec-method", "method"), ("--spec-tokens", "num_speculative_tokens")):
        if getattr(args, flag[2:].replace("-", "_")) is not None and key in spec:
            p.error(f"argument {flag}: expected either it or --speculative-config's {key!r}, got both (vLLM refuses "
                    f"the two together)")
    tokens = spec.get("num_speculative_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        p.error(f"argument --speculative-config: expected num_speculative_tokens an integer >= 0, got {tokens!r}")


def _grid_max(limit: int, max_num_batched_tokens: int) -> int:
    """The largest of vLLM's default capture sizes up to ``limit``: 1, 2, 4,
    multiples of 8 below 256, multiples of 16 from 256, and
    max_num_batched_tokens when it fits."""
    sizes = [i for i in (1, 2, 4) if i <= limit] + list(range(8, min(limit + 1, 256), 8))
    sizes += list(range(256, limit + 1, 16))
    if max_num_batched_tokens <= limit:
        sizes.append(max_num_batched_tokens)
    return max(sizes, default=0)


def capture_size(given: int | None, max_num_seqs: int, max_num_batched_tokens: int, query_len: int,
                 eager: bool) -> int:
    """vLLM's resolved max_cudagraph_capture_size (the default performance
    mode and CUDA-graph mode): 0 when eager; a given size truncated to the
    largest size captured; unset, from vLLM's ceiling on a GPU other than
    SM 10.x, min(2 x max_num_seqs x query_len, 512), and the uniform decode
    batches (n requests x query_len) that fit under it."""
    if eager:
        return 0
    if given is not None:
        return _grid_max(min(given, max_num_batched_tokens), max_num_batched_tokens)
    ceiling = min(max_num_seqs * query_len * 2, 512)
    largest = _grid_max(min(ceiling, max_num_batched_tokens), max_num_batched_tokens)
    if query_len > 1:
        reqs = min(max_num_seqs, 512)
        counts = {n for n in (1, 2, 4) if n <= reqs} | set(range(8, min(reqs + 1, 256), 8))
        counts |= set(range(256, reqs + 1, 16)) | {reqs}
        uniform = [n * query_len for n in counts if n * query_len <= min(ceiling, max_num_batched_tokens)]
    else:
        uniform = [max_num_seqs] if max_num_seqs <= min(ceiling, max_num_batched_tokens) else []
    return max([largest, *uniform])


@dataclass
class DerivedRows:
    """The bound vLLM derives (None: not derivable from the flags given) and the lines that say how."""

    rows: int | None
    lines: list[str]


def vllm_rows_bound(args: argparse.Namespace) -> DerivedRows | None:
    """The rows bound from vLLM's flags, or None when none of them is given."""
    if all(getattr(args, d) is None for d in VLLM_FLAGS if d != "kv_cache_dtype"):
        return None
    seqs, tokens = args.max_num_seqs, args.max_num_batched_tokens
    if seqs is None or tokens is None:
        missing = " and ".join(f for f, v in (("--max-num-seqs", seqs), ("--max-num-batched-tokens", tokens))
                               if v is None)
        return DerivedRows(None, [f"rows bound not derived from vLLM's flags: {missing} not given (vLLM's "
                                  f"defaults depend on the GPU and the entry point); the bound below is --rows"])
    spec = dict(args.speculative_config or {})
    if args.spec_method is not None:
        spec["method"] = args.spec_method
    if args.spec_tokens is not None:
        spec["num_speculative_tokens"] = args.spec_tokens
    if spec and spec.get("num_speculative_tokens") is None:
        return DerivedRows(None, ["rows bound not derived from vLLM's flags: the speculative config gives no "
                                  "num_speculative_tokens (the draft checkpoint's then decides); the bound below "
                                  "is --rows"])
    k = int(spec.get("num_speculative_tokens") or 0)  # type: ignore[call-overload]
    method = spec.get("method")
    extra = 1 if method == "draft_model" else 0  # vLLM 0.34.0: max_num_new_slots_for_drafting
    per_request = 1 + k + extra
    graphs = capture_size(args.max_cudagraph_capture_size, seqs, tokens, 1 + k, bool(args.enforce_eager))
    rows = min(tokens, max(seqs * per_request, graphs))
    how = (f"derived from vLLM's flags as vLLM 0.34.0 derives it: min(--max-num-batched-tokens {tokens}, "
           f"max(--max-num-seqs {seqs} x {per_request} tokens per request, CUDA-graph capture size {graphs}))")
    notes = []
    if extra:
        notes.append("a draft model (method draft_model) adds one token per request")
    elif k and method is None:
        notes.append("no speculative method given: the draft checkpoint decides it; a plain draft model would add "
                     "one token per request")
    if args.enforce_eager:
        notes.append("--enforce-eager: no CUDA graph")
    elif args.max_cudagraph_capture_size is None:
        notes.append("the capture size is vLLM's default on a GPU other than SM 10.x (wider there): "
                     "--max-cudagraph-capture-size fixes it")
    elif graphs != min(args.max_cudagraph_capture_size, tokens):
        notes.append(f"--max-cudagraph-capture-size {args.max_cudagraph_capture_size} is truncated to the largest "
                     f"size vLLM captures, {graphs}")
    lines = [how + (f" ({'; '.join(notes)})" if notes else "")]
    # vLLM 0.33.0: no draft-model slot, but parallel drafting on the V1 model runner adds k slots per request.
    parallel = bool(spec.get("parallel_drafting")) or method in ("dflash", "dspark")
    v2_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    v1 = (bool(spec.get("parallel_drafting")) and method not in ("dflash", "dspark")) or v2_env in ("0", "false")
    older = 1 + k + (k if parallel and v1 else 0)
    if older != per_request:
        rows_033 = min(tokens, max(seqs * older, graphs))
        lines.append(f"vLLM 0.33.0 derives {rows_033} ({older} tokens per request"
                     + (": parallel drafting on its V1 model runner)" if older > per_request
                        else ": no draft-model slot)"))
    return DerivedRows(rows, lines)


def vllm_query_dtype(kv_cache_dtype: str, model_dtype: str) -> tuple[tuple[str, ...], str]:
    """(the dtypes vLLM may give the gathered query, how) for --kv-cache-dtype:
    the platform's fp8 (float8_e4m3fn on CUDA) for a quantized cache other
    than fp8_ds_mla when the attention backend takes a quantized query, else
    the model's dtype. Which backend runs is not known offline: a quantized
    cache gives two candidates."""
    if kv_cache_dtype == "auto":
        return ("float8_e4m3fn", model_dtype), (
            f"{model_dtype}, or float8_e4m3fn if the checkpoint's quantization config quantizes the KV cache and "
            f"the attention backend takes a quantized query (--kv-cache-dtype auto)")
    if kv_cache_dtype in _PLAIN_KV or kv_cache_dtype == "fp8_ds_mla":
        why = "fp8_ds_mla keeps the model's dtype" if kv_cache_dtype == "fp8_ds_mla" else "an unquantized cache"
        return (model_dtype,), f"{model_dtype} (--kv-cache-dtype {kv_cache_dtype}: {why})"
    return ("float8_e4m3fn", model_dtype), (f"float8_e4m3fn if the attention backend takes a quantized query, "
                                            f"else {model_dtype} (--kv-cache-dtype {kv_cache_dtype})")
