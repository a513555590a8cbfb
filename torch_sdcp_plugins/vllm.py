"""vLLM's ``vllm.general_plugins`` entry point for torch_sdcp.

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers, the model-inspection subprocess), without a try/except around
it. So this module imports nothing of torch_sdcp unless ``SDCP_VLLM=1``
(importing torch_sdcp loads its C++ extension), validates the settings before
anything is patched, and never raises: any error is logged once and the
plugin stays off, leaving vLLM's own DCP paths in place. The patching itself
is :mod:`torch_sdcp.integrations.vllm`.
"""

from __future__ import annotations

import logging
import os
import threading

from torch_sdcp_plugins import SWITCH_WORDS, read_switch

__all__ = ["ENV_ENABLE", "ENV_MAX_ROWS", "ENV_SEAMS", "ENV_TIMEOUT_S", "SEAMS", "enabled", "register", "seams",
           "validate_settings"]

ENV_ENABLE = "SDCP_VLLM"
ENV_MAX_ROWS = "SDCP_VLLM_MAX_ROWS"
ENV_TIMEOUT_S = "SDCP_VLLM_TIMEOUT_S"
ENV_SEAMS = "SDCP_VLLM_SEAMS"
#: The seams the plugin can take over (SDCP_VLLM_SEAMS selects among them; default all).
SEAMS = ("combine", "query", "topk")


_logged: set = set()
_lock = threading.Lock()


def _logger() -> logging.Logger:
    # A child of vLLM's "vllm" logger: vLLM's handler and VLLM_LOGGING_LEVEL apply, without importing vLLM.
    return logging.getLogger("vllm.torch_sdcp")


def _log_once(level: int, reason: str, msg: str, *args, exc_info: bool = False) -> None:
    with _lock:
        if reason in _logged:
            return
        _logged.add(reason)
    _logger().log(level, msg, *args, exc_info=exc_info)


def enabled() -> bool:
    """Whether ``SDCP_VLLM`` switches the plugin on (off when unset). An
    unrecognised value is logged once and counts as off."""
    on, bad = read_switch(ENV_ENABLE)
    if bad is not None:
        _log_once(logging.ERROR, "bad-enable", "torch_sdcp: %s=%r is not one of %s (on) or %s (off); the vLLM "
                  "plugin stays off", ENV_ENABLE, bad, *SWITCH_WORDS)
    return on


def seams() -> tuple[str, ...]:
    """The seams ``SDCP_VLLM_SEAMS`` selects (comma-separated names from
    :data:`SEAMS`; unset or empty: all). An unknown name is a ValueError."""
    raw = os.environ.get(ENV_SEAMS)
    if raw is None or not raw.strip():
        return SEAMS
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in SEAMS]
    if unknown:
        raise ValueError(f"torch_sdcp: environment variable {ENV_SEAMS}: expected comma-separated names from "
                         f"{','.join(SEAMS)}, got {raw!r} (unknown: {', '.join(unknown)})")
    return tuple(s for s in SEAMS if s in names)


def max_rows_cap() -> int | None:
    """``SDCP_VLLM_MAX_ROWS`` as a positive int, or None when unset. A bad
    value is a ValueError naming the variable."""
    raw = os.environ.get(ENV_MAX_ROWS)
    if raw is None or not raw.strip():
        return None
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"torch_sdcp: environment variable {ENV_MAX_ROWS}: expected a positive int, got {raw!r}")
    return rows


def validate_settings() -> None:
    """Every SDCP_VLLM_* setting, checked before anything is patched: a bad
    value is a ValueError naming the variable, the expected and the actual
    value."""
    max_rows_cap()
    raw = os.environ.get(ENV_TIMEOUT_S)
    if raw is not None and raw.strip():
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(f"torch_sdcp: environment variable {ENV_TIMEOUT_S}: expected a number, "
                             f"got {raw!r}") from None
        if not seconds > 0:
            raise ValueError(f"torch_sdcp: environment variable {ENV_TIMEOUT_S}: expected > 0, got {raw!r}")
    seams()


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Does nothing unless
    ``SDCP_VLLM=1``; never raises."""
    try:
        if not enabled():
            return
        validate_settings()
        from torch_sdcp.integrations import vllm as plugin

        plugin.install()
    except Exception as e:  # noqa: BLE001  (nothing of ours may abort vLLM's start-up)
        _log_once(logging.ERROR, "register", "torch_sdcp: the vLLM plugin is off, vLLM keeps its own DCP paths: "
                  "%s: %s", type(e).__name__, e, exc_info=True)
        _undo()


def _undo() -> None:
    """Undo a partial install, if the integration was imported at all."""
    import sys

    plugin = sys.modules.get("torch_sdcp.integrations.vllm")
    if plugin is None:
        return
    try:
        plugin.uninstall()
    except Exception:  # noqa: BLE001  (already logged the cause; stay quiet)
        pass
