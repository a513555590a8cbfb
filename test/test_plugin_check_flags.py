"""``python -m torch_sdcp.plugin_check --engine vllm`` with vLLM's own flags:
the rows bound derived as vLLM 0.34.0's get_dcp_workspace_max_num_tokens
derives it (speculative tokens, the max-num-batched-tokens cap, the CUDA-graph
capture size), the gathered query's dtype as the MLA layer picks it from
--kv-cache-dtype, a --rows or --query-dtype that differs named with the value
start-up uses, and bad values usage errors naming the option."""

from __future__ import annotations

import json

import pytest

from torch_sdcp import plugin_check
from torch_sdcp.plugin_check_engine import capture_size

BASE = ["--engine", "vllm", "-dcp", "2", "--dcp-comm-backend", "a2a", "--num-heads", "64"]
EAGER = ["--enforce-eager"]


@pytest.fixture(autouse=True)
def _plugin_on(monkeypatch):
    monkeypatch.setenv("SDCP_VLLM", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("SDCP_VLLM_MAX_ROWS", raising=False)


def rows_of(argv: list[str]) -> tuple[int, str]:
    status, text = plugin_check.report([*BASE, *argv])
    assert status == 0, text
    line = next(x for x in text.splitlines() if x.startswith("rows bound: "))
    return int(line.split()[2]), text


def spec(**config: object) -> list[str]:
    return ["--speculative-config", json.dumps(config)]


@pytest.mark.parametrize("argv, rows", [
    # max_num_seqs x (1 + num_speculative_tokens), no CUDA graph
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER], 128),
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER, "--spec-tokens", "3"], 512),
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER, *spec(num_speculative_tokens=3)], 512),
    # a plain draft model keeps one more token per request (vLLM 0.34.0)
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER,
      *spec(method="draft_model", num_speculative_tokens=3)], 640),
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER, "--spec-method", "draft_model",
      "--spec-tokens", "3"], 640),
    # capped by max_num_batched_tokens
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "1024", *EAGER, "--spec-tokens", "3"], 1024),
    # raised by the capture size: given (truncated to the largest size captured), or vLLM's default
    (["--max-num-seqs", "16", "--max-num-batched-tokens", "8192", "--max-cudagraph-capture-size", "512"], 512),
    (["--max-num-seqs", "16", "--max-num-batched-tokens", "8192", "--max-cudagraph-capture-size", "300"], 288),
    (["--max-num-seqs", "16", "--max-num-batched-tokens", "200", "--max-cudagraph-capture-size", "512"], 200),
    (["--max-num-seqs", "128", "--max-num-batched-tokens", "8192"], 256),
])
def test_the_rows_bound_derived_as_vllm_does(argv, rows):
    got, text = rows_of(argv)
    assert got == rows, text
    assert "derived from vLLM's flags as vLLM 0.34.0 derives it: min(--max-num-batched-tokens" in text, text


def test_the_bound_sizes_the_workspaces():
    """The derived bound, not --rows' default, is what the workspaces are sized for."""
    _, derived = rows_of(["--max-num-seqs", "64", "--max-num-batched-tokens", "8192", *EAGER])
    _, given = rows_of(["--rows", "64"])
    _, default = rows_of([])
    sizes = [[x for x in t.splitlines() if "workspace:" in x] for t in (derived, given, default)]
    assert sizes[0] == sizes[1] != sizes[2], sizes


@pytest.mark.parametrize("given, seqs, tokens, query_len, eager, size", [
    (None, 128, 8192, 1, False, 256),     # min(2 x 128, 512)
    (None, 1024, 8192, 1, False, 512),    # the ceiling off SM 10.x
    (None, 128, 200, 1, False, 200),      # max_num_batched_tokens is captured when it fits
    (None, 5, 8192, 4, False, 40),        # 2 x 5 x 4, a multiple of 8
    (None, 3, 8192, 5, False, 24),        # 2 x 3 x 5 = 30, down to the grid's 24
    (300, 16, 8192, 1, False, 288),
    (7, 16, 8192, 1, False, 4),
    (512, 16, 8192, 1, True, 0),
])
def test_the_capture_size_vllm_resolves(given, seqs, tokens, query_len, eager, size):
    assert capture_size(given, seqs, tokens, query_len, eager) == size


def test_a_rows_that_differs_is_named_with_the_bound_startup_uses():
    flags = ["--max-num-seqs", "128", "--max-num-batched-tokens", "8192", *EAGER]
    got, text = rows_of([*flags, "--rows", "64"])
    assert got == 128, text
    assert "--rows 64 differs from the bound vLLM derives from its flags, 128: start-up uses vLLM's 128" in text, text
    _, same = rows_of([*flags, "--rows", "128"])
    assert "differs" not in same, same


