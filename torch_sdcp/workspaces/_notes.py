"""The notes a rank leaves for its peers on the group's store (its error, before its abort words
go out; "left" when it leaves a workspace), and a peer's note added to an error that names it."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_sdcp.workspaces._host import CallHost

logger = logging.getLogger("torch_sdcp")

# How the C++ error of a call that met a peer's abort word names the peer.
_PEER_ABORTED = re.compile(r"peer (\d+) aborted")


def leave_note(host: CallHost, text: str) -> None:
    """Best effort, before the abort words go out: this rank's error, for
    the peers' errors (a store that is gone with a peer is no error here)."""
    if host.arena is not None:
        try:
            host.arena.post_note(text)
        except Exception as e:
            logger.info("torch_sdcp: %s on rank %d: could not leave the error for the peers (%s)",
                        type(host).__name__, host.rank, e)


def with_peer_note(host: CallHost, message: str) -> str:
    """``message`` with the error that the aborting peer it names left
    (``peer r aborted: ...`` -> ``... [rank r: ValueError: ...]``)."""
    found = _PEER_ABORTED.search(message)
    if found is None or host.arena is None:
        return message
    try:
        note = host.arena.peer_note(int(found.group(1)))
    except Exception:
        return message
    return message if note is None else f"{message} [rank {found.group(1)}: {note}]"
