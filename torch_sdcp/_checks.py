"""Argument checks of the Python layer, for every module that validates
(csrc/README.md, "Where validation lives").

Every error is a ``ValueError`` that names the argument, the expected and the
actual value: ``torch_sdcp: argument 'k': expected k >= 1, got 0``. Shapes,
contiguity and devices read as csrc/checks.cpp words them (``expected 3
dimensions, got 2 (shape [2, 4])``, ``expected size 4 at dim 1, got 3 (shape
[2, 3])``), so that the Python paths and the ops refuse alike. The wording of
``expected`` belongs to the caller (tests match it), so the helpers that have
more than one wording in use take it as a parameter.

The inputs of a boundary as its op checks them (``check_query_inputs``,
``check_topk_inputs``, ``check_partials``, ``check_mask_args``) are here for
the Python paths that check before anything reaches an op: the collective
paths, the engine faces and the references.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def arg_error(arg: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"torch_sdcp: argument '{arg}': expected {expected}, got {actual}")


def check(cond: bool, arg: str, expected: str, actual: object) -> None:
    if not cond:
        raise arg_error(arg, expected, actual)


def is_int(value: object) -> bool:
    """An int that is not a bool (a bool is an int in Python, never a meaningful size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, arg: str, minimum: int | None = None, *, expected: str = "an int",
              bound: str | None = None) -> int:
    """``value`` is an int and, with ``minimum``, at least ``minimum``.

    A wrong type reads ``expected {expected}, got <type name>``; a value below
    the minimum reads ``expected {bound or expected} >= {minimum}, got <value>``.
    """
    check(is_int(value), arg, expected, type(value).__name__)
    if minimum is not None:
        check(value >= minimum, arg, f"{bound or expected} >= {minimum}", value)
    return value


def check_positive_int(value: Any, arg: str, *, named: bool = False) -> int:
    """``value`` is an int >= 1: ``expected a positive int, got <repr>``. With
    ``named`` the messages name the argument and tell the two failures apart
    (``expected world_size to be an int``, ``expected world_size >= 1``)."""
    if named:
        return check_int(value, arg, 1, expected=f"{arg} to be an int", bound=arg)
    check(is_int(value) and value >= 1, arg, "a positive int", repr(value))
    return value


#: Call tags are ints in [0, CALL_TAG_LIMIT): the call header keeps tag + 1 in
#: 23 bits of its dtype word (csrc/dataflag.h kHeaderTagMask).
CALL_TAG_LIMIT = 2**23 - 1


def call_tag(tag: Any) -> int:
    """A call method's ``tag`` as the peer ops take it: -1 for None
    (untagged), else the int itself, in [0, CALL_TAG_LIMIT) (bools refused)."""
    if tag is None:
        return -1
    if type(tag) is int and 0 <= tag < CALL_TAG_LIMIT:
        return tag
    raise arg_error("tag", f"None or an int in [0, {CALL_TAG_LIMIT})",
                    repr(tag) if is_int(tag) else type(tag).__name__)


def check_bool(value: Any, arg: str) -> bool:
    check(isinstance(value, bool), arg, "a bool", repr(value))
    return value


def check_choice(value: object, arg: str, choices: Sequence) -> object:
    """``value`` is one of ``choices``: ``expected one of (...), got <repr>``."""
    check(value in choices, arg, f"one of {choices}", repr(value))
    return value


def check_tensor(t: Any, arg: str) -> Tensor:
    check(isinstance(t, Tensor), arg, "a Tensor", type(t).__name__)
    return t


def check_dim(t: Any, arg: str, ndim: int | tuple[int, ...], names: str = "") -> Tensor:
    """A Tensor of ``ndim`` dimensions (an int, or a tuple of the allowed
    ones), in the words of csrc (``check_dim``): ``expected 3 dimensions, got 2
    (shape [2, 4])``. ``names`` (``"[T, H, D]"``) follows the count."""
    check_tensor(t, arg)
    dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if t.dim() not in dims:
        want = " or ".join(str(d) for d in dims) + " dimensions" + (f" {names}" if names else "")
        raise arg_error(arg, want, f"{t.dim()} (shape {list(t.shape)})")
    return t


