"""The ``sglang.srt.plugins`` entry point ``torch_sdcp``: SGLang calls
:func:`register` in every process it starts (and catches what it raises; this
one raises nothing). Off unless ``SDCP_SGLANG=1`` (or ``require``); while off it
imports nothing of torch_sdcp. On, it registers
:mod:`torch_sdcp.integrations.sglang`'s hooks with SGLang (docs/SGLANG.md)."""

from __future__ import annotations

import logging

from torch_sdcp_plugins.settings import SGLANG

ENV_ENABLE = SGLANG.ENABLE

_logged: set = set()


def _log_once(level: int, reason: str, msg: str, *args: object) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logging.getLogger("sglang.torch_sdcp").log(level, msg, *args)


def enabled() -> bool:
    """Whether ``SDCP_SGLANG`` switches the plugin on (``1`` or ``require``; off
    when unset). An unrecognised value is logged once and counts as off."""
    return SGLANG.switch_on(lambda msg: _log_once(logging.ERROR, "setting", "%s", msg))


def register() -> None:
    """The entry point. Never raises: a failure (a bad setting included) is
    logged once and the plugin stays off (SGLang runs its own DCP paths);
    with ``SDCP_SGLANG=require`` it re-raises, but SGLang's loader catches
    what a plugin raises: only a refusal at warm-up (after a successful
    install) stops SGLang's start-up."""
    try:
        if not enabled():
            return
        SGLANG.validate()
        from torch_sdcp.integrations import sglang as face

        if not face.install() and SGLANG.required():
            raise RuntimeError(f"{ENV_ENABLE}=require: the SGLang plugin could not install (see the error above)")
    except Exception as e:
        _log_once(logging.ERROR, "register", "torch_sdcp: the SGLang plugin stays off: %s: %s", type(e).__name__, e)
        if SGLANG.required():
            raise
