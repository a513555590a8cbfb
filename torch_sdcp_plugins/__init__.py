"""Engine plugin entry points of torch_sdcp (vllm.py, sglang.py), outside the
torch_sdcp package: an engine loads them in every process, and each imports
nothing of torch_sdcp (whose import loads the C++ extension) until its one
setting switches it on, then its face in torch_sdcp.integrations. None raises
into the engine's start-up. Their settings are read in settings.py, which the
library's faces read too (the library never imports a shim)."""

from __future__ import annotations

from torch_sdcp_plugins.settings import SWITCH_WORDS, read_switch

__all__ = ["SWITCH_WORDS", "read_switch"]