def check_dtype(value: Tensor | torch.dtype, arg: str, *allowed: torch.dtype) -> object:
    """A tensor's dtype (``expected dtype torch.float32, got dtype torch.int32``),
    or a dtype argument (``expected torch.bfloat16 or torch.float16, got
    torch.float32``; ``expected a torch.dtype`` for anything else). With no
    ``allowed`` a dtype argument is only checked to be a ``torch.dtype``."""
    want = " or ".join(str(d) for d in allowed)
    if isinstance(value, Tensor):
        check(value.dtype in allowed, arg, f"dtype {want}", f"dtype {value.dtype}")
        return value
    check(isinstance(value, torch.dtype), arg, "a torch.dtype", repr(value))
    check(not allowed or value in allowed, arg, want, value)
    return value


def check_size(t: Tensor, arg: str, d: int, want: int, why: str = "") -> None:
    """Size ``want`` at dim ``d``, in the words of csrc (``check_size``):
    ``expected size 4 at dim 1, got 3 (shape [2, 3])``; ``why`` says where
    ``want`` comes from (``"head_dim of this OutputLSEWorkspace"``)."""
    if t.size(d) != want:
        raise arg_error(arg, f"size {want} at dim {d}" + (f" ({why})" if why else ""),
                        f"{t.size(d)} (shape {list(t.shape)})")


def check_contiguous(t: Tensor, arg: str) -> None:
    """In the words of csrc (``check_contiguous``)."""
    if not t.is_contiguous():
        raise arg_error(arg, "a contiguous tensor", f"strides {list(t.stride())} for shape {list(t.shape)}")


def check_same_device(t: Tensor, arg: str, ref: Tensor, ref_arg: str) -> None:
    """In the words of csrc (``check_same_device``):
    ``expected device cpu (that of 'ql_nope'), got device meta``."""
    if t.device != ref.device:
        raise arg_error(arg, f"device {ref.device} (that of '{ref_arg}')", f"device {t.device}")


# ---------------------------------------------------------------------------
# The inputs of each boundary, as its op checks them (csrc/<family>.cpp).
# ---------------------------------------------------------------------------


def check_query_inputs(ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                       q_scale: Tensor | None, out_dtype: torch.dtype, allow_fp32: bool = False) -> None:
    """The query producer's inputs (csrc/query.cpp ``check_query_inputs``);
    ``allow_fp32`` admits the references' float32 output."""
    check_dim(ql_nope, "ql_nope", 3)
    check_dim(q_pe, "q_pe", 3)
    check_dtype(ql_nope, "ql_nope", torch.bfloat16)
    check_dtype(q_pe, "q_pe", torch.bfloat16)
    check_size(q_pe, "q_pe", 0, ql_nope.size(0))
    check_size(q_pe, "q_pe", 1, ql_nope.size(1))
    rope = q_pe.size(2)
    check(rope > 0 and rope % 2 == 0, "q_pe", "an even, positive last dimension", rope)
    check_dim(positions, "positions", 1)
    check_size(positions, "positions", 0, ql_nope.size(0))
    check_dtype(positions, "positions", torch.int64, torch.int32)
    check_dim(cos_sin_cache, "cos_sin_cache", 2)
    check_size(cos_sin_cache, "cos_sin_cache", 1, rope)
    check_dtype(cos_sin_cache, "cos_sin_cache", torch.float32, torch.bfloat16)
    check_same_device(q_pe, "q_pe", ql_nope, "ql_nope")
    check_same_device(positions, "positions", ql_nope, "ql_nope")
    check_same_device(cos_sin_cache, "cos_sin_cache", ql_nope, "ql_nope")
    allowed = (torch.bfloat16, torch.float8_e4m3fn) + ((torch.float32,) if allow_fp32 else ())
    check(out_dtype in allowed, "out_dtype", " or ".join(str(d) for d in allowed), out_dtype)
    if q_scale is not None:
        check_tensor(q_scale, "q_scale")
        check(q_scale.numel() == 1, "q_scale", "one element", f"shape {list(q_scale.shape)}")
        check_dtype(q_scale, "q_scale", torch.float32)
        check_same_device(q_scale, "q_scale", ql_nope, "ql_nope")
        check(out_dtype == torch.float8_e4m3fn, "q_scale", "None for a non-fp8 output", "a scale tensor")


