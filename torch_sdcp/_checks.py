"""Argument checks of the Python layer.

Every error is a ``ValueError`` that names the argument, the expected and the
actual value: ``torch_sdcp: argument 'k': expected k >= 1, got 0``. The
wording of ``expected`` belongs to the caller (tests match it), so the helpers
that have more than one wording in use take it as a parameter.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

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


def check_int(value: Any, arg: str, minimum: Optional[int] = None, *, expected: str = "an int",
              bound: Optional[str] = None) -> int:
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


def check_dim(t: Any, arg: str, ndim: Union[int, Tuple[int, ...]]) -> Tensor:
    """A Tensor of ``ndim`` dimensions (an int, or a tuple of the allowed ones)."""
    check_tensor(t, arg)
    dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    want = " or ".join(f"{d}-D" for d in dims)
    check(t.dim() in dims, arg, f"a {want} tensor", f"shape {list(t.shape)}")
    return t


def check_dtype(value: Union[Tensor, torch.dtype], arg: str, *allowed: torch.dtype) -> object:
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


def check_size(t: Tensor, arg: str, d: int, want: int) -> None:
    check(t.size(d) == want, arg, f"size {want} in dimension {d}", f"shape {list(t.shape)}")


def check_same_device(t: Tensor, arg: str, ref: Tensor, ref_arg: str) -> None:
    check(t.device == ref.device, arg, f"the device of '{ref_arg}' ({ref.device})", f"device {t.device}")
