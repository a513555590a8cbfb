"""Engine plugin entry points of torch_sdcp (vllm.py, sglang.py), outside the
torch_sdcp package: an engine loads them in every process, and each imports
nothing of torch_sdcp (whose import loads the C++ extension) until its one
setting switches it on, then its face in torch_sdcp.integrations. None raises
into the engine's start-up. Their settings are read in torch_sdcp_settings, a
package of its own below both the shims and the library's faces, which read it
too (the library never imports a shim)."""

from __future__ import annotations

from torch_sdcp_settings import SWITCH_WORDS, read_switch

__all__ = ["SWITCH_WORDS", "read_switch"]
