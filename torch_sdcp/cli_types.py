"""argparse types shared by the package's commands (``python -m torch_sdcp.bench``,
``python -m torch_sdcp.plugin_check``): a bad value is a usage error that
argparse words with the option's name. Imports nothing of the package."""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "positive_seconds"]


def positive_int(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value
