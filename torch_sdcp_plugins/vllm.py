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

import contextlib
import logging
import threading

from torch_sdcp_settings import VLLM

__all__ = ["ENV_ENABLE", "ENV_MAX_ROWS", "ENV_SEAMS", "ENV_TIMEOUT_S", "SEAMS", "enabled", "register", "seams",
           "validate_settings"]

ENV_ENABLE = VLLM.ENABLE
ENV_MAX_ROWS = VLLM.MAX_ROWS
ENV_TIMEOUT_S = VLLM.TIMEOUT_S
ENV_SEAMS = VLLM.SEAMS
#: The seams the plugin can take over (SDCP_VLLM_SEAMS selects among them; default all).
SEAMS = VLLM.all_seams
seams = VLLM.seams
max_rows_cap = VLLM.max_rows_cap
validate_settings = VLLM.validate


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
    """Whether ``SDCP_VLLM`` switches the plugin on (``1`` or ``require``; off
    when unset). An unrecognised value is logged once and counts as off."""
    return VLLM.switch_on(lambda msg: _log_once(logging.ERROR, "bad-enable", "%s", msg))


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Does nothing unless
    ``SDCP_VLLM=1``; never raises, except with ``SDCP_VLLM=require``, where a
    plugin that cannot install stops vLLM's start-up with the reason."""
    try:
        if not enabled():
            return
        validate_settings()
        from torch_sdcp.integrations import vllm as plugin

        if not plugin.install() and VLLM.required():
            raise RuntimeError(f"{ENV_ENABLE}=require: the vLLM plugin could not install (see the error above)")
    except Exception as e:
        _log_once(logging.ERROR, "register", "torch_sdcp: the vLLM plugin is off, vLLM keeps its own DCP paths: "
                  "%s: %s", type(e).__name__, e, exc_info=True)
        _undo()
        if VLLM.required():
            raise


def _undo() -> None:
    """Undo a partial install, if the integration was imported at all."""
    import sys

    plugin = sys.modules.get("torch_sdcp.integrations.vllm")
    if plugin is None:
        return
    with contextlib.suppress(Exception):
        plugin.uninstall()