def test_a_bound_not_derivable_says_why_and_keeps_rows():
    got, text = rows_of(["--max-num-seqs", "16", "--rows", "96"])
    assert got == 96, text
    assert "rows bound not derived from vLLM's flags: --max-num-batched-tokens not given" in text, text
    got, text = rows_of(["--max-num-seqs", "16", "--max-num-batched-tokens", "64", *spec(method="mtp")])
    assert got == 1024 and "gives no num_speculative_tokens" in text, text
    _, plain = rows_of([])
    assert "derived" not in plain, plain


def test_the_releases_that_derive_another_bound_are_said(monkeypatch):
    flags = ["--max-num-seqs", "8", "--max-num-batched-tokens", "8192", *EAGER]
    _, text = rows_of([*flags, *spec(method="draft_model", num_speculative_tokens=2)])
    assert "vLLM 0.33.0 derives 24 (3 tokens per request: no draft-model slot)" in text, text
    got, text = rows_of([*flags, *spec(method="eagle", num_speculative_tokens=2, parallel_drafting=True)])
    assert got == 24 and "vLLM 0.33.0 derives 40 (5 tokens per request: parallel drafting" in text, text
    _, text = rows_of([*flags, *spec(method="dflash", num_speculative_tokens=2)])
    assert "0.33.0" not in text, text  # V2 runner by default: no extra slots
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    _, text = rows_of([*flags, *spec(method="dflash", num_speculative_tokens=2)])
    assert "vLLM 0.33.0 derives 40" in text, text


@pytest.mark.parametrize("kv, query, says, differs", [
    ("fp8", None, "float8_e4m3fn if the attention backend takes a quantized query, else bfloat16 "
                  "(--kv-cache-dtype fp8); the query workspace is sized for bfloat16", False),
    ("fp8", "float8_e4m3fn", "the query workspace is sized for float8_e4m3fn", False),
    ("fp8", "float16", "--query-dtype float16 differs from what vLLM gives the query with --kv-cache-dtype fp8 "
                       "(float8_e4m3fn or bfloat16): start-up uses vLLM's", True),
    ("bfloat16", "float8_e4m3fn", "query dtype: bfloat16 (--kv-cache-dtype bfloat16: an unquantized cache)", True),
    ("fp8_ds_mla", None, "query dtype: bfloat16 (--kv-cache-dtype fp8_ds_mla", False),
    ("auto", "float8_e4m3fn", "float8_e4m3fn if the checkpoint's quantization config quantizes the KV cache", False),
])
def test_the_query_dtype_from_the_kv_cache_dtype(kv, query, says, differs):
    argv = ["--rows", "64", "--kv-cache-dtype", kv, *(["--query-dtype", query] if query else [])]
    _, text = rows_of(argv)
    assert says in text, text
    assert ("--query-dtype" in text and "differs" in text) == differs, text
    if differs:  # sized for vLLM's dtype, as start-up would be
        _, plain = rows_of(["--rows", "64"])
        sized = [[x for x in t.splitlines() if x.startswith("query workspace:")] for t in (text, plain)]
        assert sized[0] == sized[1], sized


@pytest.mark.parametrize("argv, says", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer >= 1, got 0"),
    (["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: expected an integer >= 1, got 'x'"),
    (["--max-cudagraph-capture-size", "-4"],
     "argument --max-cudagraph-capture-size: expected an integer >= 1, got -4"),
    (["--spec-tokens", "-1"], "argument --spec-tokens: expected an integer >= 0, got -1"),
    (["--speculative-config", "{3"], "argument --speculative-config/-sc: expected a JSON object, got '{3'"),
    (["-sc", "[3]"], "argument --speculative-config/-sc: expected a JSON object, got '[3]'"),
    (spec(num_speculative_tokens="3"),
     "argument --speculative-config: expected num_speculative_tokens an integer >= 0, got '3'"),
    (spec(num_speculative_tokens=2) + ["--spec-tokens", "2"],
     "argument --spec-tokens: expected either it or --speculative-config's 'num_speculative_tokens', got both"),
    (["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
])
def test_a_bad_vllm_flag_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        plugin_check.report([*BASE, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torch_sdcp.plugin_check") and f"error: {says}" in err, err


def test_vllms_flags_with_sglang_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        plugin_check.report(["--engine", "sglang", "--max-num-seqs", "8", "--kv-cache-dtype", "fp8"])
    assert e.value.code == 2
    assert ("error: argument --max-num-seqs, --kv-cache-dtype: vLLM's option, expected with --engine vllm, "
            "got --engine sglang") in capsys.readouterr().err
