"""torch_sdcp: Shared-DCP, peer-addressable decode data paths for Decode Context
Parallelism.

Workspaces (created collectively, before CUDA-graph capture):
    OutputLSEWorkspace(group, max_rows, total_heads, head_dim).combine(out, lse)
    TopKWorkspace(group, max_rows, k).merge(scores, ids)
    QueryWorkspace(group, max_rows, local_heads).gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)
    ExchangeWorkspace(group, max_bytes).all_gather(x)
Peer memory: PeerArena. Operators: torch.ops.sdcp.* (typed wrappers in torch_sdcp.ops).
Exact references: torch_sdcp.reference. Inputs (the RoPE cache layout, score
distributions): torch_sdcp.inputs. The collective paths (the fallback and the
baseline): torch_sdcp.collective.
"""

import importlib
from typing import TYPE_CHECKING

# Loading the extension registers every torch.ops.sdcp operator. A failure here
# is an installation problem and must be loud, never a silent fallback. First:
# the fake implementations and the typed wrappers below need the operators.
from torch_sdcp._extension import _C  # noqa: F401

# isort: split
from torch_sdcp import fake  # noqa: F401  (registers the fake implementations)
from torch_sdcp import ops as ops
from torch_sdcp._version import __version__ as __version__
from torch_sdcp.families import FAMILIES

# Looked up in their module at every access, not bound here: `import torch_sdcp`
# stays free of the peer-memory modules until a workspace is used, and
# torch_sdcp.workspaces is the one place that holds the workspace classes (a
# substitute set there, as the engine faces' tests do, is what torch_sdcp.X is).
_LAZY = {
    "GroupOutOfStepError": "torch_sdcp.peer", "PeerArena": "torch_sdcp.peer",
    "PeerWorkspace": "torch_sdcp.workspaces", "VoidedCallError": "torch_sdcp.workspaces",
    **{family.workspace: "torch_sdcp.workspaces" for family in FAMILIES},
}
_LAZY_MODULES = ("collective", "inputs", "reference")

if TYPE_CHECKING:  # what __getattr__ returns, written out for type checkers (test_family_table.py checks it)
    from torch_sdcp import collective as collective
    from torch_sdcp import inputs as inputs
    from torch_sdcp import reference as reference
    from torch_sdcp.peer import GroupOutOfStepError as GroupOutOfStepError
    from torch_sdcp.peer import PeerArena as PeerArena
    from torch_sdcp.workspaces import ExchangeWorkspace as ExchangeWorkspace
    from torch_sdcp.workspaces import OutputLSEWorkspace as OutputLSEWorkspace
    from torch_sdcp.workspaces import PeerWorkspace as PeerWorkspace
    from torch_sdcp.workspaces import QueryWorkspace as QueryWorkspace
    from torch_sdcp.workspaces import TopKWorkspace as TopKWorkspace
    from torch_sdcp.workspaces import VoidedCallError as VoidedCallError


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"torch_sdcp.{name}")
    raise AttributeError(f"module 'torch_sdcp' has no attribute {name!r}")


__all__ = sorted([*_LAZY, "__version__", *_LAZY_MODULES, "ops"])
