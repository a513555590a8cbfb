"""The exchange family: a generic peer all-gather (csrc/exchange.*)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import ops
from torch_sdcp._checks import arg_error
from torch_sdcp.workspaces._layout import WorkspaceKind
from torch_sdcp.workspaces._call import call_method
from torch_sdcp.workspaces._policy import check_size_param
from torch_sdcp.workspaces.base import PeerWorkspace


class ExchangeWorkspace(PeerWorkspace):
    """A generic peer all-gather of up to ``max_bytes`` per rank: the
    signalling primitive the boundaries are built from."""

    kind = WorkspaceKind.EXCHANGE
    PARAMS = ("max_bytes",)
    # inbox [peer][word] of tagged 64-bit words (4 payload bytes each); bytes between two peers' entries;
    # call headers [peer][4 tagged words]
    PARTS = ("inbox", "source_stride", "headers")
    POISON_ON_ERROR = True

    def __init__(self, group: dist.ProcessGroup | None, max_bytes: int, **kwargs):
        super().__init__(group, [check_size_param(max_bytes, "max_bytes")], **kwargs)

    def _placeholder(self, what, args, kwargs):
        """A void all_gather: zeros of ``x``'s shape and dtype."""
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, Tensor) or x.nbytes > self.params[0]:
            return None
        zeros = torch.zeros(x.shape, dtype=x.dtype, device=self.device)
        return lambda: ops.peer_all_gather(zeros, self.handle)

    @call_method
    def all_gather(self, x: Tensor) -> Tensor:
        """[N, *x.shape] with every rank's x, rank-major."""
        with self._call("all_gather"):
            if not isinstance(x, Tensor):
                raise arg_error("x", "a Tensor", type(x).__name__)
            self._check_devices(x=x)
            self._committed = True
            if not self.peer:
                self._refuse_poisoned()
                out = [torch.empty_like(x) for _ in range(self.world_size)]
                dist.all_gather(out, x.contiguous(), group=self.group)
                return torch.stack(out)
            return ops.peer_all_gather(x, self.handle)

