"""The one fallback decision of a call: peer memory or the collective path,
and why. The workspaces and the engine faces both ask it and act on its
answer (the workspace runs ``torch_sdcp.collective``, a face runs the
engine's own function); nothing else decides.

Nothing falls back as error recovery: the reasons below are the only ones.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol


class Why(str, enum.Enum):
    """Why a call does not take peer memory."""

    #: No workspace exists for the call (a face only: not prepared).
    NO_WORKSPACE = "no-workspace"
    #: The workspace is in collective mode (its group failed the peer-memory gate at creation).
    PEER_UNAVAILABLE = "peer-unavailable"
    #: The call has more rows than the workspace's ``max_rows``.
    ROWS_OVER_BOUND = "rows-over-bound"


class Route(NamedTuple):
    """``peer`` True: the call takes peer memory (``why`` None). False: it
    takes the collective path for ``why``."""

    peer: bool
    why: Why | None = None


class Moded(Protocol):
    """What the decision reads of a workspace bounded in bytes (the exchange)."""

    @property
    def peer(self) -> bool: ...


class Routed(Moded, Protocol):
    """What the decision reads of a workspace bounded in rows."""

    @property
    def max_rows(self) -> int: ...


PEER = Route(True)


def route_without_rows(workspace: Moded | None) -> Route:
    """The path of a call that no rows bound applies to: the exchange's, whose
    bound is in bytes (a call over its ``max_bytes`` is an argument error of
    its op, never a reason to fall back), so only the workspace's mode decides."""
    if workspace is None:
        return Route(False, Why.NO_WORKSPACE)
    if not workspace.peer:
        return Route(False, Why.PEER_UNAVAILABLE)
    return PEER


def route(workspace: Routed | None, rows: int) -> Route:
    """The path of a call of ``rows`` rows on ``workspace`` (None: none exists).
    Written out, not over ``route_without_rows``: it runs on every call."""
    if workspace is None:
        return Route(False, Why.NO_WORKSPACE)
    if not workspace.peer:
        return Route(False, Why.PEER_UNAVAILABLE)
    if rows > workspace.max_rows:
        return Route(False, Why.ROWS_OVER_BOUND)
    return PEER
