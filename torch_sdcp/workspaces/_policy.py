"""The policies and argument checks that every workspace family shares: the
timeout of a wait on a peer, the bound of a size parameter, the process group,
the tensors a call takes, and the agreement of the ranks on the collective
path of a call with more rows than ``max_rows``."""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp._checks import arg_error, check, check_positive_int
from torch_sdcp.peer.collectives import AgreementAbandoned

if TYPE_CHECKING:
    from torch_sdcp.workspaces.base import PeerWorkspace

#: Bound of every wait on a peer when neither ``timeout_s`` nor
#: ``SDCP_TIMEOUT_S`` says otherwise: minutes, because engines skew by many
#: seconds at start (compilation, JIT, capture) and a false timeout is fatal.
DEFAULT_TIMEOUT_S = 300.0
#: The environment variable that overrides DEFAULT_TIMEOUT_S.
TIMEOUT_ENV = "SDCP_TIMEOUT_S"
#: Accepted range of a timeout, in seconds (1 ms to 24 h).
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 86400.0
#: Bound of one rank's region, in bytes (``kMaxRegionBytes`` in csrc/sdcp.h);
#: no single size parameter may exceed it either.
MAX_REGION_BYTES = 1 << 40


def check_timeout(value: Any, arg: str = "timeout_s") -> float:
    """``value`` as a float number of seconds in [MIN_TIMEOUT_S, MAX_TIMEOUT_S]:
    a real number (not a string, not a bool), finite."""
    check(isinstance(value, numbers.Real) and not isinstance(value, bool), arg,
          "a number of seconds (an int or a float)", f"{type(value).__name__} {value!r}")
    seconds = float(value)
    check(math.isfinite(seconds) and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S, arg,
          f"a finite number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]", repr(value))
    return seconds


def default_timeout_s() -> float:
    """``SDCP_TIMEOUT_S`` when set (checked like ``timeout_s``), else
    DEFAULT_TIMEOUT_S. Read at every creation, so a bad value is reported by
    the workspace that would use it, not at import."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        return check_timeout(float(raw), TIMEOUT_ENV)
    except ValueError:
        raise ValueError(f"torch_sdcp: environment variable {TIMEOUT_ENV}: expected a finite number of seconds "
                         f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}], got {raw!r}") from None


def check_size_param(value: Any, arg: str) -> int:
    """A size parameter of a workspace: an int (not a bool), >= 1 and at most
    MAX_REGION_BYTES (a larger one cannot fit in a region, and larger than
    int64 cannot reach the C++ layout)."""
    check_positive_int(value, arg)
    check(value <= MAX_REGION_BYTES, arg, f"a positive int of at most {MAX_REGION_BYTES} (2**40, the bound of a "
          "workspace region in bytes)", repr(value))
    return value


def resolve_group(group: object) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, this rank in it, its world size), or an error naming 'group':
    None (the default group) or a ProcessGroup this process is a member of."""
    if not dist.is_initialized():
        raise RuntimeError("torch_sdcp: workspaces are created collectively: initialise torch.distributed first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise arg_error("group", f"a process group that contains this process (global rank {dist.get_rank()})",
                            "the placeholder that new_group() returns to a process outside the group")
        hint = (" (for a vLLM GroupCoordinator, pass its cpu_group or device_group)"
                if hasattr(group, "device_group") else "")
        raise arg_error("group", f"a torch.distributed ProcessGroup or None{hint}",
                        f"{type(group).__name__} {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise arg_error("group", f"a process group that contains this process (global rank {dist.get_rank()})",
                        "a group it is not a member of")
    return group, rank, dist.get_world_size(group)


def require_tensor(t: object, arg: str, dims: int, names: str) -> None:
    """A Tensor of ``dims`` dimensions. The checks of a call build their
    message only when they fail, so that torch.compile traces none of it."""
    if not isinstance(t, Tensor):
        raise arg_error(arg, "a Tensor", type(t).__name__)
    if t.dim() != dims:
        raise arg_error(arg, f"{dims} dimensions {names}", f"{t.dim()} (shape {list(t.shape)})")


def leading_rows(*candidates: tuple[object, int]) -> int | None:
    """The rows (dim 0) of the first of a call's ``(tensor, dims)`` that is a
    tensor of those dimensions, or None: what a void call's placeholder needs
    to stand for the call (a tensor of other dimensions says nothing)."""
    for t, dims in candidates:
        if isinstance(t, Tensor) and t.dim() == dims:
            return int(t.shape[0])
    return None


#: Calls whose collective paths run the same collectives: alike for the agreement on that path.
_SAME_COLLECTIVES = {"combine_out": "combine", "gather_view": "gather"}


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "the peers"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _peer_failure(ws: PeerWorkspace) -> str | None:
    """Why the peers of ``ws`` will not come (a peer aborted it, or exited), or None."""
    if ws.handle is None:
        return None
    try:
        torch.ops.sdcp.workspace_check(ws.handle)
    except RuntimeError as e:
        return str(e)
    return None


def agree_collective_path(ws: PeerWorkspace, rows: int) -> None:
    """Before the collectives of a call with more rows than max_rows, every
    rank says on the group's store that it takes the collective path (with
    which call and how many rows) and waits, within timeout_s, for every peer
    to say the same: a rank that took the peer path, or a different call, is
    named on every rank and no rank enters a collective, so none is left
    waiting in one (docs/PROTOCOL.md "Failure behaviour")."""
    arena = ws.arena
    if arena is None or ws.world_size == 1 or torch.compiler.is_compiling():
        return
    what = ws._caller[2] if ws._caller is not None else "call"
    ws._collective_calls += 1
    where = (f"torch_sdcp: {type(ws).__name__} on rank {ws.rank}: {what}() has {rows} rows > max_rows = "
             f"{ws.max_rows} on this rank and takes the collective path")
    mine = f"{_SAME_COLLECTIVES.get(what, what)}() with {rows} rows"
    try:
        # hook: one order of these sections per group, held until the call ends (_leave)
        ws._turn = arena.collective_turn(f"collective{ws._collective_calls}", ws.timeout_s, lambda: _peer_failure(ws))
        got = arena.agree_call(f"collective{ws._collective_calls}", mine.encode(), ws.timeout_s,
                               lambda: _peer_failure(ws))
    except AgreementAbandoned as e:
        missing = _ranks(e.missing)
        if not e.mine:
            late = " before this rank came" if ws.rank in e.missing else ""
            why = f": {e.reason}" if e.reason else ""
            raise RuntimeError(f"{where}, but rank {e.by_rank} gave up on this call after {e.waited_s:.3g} s "
                               f"waiting for {missing}{late}{why}; no rank entered a collective") from None
        if e.reason is not None:
            raise RuntimeError(f"{where}; it stopped waiting for {missing} to take it: {e.reason}; no rank "
                               "entered a collective") from None
        raise RuntimeError(f"{where}, but {missing} did not take the collective path within timeout_s = "
                           f"{ws.timeout_s:g} s (took the peer path for this call, or did not call); no rank "
                           "entered a collective") from None
    if any(g != got[0] for g in got):
        sides = ", ".join(f"rank {r}: {g.decode()}" for r, g in enumerate(got))
        raise RuntimeError(f"torch_sdcp: {type(ws).__name__} on rank {ws.rank}: call mismatch on the collective "
                           f"path (more rows than max_rows = {ws.max_rows}): {sides}; no rank entered a collective")
