"""The policies and argument checks that every workspace family shares: the
bound of a size parameter, the process group and the rows and call tag a void
call's placeholder stands for (the timeout of a wait on a peer is the peer
layer's: torch_sdcp.peer.timeout; a call's tensors are checked with
torch_sdcp._checks, in the words of csrc)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

from torch_sdcp._checks import arg_error, call_tag, check, check_positive_int

#: Bound of one rank's region, in bytes (``kMaxRegionBytes`` in csrc/sdcp.h);
#: no single size parameter may exceed it either.
MAX_REGION_BYTES = 1 << 40


def validate_size_param(value: Any, arg: str) -> int:
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


def placeholder_tag(arguments: Mapping[str, Any]) -> int | None:
    """The call tag a void call's placeholder carries: the call's own when it
    is a valid tag, so that the peers still compare it (a skipped or reordered
    call is named, not voided); else None. An untagged placeholder pairs with
    any tag (csrc/dataflag.h header_dtype_difference): a call refused for its
    tag still pairs with the peers' call, void."""
    tag = arguments.get("tag")
    try:
        return None if call_tag(tag) < 0 else tag
    except ValueError:
        return None


def leading_rows(*candidates: tuple[object, int]) -> int | None:
    """The rows (dim 0) of the first of a call's ``(tensor, dims)`` that is a
    tensor of those dimensions, or None: what a void call's placeholder needs
    to stand for the call (a tensor of other dimensions says nothing)."""
    for t, dims in candidates:
        if isinstance(t, Tensor) and t.dim() == dims:
            return int(t.shape[0])
    return None


def _byte_span(t: Tensor) -> tuple[int, int] | None:
    """The addresses [first, end) of the bytes ``t`` may touch, or None when it touches none. The
    tensors of one call are on one device, where two allocations never share an address."""
    if t.numel() == 0:
        return None
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + t.nbytes
    size = t.element_size()
    return first, first + int(sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * size + size


def refuse_overlap(outputs: Mapping[str, object], inputs: Mapping[str, object]) -> None:
    """An output that shares memory with an input, or with another output, is an argument error,
    raised before anything is published (as torch's own ``out=`` ops refuse it): a kernel that
    writes into what it still reads returns a wrong result. Tensors only (None and non-tensors
    are checked elsewhere); under tracing nothing is checked."""
    spans: dict[str, tuple[int, int]] = {}
    for name, t in (*outputs.items(), *inputs.items()):
        span = _byte_span(t) if isinstance(t, Tensor) and not t.is_meta else None
        if span is not None:
            spans[name] = span
    written = [n for n in outputs if n in spans]
    for i, out in enumerate(written):
        first, end = spans[out]
        for other in [*written[i + 1:], *(n for n in inputs if n in spans)]:
            f, e = spans[other]
            if f < end and first < e:
                raise arg_error(out, f"memory that no input and no other output of the call uses (it is "
                                f"written while '{other}' is read or written)", f"a tensor that overlaps '{other}'")