def check_topk_inputs(scores: Tensor, ids: Tensor, k: int, scores_arg: str = "scores", ids_arg: str = "ids") -> None:
    """Candidate pairs ``scores [T, M]`` fp32 and ``ids [T, M]`` int32 on one
    device, and ``k >= 1`` (csrc/topk.cpp ``prepare_topk_select``)."""
    check_dim(scores, scores_arg, 2)
    check_dim(ids, ids_arg, 2)
    check_dtype(scores, scores_arg, torch.float32)
    check_dtype(ids, ids_arg, torch.int32)
    check_size(ids, ids_arg, 0, scores.size(0))
    check_size(ids, ids_arg, 1, scores.size(1))
    check_same_device(ids, ids_arg, scores, scores_arg)
    check_int(k, "k", 1, bound="k")


def check_partials(partial_out: Tensor, partial_lse: Tensor, lse_dim: int, *lse_dtypes: torch.dtype) -> None:
    """Partial outputs ``[..., T, H, D]`` (a float dtype) and their LSEs
    ``[..., T, H]`` of ``lse_dim`` dimensions (``[N, T, H]`` stacked, ``[T, H]``
    for one rank) on one device (csrc/output_lse.cpp)."""
    check_dim(partial_out, "partial_out", lse_dim + 1)
    check_dim(partial_lse, "partial_lse", lse_dim)
    check(partial_out.is_floating_point() and partial_out.element_size() >= 2, "partial_out",
          "a float32, float16 or bfloat16 tensor", f"dtype {partial_out.dtype}")
    check_dtype(partial_lse, "partial_lse", *lse_dtypes)
    for d in range(lse_dim):
        check_size(partial_lse, "partial_lse", d, partial_out.size(d))
    check_same_device(partial_lse, "partial_lse", partial_out, "partial_out")


def check_mask_args(seq_lens: Tensor | None, query_start_loc: Tensor | None) -> bool:
    """True when the empty-shard mask is asked for: ``seq_lens [R]`` and
    ``query_start_loc [R + 1]``, both or neither, 1-D int32 or int64 (the
    checks of csrc/output_lse.cpp, in its order). Shapes only: no device work."""
    if seq_lens is None and query_start_loc is None:
        return False
    if seq_lens is None or query_start_loc is None:
        missing = "seq_lens" if seq_lens is None else "query_start_loc"
        given = "query_start_loc" if seq_lens is None else "seq_lens"
        raise arg_error(missing, "a tensor, as 'seq_lens' and 'query_start_loc' are given both or neither",
                        f"None beside a given '{given}'")
    check_tensor(seq_lens, "seq_lens")
    check_tensor(query_start_loc, "query_start_loc")
    check_dim(seq_lens, "seq_lens", 1)
    check_dim(query_start_loc, "query_start_loc", 1)
    check(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc",
          f"{seq_lens.numel() + 1} entries (len(seq_lens) + 1)", query_start_loc.numel())
    check(seq_lens.numel() < 2**30, "seq_lens", "fewer than 2**30 requests", seq_lens.numel())
    for t, arg in ((seq_lens, "seq_lens"), (query_start_loc, "query_start_loc")):
        check(t.dtype in (torch.int32, torch.int64), arg, "dtype int32 or int64", f"dtype {t.dtype}")
    return True
