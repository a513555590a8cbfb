"""argparse types shared by the package's commands (``python -m torch_sdcp.bench``,
``python -m torch_sdcp.plugin_check``): a bad value is a usage error that
argparse words with the option's name. Imports nothing of the package."""

from __future__ import annotations

import argparse
import math

__all__ = ["non_negative_int", "positive_int", "positive_seconds"]


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return _int_at_least(text, 0)


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value
