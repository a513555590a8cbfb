"""The exchange family: a generic peer all-gather (csrc/exchange.*)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import ops
from torch_sdcp._checks import arg_error
from torch_sdcp.families import EXCHANGE
from torch_sdcp.workspaces._guard import call_method
from torch_sdcp.workspaces._policy import placeholder_tag, validate_size_param
from torch_sdcp.workspaces.base import PeerWorkspace


class ExchangeWorkspace(PeerWorkspace):
    """A generic peer all-gather of up to ``max_bytes`` per rank: the
    signalling primitive the boundaries are built from."""

    family = EXCHANGE
    POISON_ON_ERROR = True

    def __init__(self, group: dist.ProcessGroup | None, max_bytes: int, **kwargs):
        super().__init__(group, [validate_size_param(max_bytes, "max_bytes")], **kwargs)

    def void_placeholder(self, what, arguments, rows=None):
        """A void all_gather: zeros of ``x``'s shape and dtype, the call's tag
        (the exchange has no rows bound: ``rows`` is never given)."""
        x = arguments.get("x")
        if not isinstance(x, Tensor) or x.nbytes > self.params[0]:
            return None
        zeros = torch.zeros(x.shape, dtype=x.dtype, device=self.device)
        tag = placeholder_tag(arguments)
        return lambda: ops.peer_all_gather(zeros, self.peer_handle, tag=tag)

    @call_method
    def all_gather(self, x: Tensor, *, tag: int | None = None) -> Tensor:
        """[N, *x.shape] with every rank's x, rank-major. ``tag``: the call
        tag (None, or an int in [0, 2**23 - 1), e.g. the layer index), compared
        by every peer."""
        with self._call("all_gather"):
            if not isinstance(x, Tensor):
                raise arg_error("x", "a Tensor", type(x).__name__)
            self._require_on_device(x=x)
            if self._take_path(None, "x", tag):  # bounded in bytes: the op refuses more than max_bytes
                return ops.peer_all_gather(x, self.peer_handle, tag=tag)
            out = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(out, x.contiguous(), group=self.group)
            return torch.stack(out)

