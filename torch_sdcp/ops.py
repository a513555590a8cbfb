"""Thin, typed wrappers over torch.ops.sdcp. They validate the Python-level
options (names, not tensors: the kernels check tensors) and call the op, so
they trace cleanly under torch.compile.

The peer ops (those that take a ``workspace``) keep one contract that the
workspaces' call guard relies on (csrc/README.md, "Where validation lives"):
every argument error is raised before the op publishes anything (no store
into a peer, no call header, no call-index advance), as a ``ValueError`` or
``TypeError`` naming the argument, the expected and the actual value; an
error after publishing is a ``RuntimeError``. Here that means the Python
kinds of the arguments are checked before the op is called, so that a list
where a tensor belongs, or a float where an int belongs, never reaches the
dispatcher (whose refusal is a bare ``RuntimeError``).

Every peer op that carries a call header (all but ``query_release``) takes
``tag``: None (untagged) or an int in [0, 2**23 - 1), for example the layer
index, stored in the call header and compared by every peer, so that a
skipped, added or reordered call is named on every rank ("call tag 7" against
"call tag 8")."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_sdcp._checks import call_tag, check, check_choice, check_dtype, check_int, check_tensor

__all__ = [
    # the wrappers of the data-path operators (the workspace_* operators belong to torch_sdcp.workspace)
    "lse_combine", "lse_correct", "output_lse_combine", "output_lse_combine_out", "peer_all_gather",
    "query_all_gather_heads", "query_all_gather_heads_out", "query_gather", "query_publish", "query_release",
    "query_rope_quant", "topk_merge", "topk_select",
    # the options they take
    "LSE_BASES", "QUERY_DTYPES", "QUERY_GATHER_DTYPES", "ROPE_STYLES", "lse_is_base2", "rope_is_neox",
]
ROPE_STYLES = ("interleaved", "neox")
LSE_BASES = ("e", "2")
QUERY_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
#: What query_all_gather_heads moves: dtypes whose all-ones element is NaN, so
#: the sentinel of the data-as-flag buffers is never a value (docs/PROTOCOL.md).
QUERY_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def _refuse(*named: tuple[str, object, str]) -> None:
    """The slow path of a peer op's kind check: raises for the first
    ``(argument, value, kind)`` whose value is not of its kind (``"Tensor"``,
    ``"Tensor?"``, ``"int"`` or ``"dtype"``, as the schema says); returns when
    all are (the fast path is stricter than this, for speed)."""
    for arg, value, kind in named:
        if kind == "Tensor":
            check_tensor(value, arg)
        elif kind == "Tensor?":
            check(value is None or isinstance(value, Tensor), arg, "a Tensor or None", type(value).__name__)
        elif kind == "int":
            check_int(value, arg)
        else:
            check_dtype(value, arg)  # type: ignore[arg-type]


def _query_args_ok(ql_nope: object, q_pe: object, positions: object, cos_sin_cache: object, q_scale: object,
                   workspace: object, out_dtype: object) -> None:
    if not (isinstance(ql_nope, Tensor) and isinstance(q_pe, Tensor) and isinstance(positions, Tensor)
            and isinstance(cos_sin_cache, Tensor) and (q_scale is None or isinstance(q_scale, Tensor))
            and type(workspace) is int and isinstance(out_dtype, torch.dtype)):
        _refuse(("ql_nope", ql_nope, "Tensor"), ("q_pe", q_pe, "Tensor"), ("positions", positions, "Tensor"),
                ("cos_sin_cache", cos_sin_cache, "Tensor"), ("q_scale", q_scale, "Tensor?"),
                ("workspace", workspace, "int"), ("out_dtype", out_dtype, "dtype"))


def _combine_args_ok(partial_out: object, partial_lse: object, workspace: object, seq_lens: object,
                     query_start_loc: object) -> None:
    if not (isinstance(partial_out, Tensor) and isinstance(partial_lse, Tensor) and type(workspace) is int
            and (seq_lens is None or isinstance(seq_lens, Tensor))
            and (query_start_loc is None or isinstance(query_start_loc, Tensor))):
        _refuse(("partial_out", partial_out, "Tensor"), ("partial_lse", partial_lse, "Tensor"),
                ("workspace", workspace, "int"), ("seq_lens", seq_lens, "Tensor?"),
                ("query_start_loc", query_start_loc, "Tensor?"))


def rope_is_neox(rope_style: str) -> bool:
    return check_choice(rope_style, "rope_style", ROPE_STYLES) == "neox"


def lse_is_base2(lse_base: str) -> bool:
    return check_choice(lse_base, "lse_base", LSE_BASES) == "2"


def query_rope_quant(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                     q_scale: Tensor | None = None, *, rope_style: str = "interleaved",
                     out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """RoPE on q_pe [T, H, R], concatenated after ql_nope [T, H, Dn]:
    [T, H, Dn + R] in bf16, or float8_e4m3fn as saturate(x / q_scale)."""
    return torch.ops.sdcp.query_rope_quant(ql_nope, q_pe, positions, cos_sin_cache, q_scale,
                                           rope_is_neox(rope_style), out_dtype)


def topk_select(scores: Tensor, ids: Tensor, k: int) -> Tensor:
    """The k best candidates of each row of (scores [T, M] fp32, ids [T, M]
    int32) as ids [T, k] in selection order (score desc, lower id on ties,
    NaN below -inf, ids < 0 never selected), -1 padded."""
    return torch.ops.sdcp.topk_select(scores, ids, k)


def lse_combine(partial_out: Tensor, partial_lse: Tensor, *, lse_base: str = "e") -> tuple[Tensor, Tensor]:
    """Combine N stacked partials [N, T, H, D] with their LSEs [N, T, H]:
    returns ([T, H, D], [T, H] fp32)."""
    return torch.ops.sdcp.lse_combine(partial_out, partial_lse, lse_is_base2(lse_base))


def lse_correct(partial_out: Tensor, gathered_lse: Tensor, rank: int, *,
                lse_base: str = "e") -> tuple[Tensor, Tensor]:
    """The collective path's correction. With every rank's LSE gathered into
    gathered_lse [N, T, H] fp32, scale this rank's partial [T, H, D] by its
    weight: returns (w_rank * partial head-major [H, T, D] in partial_out's
    dtype, exact 0 where the weight is 0; global LSE [T, H] fp32)."""
    return torch.ops.sdcp.lse_correct(partial_out, gathered_lse, rank, lse_is_base2(lse_base))


def peer_all_gather(x: Tensor, workspace: int, *, tag: int | None = None) -> Tensor:
    """[N, *x.shape]: every rank's x, through an exchange workspace."""
    if not (isinstance(x, Tensor) and type(workspace) is int):
        _refuse(("x", x, "Tensor"), ("workspace", workspace, "int"))
    return torch.ops.sdcp.peer_all_gather(x, workspace, call_tag(tag))


