"""Workspaces: one peer arena per boundary, registered with the C++ ops under an
integer handle. Created collectively before any capture; capture and replay
never allocate, map or exchange anything.

Fallback policy (explicit, logged once per workspace and reason): a call with
more rows than ``max_rows`` runs the collective path of
:mod:`torch_sdcp.collective` (the default, ``rows_fallback=True``; with
``rows_fallback=False`` such a call is an error naming the input), and so does
every call of a workspace whose group cannot use peer memory when it was
created with ``fallback=True``. Nothing falls back as error recovery.

One caller at a time: the signalling protocol assumes that a workspace's calls
are ordered (docs/PROTOCOL.md). A call from a second stream while the first
still runs a call is an error, and so is a call from a second thread while
another thread is inside a call: either aborts the workspace on every rank
(this rank's calls would no longer pair with its peers'); switching streams
or threads when the first is idle (for example eager warm-up, then capture on a side stream) is fine. A
workspace that was captured in a CUDA graph cannot be resized: the graph keeps
its addresses. A closed workspace refuses every call.

Every wait on a peer is bounded by ``timeout_s`` (default
``DEFAULT_TIMEOUT_S`` = 300 s, or the environment variable ``SDCP_TIMEOUT_S``),
creation and teardown included. A workspace dropped without ``close()`` is
released locally when it is garbage-collected (no collective runs then).

Modules: ``base`` (PeerWorkspace: creation, resize, close, the family
hooks), ``_call`` (CallState, the owner of a workspace's calls: the call
guard, the path of a call, failing, poisoning), ``_host`` (what the parts of a call see of each
other, as protocols), ``_guard`` (the
guard of a call method, the arguments it keeps), ``_void`` (void calls), ``_notes`` (the notes a rank leaves for
its peers), one per family
(``exchange``, ``output_lse``, ``topk``, ``query``; a family is its record in
torch_sdcp/families.py plus csrc/<family>.*,
torch_sdcp/workspaces/<family>.py and test/test_<family>*.py), ``_layout``
(WorkspaceLayout), ``_policy`` (size bounds, the group, the rows
of a void call), ``_collective_path`` (the ranks' agreement on a call over max_rows, and
its void when the peers took the peer path) and ``_lifetime`` (the finalizer, the fork handler).
"""

from torch_sdcp.peer.timeout import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S, TIMEOUT_ENV
from torch_sdcp.workspaces._layout import WorkspaceKind, WorkspaceLayout, workspace_layout
from torch_sdcp.workspaces._policy import MAX_REGION_BYTES
from torch_sdcp.workspaces.base import PeerWorkspace, VoidedCallError

# Every family's workspace class, one per record of torch_sdcp/families.py, written out so that type
# checkers see them (test_family_table.py holds them equal to the records).
from torch_sdcp.workspaces.exchange import ExchangeWorkspace
from torch_sdcp.workspaces.output_lse import OutputLSEWorkspace
from torch_sdcp.workspaces.query import QueryWorkspace
from torch_sdcp.workspaces.topk import TopKWorkspace

__all__ = [
    "DEFAULT_TIMEOUT_S", "MAX_REGION_BYTES", "MAX_TIMEOUT_S", "MIN_TIMEOUT_S", "TIMEOUT_ENV",
    "PeerWorkspace", "VoidedCallError", "WorkspaceKind", "WorkspaceLayout", "workspace_layout",
    "ExchangeWorkspace", "OutputLSEWorkspace", "TopKWorkspace", "QueryWorkspace",
]
