"""The top-K family: the global top-k merge of the ranks' candidates (csrc/topk.*)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import collective, ops
from torch_sdcp._checks import arg_error, check_dim
from torch_sdcp.families import TOPK
from torch_sdcp.workspaces._guard import call_method
from torch_sdcp.workspaces._policy import leading_rows, placeholder_tag, validate_size_param
from torch_sdcp.workspaces.base import PeerWorkspace


class TopKWorkspace(PeerWorkspace):
    """Top-K boundary: each owner sorts its candidates once and pushes its best
    min(C, k) keys into every peer's buffer; every consumer merges the lists
    as they land with its own (identical result on every rank).

    Data-as-flag (docs/PROTOCOL.md): the buffers start as the sentinel (every
    byte 0xFF), which no 64-bit selection key can take; the consumer writes it
    back as it takes each list. Every call carries a call header, so ranks
    whose calls differ raise on every rank, and an error inside a call
    poisons the workspace on every rank.

    Physical memory per rank: 4 KiB control + 2 buffers x ((N - 1) x max_rows
    x min(C, k) x 8 bytes + the call headers) + 64 KiB tail, granularity-rounded
    (DCP2, 128 rows, C = k = 2048: 6 MiB with a 2 MiB granularity).
    """

    family = TOPK
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: dist.ProcessGroup | None, max_rows: int, k: int,
                 candidates_per_rank: int | None = None, **kwargs):
        validate_size_param(max_rows, "max_rows")
        self.k = validate_size_param(k, "k")
        self.candidates_per_rank = validate_size_param(k if candidates_per_rank is None else candidates_per_rank,
                                                    "candidates_per_rank")
        super().__init__(group, [max_rows, self.candidates_per_rank, self.k], **kwargs)

    def void_placeholder(self, what, arguments, rows=None):
        """A void merge: the rows of ``scores``, no candidate (score -inf, id -1), the call's tag."""
        if rows is None:
            rows = leading_rows((arguments.get("scores"), 2), (arguments.get("ids"), 2))
        if rows is None or rows > self.max_rows:
            return None
        scores = torch.full((rows, self.candidates_per_rank), -math.inf, device=self.device)
        ids = torch.full((rows, self.candidates_per_rank), -1, dtype=torch.int32, device=self.device)
        tag = placeholder_tag(arguments)
        return lambda: ops.topk_merge(scores, ids, self.peer_handle, self.k, tag=tag)

    @call_method
    def merge(self, scores: Tensor, ids: Tensor, *, tag: int | None = None) -> Tensor:
        """scores [T, C] fp32, global ids [T, C] int32 (-1: none) -> the global
        top-k ids [T, k] int32 in selection order, identical on every rank.
        ``tag``: the call tag (None, or an int in [0, 2**23 - 1), e.g. the
        layer index), compared by every peer."""
        with self._call("merge"):
            check_dim(scores, "scores", 2, "[T, C]")
            if not isinstance(ids, Tensor):
                raise arg_error("ids", "a Tensor", type(ids).__name__)
            self._require_on_device(scores=scores, ids=ids)
            if self._take_path(scores.shape[0], "scores", tag):
                return ops.topk_merge(scores, ids, self.peer_handle, self.k, tag=tag)
            return collective.topk_all_gather_merge(scores, ids, self.k, group=self.group)