def output_lse_combine(partial_out: Tensor, partial_lse: Tensor, workspace: int, *, lse_base: str = "e",
                       seq_lens: Tensor | None = None, query_start_loc: Tensor | None = None,
                       tag: int | None = None) -> tuple[Tensor, Tensor]:
    """This rank's heads of the combined output [T, H/N, D] and LSE [T, H/N].
    With vLLM's seq_lens [R] / query_start_loc [R + 1] (this rank's, int32 or
    int64, both or neither), padding rows and rows of empty shards get no
    weight (torch_sdcp.semantics.mask_empty_shards)."""
    _combine_args_ok(partial_out, partial_lse, workspace, seq_lens, query_start_loc)
    return torch.ops.sdcp.output_lse_combine(partial_out, partial_lse, workspace, lse_is_base2(lse_base),
                                             seq_lens, query_start_loc, call_tag(tag))


def output_lse_combine_out(partial_out: Tensor, partial_lse: Tensor, workspace: int, out: Tensor,
                           out_lse: Tensor, *, lse_base: str = "e", seq_lens: Tensor | None = None,
                           query_start_loc: Tensor | None = None, tag: int | None = None) -> None:
    """As output_lse_combine, written into caller-owned out / out_lse."""
    _combine_args_ok(partial_out, partial_lse, workspace, seq_lens, query_start_loc)
    if not (isinstance(out, Tensor) and isinstance(out_lse, Tensor)):
        _refuse(("out", out, "Tensor"), ("out_lse", out_lse, "Tensor"))
    torch.ops.sdcp.output_lse_combine_out(partial_out, partial_lse, workspace, lse_is_base2(lse_base), out, out_lse,
                                          seq_lens, query_start_loc, call_tag(tag))


