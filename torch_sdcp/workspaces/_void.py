"""Void calls (docs/PROTOCOL.md "Void calls"): a call whose arguments failed
their checks before this rank published anything takes part with a
placeholder marked void, so that every rank stays in step; a peer's call that
met the void mark raises ``VoidedCallError``."""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING

import torch

from torch_sdcp.workspaces._guard import named_arguments
from torch_sdcp.workspaces._notes import leave_note

if TYPE_CHECKING:
    from torch_sdcp.workspaces._host import CallHost, CallSteps

logger = logging.getLogger("torch_sdcp")


class VoidedCallError(RuntimeError):
    """A peer voided a call that this rank made (docs/PROTOCOL.md "Void
    calls"): that call's result is not valid here; the workspace is usable,
    and the next calls pair as before."""


def _name(host: CallHost) -> str:
    return type(host).__name__


def void_call(calls: CallSteps, host: CallHost, what: str, error: BaseException) -> bool:
    """The call failed its argument checks before this rank published
    anything (in Python, or in its peer op): make its placeholder, marked
    void, so that every rank stays in step and the peers learn of this
    rank's error for that call only. True when done (the workspace is not
    poisoned); False to poison as before."""
    kept = calls.arguments
    if (not host.peer or not calls.poison_on_error or host.handle is None or kept is None
            or kept[0] != threading.get_ident() or calls.committed):
        return False
    if host.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # a graph would replay the void mark
    try:
        placeholder = host.void_placeholder(what, named_arguments(*kept[1:]), rows=calls.void_rows)
    except Exception:
        return False
    if placeholder is None:
        return False
    calls.count_call()
    leave_note(host, f"{type(error).__name__}: {error}")  # before the void header goes out
    torch.ops.sdcp.workspace_void_next(host.handle, True)
    try:
        placeholder()
        if host.device.type == "cuda":  # its kernel's outcome, before this rank says it is usable
            torch.cuda.current_stream(host.device).synchronize()
        torch.ops.sdcp.workspace_check(host.handle)
    except Exception as e:
        logger.info("torch_sdcp: %s on rank %d: the void call of %s() failed (%s)",
                    _name(host), host.rank, what, e)
        return False
    finally:
        torch.ops.sdcp.workspace_void_next(host.handle, False)
    torch.ops.sdcp.workspace_take_void(host.handle)  # a peer voided it too: this rank reports its own error
    return True

def voided_error(host: CallHost, what: str, void_word: ctypes.c_uint64 | None) -> VoidedCallError | None:
    """The error of the first void call that this rank's calls met since
    the last report (taken: reported once), or None."""
    if void_word is None or not void_word.value:
        return None
    word = int(torch.ops.sdcp.workspace_take_void(host.handle))
    if word == 0:
        return None
    src, call = (word & 0xFFFFFFFF) - 1, word >> 32
    note = None
    if host.arena is not None:
        try:
            note = host.arena.peer_note(src)
        except Exception:
            note = None
    return VoidedCallError(
        f"torch_sdcp: {_name(host)} on rank {host.rank}: {what}(): rank {src} voided call {call} "
        "(its arguments failed their checks before it sent anything, so it took part with a placeholder): "
        "that call's result is not valid on this rank; the workspace stays usable"
        + ("" if note is None else f" [rank {src}: {note}]"))
