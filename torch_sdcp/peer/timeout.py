"""The bound of every wait on a peer: ``timeout_s``, checked, and its default, the environment
variable ``SDCP_TIMEOUT_S`` (the one reader of it) or ``DEFAULT_TIMEOUT_S``."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from torch_sdcp._checks import check

#: Bound of every wait on a peer when neither ``timeout_s`` nor
#: ``SDCP_TIMEOUT_S`` says otherwise: minutes, because engines skew by many
#: seconds at start (compilation, JIT, capture) and a false timeout is fatal.
DEFAULT_TIMEOUT_S = 300.0
#: The environment variable that overrides DEFAULT_TIMEOUT_S.
TIMEOUT_ENV = "SDCP_TIMEOUT_S"
#: Accepted range of a timeout, in seconds (1 ms to 24 h).
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 86400.0


def validate_timeout(value: Any, arg: str = "timeout_s") -> float:
    """``value`` as a float number of seconds in [MIN_TIMEOUT_S, MAX_TIMEOUT_S]:
    a real number (not a string, not a bool), finite."""
    check(isinstance(value, numbers.Real) and not isinstance(value, bool), arg,
          "a number of seconds (an int or a float)", f"{type(value).__name__} {value!r}")
    seconds = float(value)
    check(math.isfinite(seconds) and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S, arg,
          f"a finite number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]", repr(value))
    return seconds


def default_timeout_s() -> float:
    """``SDCP_TIMEOUT_S`` when set (checked like ``timeout_s``), else
    DEFAULT_TIMEOUT_S. Read at every creation, so a bad value is reported by
    the workspace that would use it, not at import."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        return validate_timeout(float(raw), TIMEOUT_ENV)
    except ValueError:
        raise ValueError(f"torch_sdcp: environment variable {TIMEOUT_ENV}: expected a finite number of seconds "
                         f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}], got {raw!r}") from None
