"""The workspace families, one record each: the one Python list of families.

The fake registry's peer ops (``torch_sdcp.fake.PEER_OPS``), the kind test,
the engine faces' boundary table and the tests' cross-family call table
(test/_family_calls.py, keyed by peer op) are derived from ``FAMILIES``; the
package's exports (``torch_sdcp``, ``torch_sdcp.workspaces``) are written out
for type checkers and held equal to it (test/test_family_table.py); the C++ side has its own table (``kFamilies`` in
csrc/sdcp.h, indexed by ``WorkspaceKind``). This module imports nothing of
the package, so that every layer may read it.

A family is a record here plus its files (csrc/README.md, "Adding an op
family", lists them all).
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass


class WorkspaceKind(enum.IntEnum):
    """The workspace families; the values are those of the C++ side
    (``WorkspaceKind`` in csrc/sdcp.h)."""

    EXCHANGE = 0
    OUTPUT_LSE = 1
    TOPK = 2
    QUERY = 3


@dataclass(frozen=True)
class Family:
    """One workspace family.

    ``name``: the file stem of its files (csrc/<name>.*,
    torch_sdcp/workspaces/<name>.py, test/test_<name>*.py: test_exchange.py,
    test_output_lse*.py, test_topk.py, test_query_*.py) and its C++
    ``FamilyInfo`` name. ``workspace``: its workspace class, defined in
    torch_sdcp/workspaces/<name>.py and exported by ``torch_sdcp`` and
    ``torch_sdcp.workspaces`` (``load()`` imports it). ``params``: what its
    creation parameters hold, in order (the C++ parameters of ``kind``).
    ``parts``: what its layout's ``part_values`` hold, in order (C++:
    ``part_values``, decoded by its ``<Family>Geometry``). ``peer_ops``: its
    ops whose schema takes ``int workspace`` (they publish into peers'
    memory: the compiler must never drop them). ``integration``: the key of
    the engine faces' boundary table that builds its workspace
    (torch_sdcp/integrations/_boundaries.py ``BOUNDARIES``), None if no face does.
    """

    name: str
    kind: WorkspaceKind
    workspace: str
    params: tuple[str, ...]
    parts: tuple[str, ...]
    peer_ops: tuple[str, ...]
    integration: str | None = None

    @property
    def module(self) -> str:
        """The module that defines the workspace class."""
        return f"torch_sdcp.workspaces.{self.name}"

    def load(self) -> type:
        """The workspace class (imports its module)."""
        return getattr(importlib.import_module(self.module), self.workspace)


EXCHANGE = Family(
    "exchange", WorkspaceKind.EXCHANGE, "ExchangeWorkspace",
    params=("max_bytes",),
    # inbox [peer][word] of tagged 64-bit words (4 payload bytes each); bytes between two peers' entries;
    # call headers [peer][4 tagged words]
    parts=("inbox", "source_stride", "headers"),
    peer_ops=("peer_all_gather",),
    integration="all_gather")

OUTPUT_LSE = Family(
    "output_lse", WorkspaceKind.OUTPUT_LSE, "OutputLSEWorkspace",
    params=("max_rows", "total_heads", "head_dim", "elem_bytes"),
    # One entry per peer: out [peer][row][h_loc][d]; lse [peer][row][h_loc] fp32; call headers [peer][16 bytes]
    parts=("out_inbox", "lse_inbox", "headers"),
    peer_ops=("output_lse_combine", "output_lse_combine_out"),
    integration="output_lse")

TOPK = Family(
    "topk", WorkspaceKind.TOPK, "TopKWorkspace",
    params=("max_rows", "candidates_per_rank", "k"),
    # One entry per peer: a peer's sorted best keys [peer][row][min(C, k)]; min(C, k);
    # call headers [peer][16 bytes]
    parts=("keys", "keys_per_row", "headers"),
    peer_ops=("topk_merge",),
    integration="topk")

QUERY = Family(
    "query", WorkspaceKind.QUERY, "QueryWorkspace",
    params=("max_rows", "local_heads", "head_dim", "elem_bytes"),
    # the view [row][src*H_loc + h][nope + rope]; buffer 0 [peer][row][h][nope + rope] (buffer 1 follows);
    # bytes of one buffer; call headers [buffer 0, buffer 1, view][peer][16 bytes]
    parts=("inbox", "buffers", "buffer_bytes", "headers"),
    peer_ops=("query_gather", "query_publish", "query_release", "query_all_gather_heads",
              "query_all_gather_heads_out"),
    integration="query")

#: Every family, in ``WorkspaceKind`` order (the order of the C++ ``kFamilies``).
FAMILIES: tuple[Family, ...] = (EXCHANGE, OUTPUT_LSE, TOPK, QUERY)
