"""Engine plugin entry points of torch_sdcp (vllm.py, sglang.py), outside the
torch_sdcp package: an engine loads them in every process, and each imports
nothing of torch_sdcp (whose import loads the C++ extension) until its one
setting switches it on, then its face in torch_sdcp.integrations. None raises
into the engine's start-up."""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def read_switch(name: str) -> tuple[bool, str | None]:
    """The on/off setting ``name`` of the environment: (on, the raw value when
    it is neither an on nor an off word, for the caller to log once)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return True, None
    return False, None if value in _OFF else raw


#: How the accepted words read in a log line.
SWITCH_WORDS = ("/".join(_ON), "/".join(_OFF[1:]))
