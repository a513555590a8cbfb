"""The query family: the query gathered on heads, produced by the fused RoPE/FP8 kernel or as given
(csrc/query.*)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import collective, ops
from torch_sdcp._checks import arg_error, check, check_dim
from torch_sdcp.families import QUERY
from torch_sdcp.workspaces._guard import call_method
from torch_sdcp.workspaces._policy import leading_rows, placeholder_tag, refuse_overlap, validate_size_param
from torch_sdcp.workspaces.base import CallRefused, PeerWorkspace, VoidedCallError


def _validate_query_inputs(ql_nope: object, q_pe: object) -> None:
    check_dim(ql_nope, "ql_nope", 3, "[T, H, nope]")
    if not isinstance(q_pe, Tensor):
        raise arg_error("q_pe", "a Tensor", type(q_pe).__name__)


class QueryWorkspace(PeerWorkspace):
    """Query boundary: the fused RoPE/FP8 producer stores this rank's head shard
    straight into every peer's memory; the gathered query is
    ``[T, N*H_loc, nope+rope]`` (head ``src*H_loc + h``) on every rank.

    Three ways to use it: ``gather`` returns a fresh tensor (safe anywhere,
    torch.compile included); ``gather_view`` returns a zero-copy view of this
    rank's inbox, valid until ``release()``; ``all_gather_heads`` gathers a
    query produced elsewhere (RoPE already applied, maybe quantised; no
    producer), for example vLLM's.

    Data-as-flag (docs/PROTOCOL.md, version 4). ``gather`` and
    ``all_gather_heads`` use two rotating buffers of peer entries (a rank's own
    heads go straight into the result). The view is one buffer at a fixed
    address (a CUDA graph captures its reader with it) in the final layout: no
    producer stores the next view call's query into it before this rank's
    ``release()`` has re-filled the rows that were read and said so, so a late
    reader never sees an overwritten view. Every non-NaN value arrives
    bit-exact; an aligned 4-byte word of all-ones bytes (a NaN) arrives as the
    canonical NaN word.

    ``dtype``: bf16 or float8_e4m3fn for the producer; ``all_gather_heads``
    also moves fp16, fp32 and float8_e5m2 (every dtype whose all-ones element
    is NaN). ``rope_dim=0`` makes a workspace for ``all_gather_heads`` only
    (heads of ``nope_dim`` elements).

    Physical memory per rank: 4 KiB control + max_rows x N x local_heads x
    (nope + rope) x element size (the view) + 2 x max_rows x (N - 1) x
    local_heads x (nope + rope) x element size (the buffers) + 64 KiB tail,
    granularity-rounded.
    """

    family = QUERY
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: dist.ProcessGroup | None, max_rows: int, local_heads: int, nope_dim: int = 512,
                 rope_dim: int = 64, dtype: torch.dtype = torch.float8_e4m3fn, rope_style: str = "interleaved",
                 **kwargs):
        check(dtype in ops.QUERY_GATHER_DTYPES, "dtype", f"one of {ops.QUERY_GATHER_DTYPES}", dtype)
        ops.rope_is_neox(rope_style)
        validate_size_param(max_rows, "max_rows")
        validate_size_param(local_heads, "local_heads")
        validate_size_param(nope_dim, "nope_dim")
        if not (type(rope_dim) is int and rope_dim == 0):  # 0: a workspace for all_gather_heads only
            check(validate_size_param(rope_dim, "rope_dim") % 2 == 0, "rope_dim", "an even value", rope_dim)
        self.dtype, self.rope_style = dtype, rope_style
        self.local_heads = local_heads
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self._open_view: Tensor | None = None
        self._inbox_view: Tensor | None = None
        self._view_published = False  # the open view is rows of the inbox (not a collective-path result)
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [max_rows, local_heads, nope_dim + rope_dim, elem], **kwargs)

    @property
    def inbox(self) -> Tensor | None:
        """This rank's whole inbox, the view buffer [max_rows, N*H_loc,
        nope+rope] (None in collective mode). Read it only between
        gather_view() and release(), and only the rows that gather_view()
        returned (the rest holds the sentinel)."""
        self._calls.require_open(self, "inbox")  # a clear error after close()
        if self.arena is None:
            return None
        width = self.nope_dim + self.rope_dim
        elem = torch.empty((), dtype=self.dtype).element_size()
        raw = self.arena.local_view(torch.uint8, (self.max_rows, self.world_size * self.local_heads, width * elem),
                                    self.layout.data_offset + self.part("inbox"))
        return raw.view(self.dtype)

    def _require_resizable(self) -> None:
        if self._open_view is not None:
            raise RuntimeError("torch_sdcp: QueryWorkspace.resize: a view from gather_view() is still open; "
                               "release() it first")

    def _release(self, barrier: bool, why: str) -> None:
        """As PeerWorkspace._release; an open view becomes invalid."""
        self._open_view = self._inbox_view = None
        self._view_published = False
        super()._release(barrier, why)

    def _require_no_open_view(self, what: str) -> None:
        """Inside the call guard: the refusal poisons and aborts the workspace
        on every rank. Neither refusing alone (this rank would be a call
        behind its peers: every later call mis-paired, silently) nor a void
        call is safe: a void placeholder must publish into the peers' view
        inboxes and release this rank's own, whose rows the caller still
        reads (the producers may store the next view call's query only after
        that release)."""
        if self._open_view is not None:
            raise RuntimeError(f"torch_sdcp: QueryWorkspace.{what} on rank {self.rank}: the view returned by "
                               "the last gather_view() is still open; call release() once its reader is done, "
                               "before producing the next query (the workspace is aborted on every rank: "
                               "this rank would be a call behind its peers)")

    def void_placeholder(self, what, arguments, rows=None):
        """A void gather, gather_view or all_gather_heads: the rows of the
        call's query, zeros, the call's tag (a void view is published and
        released at once: the caller never got it)."""
        if rows is None:
            rows = leading_rows((arguments.get("q" if what == "all_gather_heads" else "ql_nope"), 3))
        if rows is None or rows > self.max_rows:
            return None
        device, heads, tag = self.device, self.local_heads, placeholder_tag(arguments)
        if what == "all_gather_heads":
            q = torch.zeros(rows, heads, self.nope_dim + self.rope_dim, dtype=self.dtype, device=device)
            return lambda: ops.query_all_gather_heads(q, self.peer_handle, tag=tag)
        if what not in ("gather", "gather_view") or self.rope_dim == 0:
            return None
        scaled = arguments.get("q_scale") is not None
        if scaled and self.dtype != torch.float8_e4m3fn:
            return None  # no such call: the peers' op refuses it too
        nope = torch.zeros(rows, heads, self.nope_dim, dtype=torch.bfloat16, device=device)
        pe = torch.zeros(rows, heads, self.rope_dim, dtype=torch.bfloat16, device=device)
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
        cache = torch.zeros(1, self.rope_dim, device=device)
        scale = torch.ones(1, device=device) if scaled else None
        if what == "gather":
            return lambda: ops.query_gather(nope, pe, positions, cache, scale, self.peer_handle,
                                            rope_style=self.rope_style, out_dtype=self.dtype, tag=tag)
        inbox = self._inbox_view if self._inbox_view is not None else self.inbox

        def publish_and_release() -> None:
            ops.query_publish(nope, pe, positions, cache, scale, self.peer_handle, rope_style=self.rope_style,
                              out_dtype=self.dtype, tag=tag)
            ops.query_release(inbox[:rows], self.peer_handle)

        return publish_and_release

    @call_method
    def gather(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
               q_scale: Tensor | None = None, *, tag: int | None = None) -> Tensor:
        """A fresh gathered query [T, N*H_loc, nope+rope] (head = src*H_loc + h),
        bit-identical to producing locally then all_gather on heads. ``tag``:
        the call tag (None, or an int in [0, 2**23 - 1), e.g. the layer
        index), compared by every peer."""
        with self._call("gather"):
            if not torch.compiler.is_compiling():
                self._require_no_open_view("gather")
            return self._gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, tag)

    def _gather(self, ql_nope, q_pe, positions, cos_sin_cache, q_scale, tag) -> Tensor:
        _validate_query_inputs(ql_nope, q_pe)
        self._require_on_device(ql_nope=ql_nope, q_pe=q_pe, positions=positions, cos_sin_cache=cos_sin_cache,
                            q_scale=q_scale)
        if self._take_path(ql_nope.shape[0], "ql_nope", tag, self._header_text(q_scale)):
            return ops.query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.peer_handle,
                                    rope_style=self.rope_style, out_dtype=self.dtype, tag=tag)
        return self._collective_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)

    def _header_text(self, q_scale: object) -> str:
        """What a producer's call header carries besides rows, dtype and tag, as a call mismatch
        names it (csrc/query.cpp query_flags_text)."""
        return f"{self.rope_style} RoPE, {'without' if q_scale is None else 'with'} q_scale"

    def _collective_gather(self, ql_nope, q_pe, positions, cos_sin_cache, q_scale) -> Tensor:
        """The collective path of gather and gather_view, once the call took it."""
        return collective.query_all_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale,
                                           neox=self.rope_style == "neox", out_dtype=self.dtype, group=self.group)

    @call_method
    def gather_view(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                    q_scale: Tensor | None = None, *, tag: int | None = None) -> Tensor:
        """Zero-copy: as gather, but returns a view [T, N*H_loc, nope+rope] of
        this rank's inbox. The view stays valid until ``release()``, which the
        caller must call after the last kernel that reads it has been enqueued
        (same stream) and before the next gather or gather_view. Eager and CUDA
        graphs only: under torch.compile use ``gather``. A call with more rows
        than max_rows takes the collective path and returns a fresh tensor
        (release() is still required, and does nothing on the device).
        ``tag`` as for gather (``release()`` carries no call header, so no
        tag)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("torch_sdcp: QueryWorkspace.gather_view is not traceable by torch.compile (its "
                               "result aliases workspace memory); use gather() inside compiled regions")
        try:
            return self._gather_view(ql_nope, q_pe, positions, cos_sin_cache, q_scale, tag)
        except VoidedCallError:  # the caller never gets this view: release it, as every peer releases its own
            if self._open_view is not None:
                self.release()
            raise

    def _gather_view(self, ql_nope, q_pe, positions, cos_sin_cache, q_scale, tag) -> Tensor:
        with self._call("gather_view"):
            self._require_no_open_view("gather_view")
            _validate_query_inputs(ql_nope, q_pe)
            self._require_on_device(ql_nope=ql_nope, q_pe=q_pe, positions=positions, cos_sin_cache=cos_sin_cache,
                                q_scale=q_scale)
            rows = ql_nope.shape[0]
            if self._take_path(rows, "ql_nope", tag, self._header_text(q_scale)):
                ops.query_publish(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.peer_handle,
                                  rope_style=self.rope_style, out_dtype=self.dtype, tag=tag)
                inbox = self._inbox_view if self._inbox_view is not None else self.inbox
                assert inbox is not None  # peer memory: the arena is there
                self._inbox_view = inbox
                view = inbox[:rows]
                self._view_published = True
            else:  # the path is taken: not _gather, which would take it (and agree on it) again
                view = self._collective_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)
            self._open_view = view
            return view

    @call_method
    def release(self) -> None:
        """The reader of the last gather_view() is done: this rank's view rows
        are re-filled and the producers told that they may store the next view
        call's query. Enqueued on the current stream (capturable)."""
        with self._call("release"):
            if self._open_view is None:
                raise CallRefused(f"torch_sdcp: QueryWorkspace.release on rank {self.rank}: no view is open "
                                  "(gather_view() was not called, or release() was already called)")
            view, self._open_view = self._open_view, None
            published, self._view_published = self._view_published, False
            if published:  # a view of 0 rows too: its release is the call that pairs with the peers'
                self._calls.require_ordered_stream(self)
                ops.query_release(view, self.peer_handle)  # re-fills the rows the view had

    @call_method
    def all_gather_heads(self, q: Tensor, out: Tensor | None = None, *, tag: int | None = None) -> Tensor:
        """A query produced elsewhere, ``q [T, H_loc, nope+rope]`` of the
        workspace dtype on every rank -> ``[T, N*H_loc, nope+rope]``, head
        ``src*H_loc + h``: ``all_gather(q, dim=1)`` with every non-NaN value
        bit-exact (an aligned 4-byte word of all-ones bytes, a NaN, arrives as
        the canonical NaN word). Written into ``out`` when given (contiguous,
        that shape and dtype, for example a view of larger storage), which is
        returned. Rows above max_rows take the collective path. ``tag`` as for
        gather."""
        with self._call("all_gather_heads"):
            if not torch.compiler.is_compiling():
                self._require_no_open_view("all_gather_heads")
            check_dim(q, "q", 3, "[T, H_loc, W]")
            if q.dtype != self.dtype:
                raise arg_error("q", f"dtype {self.dtype} (the dtype of this QueryWorkspace)", f"dtype {q.dtype}")
            if out is not None and not isinstance(out, Tensor):
                raise arg_error("out", "a Tensor or None", type(out).__name__)
            self._require_on_device(q=q, out=out)
            if out is not None and not torch.compiler.is_compiling():
                refuse_overlap({"out": out}, {"q": q})
            if self._take_path(q.shape[0], "q", tag):
                if out is None:
                    return ops.query_all_gather_heads(q, self.peer_handle, tag=tag)
                ops.query_all_gather_heads_out(q, self.peer_handle, out, tag=tag)
                return out
            return collective.all_gather_heads(q, self.group, out)