def topk_merge(scores: Tensor, ids: Tensor, workspace: int, k: int, *, tag: int | None = None) -> Tensor:
    """Global top-k ids [T, k] over every rank's candidate shard."""
    if not (isinstance(scores, Tensor) and isinstance(ids, Tensor) and type(workspace) is int and type(k) is int):
        _refuse(("scores", scores, "Tensor"), ("ids", ids, "Tensor"), ("workspace", workspace, "int"), ("k", k, "int"))
    return torch.ops.sdcp.topk_merge(scores, ids, workspace, k, call_tag(tag))


def query_gather(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                 q_scale: Tensor | None, workspace: int, *, rope_style: str = "interleaved",
                 out_dtype: torch.dtype = torch.bfloat16, tag: int | None = None) -> Tensor:
    """Produce this rank's head shard into every peer's buffer and its own
    heads into the result; returns the gathered [T, N * H_loc, Dn + R]
    (head = src_rank * H_loc + h)."""
    _query_args_ok(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype)
    return torch.ops.sdcp.query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace,
                                       rope_is_neox(rope_style), out_dtype, call_tag(tag))


def query_publish(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                  q_scale: Tensor | None, workspace: int, *, rope_style: str = "interleaved",
                  out_dtype: torch.dtype = torch.bfloat16, tag: int | None = None) -> None:
    """As query_gather, but the gathered query stays in this rank's inbox (the
    view buffer) for a zero-copy reader, which must call query_release when it
    is done."""
    _query_args_ok(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, out_dtype)
    torch.ops.sdcp.query_publish(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace,
                                 rope_is_neox(rope_style), out_dtype, call_tag(tag))


def query_release(inbox: Tensor, workspace: int) -> None:
    """The reader of ``inbox`` (the first T rows of this rank's inbox, the
    view of the last query_publish) is done with it: its rows are re-filled
    and producers may store the next view call's query into it."""
    if not (isinstance(inbox, Tensor) and type(workspace) is int):
        _refuse(("inbox", inbox, "Tensor"), ("workspace", workspace, "int"))
    torch.ops.sdcp.query_release(inbox, workspace)


def query_all_gather_heads(q: Tensor, workspace: int, *, tag: int | None = None) -> Tensor:
    """A query produced elsewhere, ``q [T, H_loc, W]`` on every rank ->
    ``[T, N * H_loc, W]`` (head = src_rank * H_loc + h), through a query
    workspace; every non-NaN value bit-exact, NaN stays NaN."""
    if not (isinstance(q, Tensor) and type(workspace) is int):
        _refuse(("q", q, "Tensor"), ("workspace", workspace, "int"))
    return torch.ops.sdcp.query_all_gather_heads(q, workspace, call_tag(tag))


def query_all_gather_heads_out(q: Tensor, workspace: int, out: Tensor, *, tag: int | None = None) -> None:
    """As query_all_gather_heads, written into caller-owned ``out``."""
    if not (isinstance(q, Tensor) and isinstance(out, Tensor) and type(workspace) is int):
        _refuse(("q", q, "Tensor"), ("workspace", workspace, "int"), ("out", out, "Tensor"))
    torch.ops.sdcp.query_all_gather_heads_out(q, workspace, out, call_tag(tag))
