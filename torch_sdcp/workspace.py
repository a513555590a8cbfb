"""Workspaces: one peer arena per boundary, registered with the C++ ops under an
integer handle. Created collectively before any capture; capture and replay
never allocate, map or exchange anything.

Fallback policy (explicit, logged once per workspace and reason): a call with
more rows than ``max_rows``, or a workspace whose group cannot use peer memory
(created with ``fallback=True``), runs the collective path of
:mod:`torch_sdcp.collective` instead. Nothing falls back as error recovery.

One stream at a time: the signalling protocol assumes that a workspace's calls
are ordered (docs/PROTOCOL.md). A call from a second stream while the first
still runs a call is an error; switching streams when the first is idle (for
example eager warm-up, then capture on a side stream) is fine. A workspace that
was captured in a CUDA graph cannot be resized: the graph keeps its addresses.
"""

from __future__ import annotations

import enum
import logging
import os
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import _registry, collective, ops
from torch_sdcp._checks import check, check_positive_int
from torch_sdcp.peer import PeerArena

logger = logging.getLogger("torch_sdcp")

DEFAULT_TIMEOUT_S = float(os.environ.get("SDCP_TIMEOUT_S", "5"))


class WorkspaceKind(enum.IntEnum):
    """The workspace families; the values are those of the C++ side
    (``WorkspaceKind`` in csrc/sdcp.h)."""

    EXCHANGE = 0
    OUTPUT_LSE = 1
    TOPK = 2
    QUERY = 3


class WorkspaceLayout(NamedTuple):
    """One rank's region as the C++ side lays it out (csrc/sdcp.h), identical
    on every rank: control (an epoch and the flags of each of ``blocks`` flag
    blocks) in ``[0, control_bytes)``, then ``slots`` data slots of
    ``slot_bytes`` from ``data_offset``; ``region_bytes`` includes the tail pad,
    before granularity rounding. ``part_offsets`` are the family's values inside
    one slot; each workspace class names them in ``PARTS``."""

    blocks: int
    control_bytes: int
    data_offset: int
    slots: int
    slot_bytes: int
    region_bytes: int
    part_offsets: Tuple[int, ...]


def workspace_layout(kind: WorkspaceKind, params: Sequence[int], world_size: int) -> WorkspaceLayout:
    """``torch.ops.sdcp.workspace_layout``, whose flat list follows the field
    order of ``WorkspaceLayout``, with its values named."""
    values = torch.ops.sdcp.workspace_layout(int(kind), list(params), world_size)
    fixed = len(WorkspaceLayout._fields) - 1
    return WorkspaceLayout(*values[:fixed], tuple(values[fixed:]))


class PeerWorkspace:
    """Base class: one arena of ``kind`` laid out by the C++ layout for
    ``params``, mapped into every rank of ``group``.

    ``backend``: "cuda", "host" or "auto". ``timeout_s`` bounds every wait of
    the device (or host) signals; a timeout names rank, peer, slot and epoch.
    With ``fallback=True`` a group that fails the peer-memory capability gate
    gets a workspace in collective mode instead of an error (all ranks agree:
    the gate is collective).
    """

    kind: WorkspaceKind
    #: What ``params`` hold, in order (the C++ parameters of ``kind``).
    PARAMS: Tuple[str, ...] = ()
    #: What ``layout.part_offsets`` hold, in order.
    PARTS: Tuple[str, ...] = ()
    #: Data-as-flag buffers that start filled with the sentinel word.
    SENTINEL_FILLED = False

    def __init__(self, group: Optional[dist.ProcessGroup], params: list[int], *, backend: str = "auto",
                 device: Optional[torch.device] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 allow_shared_device: bool = False, fallback: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("torch_sdcp: workspaces are created collectively: initialise torch.distributed first")
        check(timeout_s > 0, "timeout_s", "> 0", repr(timeout_s))
        self.group = group
        self._init_kwargs = dict(backend=backend, device=device, timeout_s=timeout_s,
                                 allow_shared_device=allow_shared_device, fallback=fallback)
        self._stream: Optional[torch.cuda.Stream] = None
        self._captured = False
        self.params = [int(p) for p in params]
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.handle: Optional[int] = None
        self.arena: Optional[PeerArena] = None
        self._logged: set[str] = set()
        self.layout = workspace_layout(self.kind, self.params, self.world_size)
        self.nbytes_per_rank = self.layout.region_bytes
        try:
            self.arena = PeerArena(group, self.nbytes_per_rank, backend=backend, device=device,
                                   allow_shared_device=allow_shared_device, timeout_s=max(self.timeout_s, 30.0))
        except Exception as e:  # the arena's failures are collective: every rank is here
            if not fallback:
                raise
            self._log_policy("peer-unavailable", f"peer memory unavailable ({e}); using the collective path")
            self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                     if backend != "host" and torch.cuda.is_available() else torch.device("cpu"))
            return
        self.device = self.arena.device
        self.handle = _registry.new_handle()
        torch.ops.sdcp.workspace_register(self.handle, int(self.kind), self.params, self.arena.base_address,
                                          self.arena.stride, self.rank, self.world_size, self.device,
                                          int(self.timeout_s * 1e9))
        _registry.add(self.handle, self)
        if self.SENTINEL_FILLED:
            self._fill_sentinel()

    def _fill_sentinel(self) -> None:
        """Data-as-flag buffers start as the sentinel (every byte 0xFF): each
        rank fills its own, then the group barriers before any peer may store
        into them (docs/PROTOCOL.md)."""
        size = self.layout.slots * self.layout.slot_bytes
        self.arena.local_view(torch.uint8, (size,), self.layout.data_offset).fill_(0xFF)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.arena.barrier()

    def _param_index(self, name: str) -> int:
        if name not in self.PARAMS:
            raise AttributeError(f"torch_sdcp: {type(self).__name__} has no parameter '{name}' "
                                 f"(its parameters: {', '.join(self.PARAMS)})")
        return self.PARAMS.index(name)

    def param(self, name: str) -> int:
        """The creation parameter ``name`` (one of ``PARAMS``)."""
        return self.params[self._param_index(name)]

    def part(self, name: str) -> int:
        """The layout value ``name`` (one of ``PARTS``)."""
        return self.layout.part_offsets[self.PARTS.index(name)]

    @property
    def max_rows(self) -> int:
        """Rows bound of the peer path (every family but the exchange, which is
        bounded in bytes)."""
        return self.param("max_rows")

    @property
    def peer(self) -> bool:
        """True when calls use peer memory, False in collective mode."""
        return self.handle is not None

    @property
    def physical_bytes(self) -> int:
        """Physical memory this rank owns for the workspace (granularity-rounded)."""
        return self.arena.stride if self.arena is not None else 0

    def _log_policy(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("torch_sdcp %s workspace, rank %d: %s", type(self).__name__, self.rank, message)

    def _rows_fit(self, rows: int) -> bool:
        """True when this call takes the peer path (and may use the workspace)."""
        if not self.peer:
            return False
        if rows > self.max_rows:
            self._log_policy(f"rows-{rows}", f"{rows} rows exceed max_rows={self.max_rows}; "
                             "this call takes the collective path")
            return False
        self._check_stream()
        return True

    def _check_stream(self) -> None:
        """Calls on one workspace must be ordered: refuse a second stream while
        the first still runs a call (docs/PROTOCOL.md)."""
        if self.device.type != "cuda" or torch.compiler.is_compiling():
            return
        stream = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        self._captured = self._captured or capturing
        last = self._stream
        # A capture starts from a synchronised device (torch.cuda.graph does
        # it); querying another stream during a global capture is not allowed.
        if last is not None and last != stream and not capturing and not last.query():
            raise RuntimeError(
                f"torch_sdcp: {type(self).__name__} on rank {self.rank} is used from stream "
                f"{stream.cuda_stream:#x} while stream {last.cuda_stream:#x} still runs an earlier call on it: "
                "calls on one workspace must be ordered; use one workspace per stream, or make this stream "
                "wait for the other (stream.wait_stream)")
        self._stream = stream

    def resize(self, max_rows: int) -> None:
        """Re-create the workspace for a new row bound (collective; refused
        once the workspace was captured in a CUDA graph, and where
        ``_check_resizable`` refuses)."""
        index = self._param_index("max_rows")
        self._check_resizable()
        check_positive_int(max_rows, "max_rows")
        if self._captured:
            raise RuntimeError(
                f"torch_sdcp: argument 'max_rows': cannot resize {type(self).__name__} on rank {self.rank} "
                f"to {max_rows}: it was captured in a CUDA graph, which keeps its addresses and epochs; create a "
                "new workspace and capture again")
        params = list(self.params)
        params[index] = max_rows
        self.close()
        PeerWorkspace.__init__(self, self.group, params, **self._init_kwargs)

    def _check_resizable(self) -> None:
        """A family's own precondition of ``resize``: raise to refuse."""

    def close(self) -> None:
        """Synchronise, barrier, unregister, unmap and free. Idempotent; local
        only when torch.distributed is gone (interpreter exit)."""
        if self.handle is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            torch.ops.sdcp.workspace_unregister(self.handle)
            _registry.remove(self.handle)
            self.handle = None
        if self.arena is not None:
            arena, self.arena = self.arena, None
            arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = f"handle={self.handle}" if self.peer else "collective"
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, params={self.params}, "
                f"device={self.device}, {mode})")


class ExchangeWorkspace(PeerWorkspace):
    """A generic peer all-gather of up to ``max_bytes`` per rank: the
    signalling primitive the boundaries are built from."""

    kind = WorkspaceKind.EXCHANGE
    PARAMS = ("max_bytes",)
    # inbox [peer][word] of tagged 64-bit words (4 payload bytes each); bytes between two peers' entries
    PARTS = ("inbox", "source_stride")

    def __init__(self, group: Optional[dist.ProcessGroup], max_bytes: int, **kwargs):
        super().__init__(group, [check_positive_int(max_bytes, "max_bytes")], **kwargs)

    def all_gather(self, x: Tensor) -> Tensor:
        """[N, *x.shape] with every rank's x, rank-major."""
        if not self.peer:
            out = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(out, x.contiguous(), group=self.group)
            return torch.stack(out)
        return ops.peer_all_gather(x, self.handle)


class OutputLSEWorkspace(PeerWorkspace):
    """Output/LSE boundary: each producer stores every destination's head shard
    and LSE straight into that owner's inbox; the owner waits for every
    producer, corrects with the LSEs in fp32 and rounds once.

    Data-as-flag (docs/PROTOCOL.md): each producer stores every peer's head
    shard straight into that peer's buffer; this rank's own shard is read in
    place from ``partial_out``.

    Physical memory per rank: 4 KiB control + 2 buffers x (N - 1) x max_rows x
    H/N x (head_dim x element size + 4) bytes + 64 KiB tail, granularity-rounded.
    """

    kind = WorkspaceKind.OUTPUT_LSE
    PARAMS = ("max_rows", "total_heads", "head_dim", "elem_bytes")
    # One entry per peer: out [peer][row][h_loc][d]; lse [peer][row][h_loc] fp32
    PARTS = ("out_inbox", "lse_inbox")
    SENTINEL_FILLED = True

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, total_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, **kwargs):
        check(dtype in (torch.bfloat16, torch.float16, torch.float32), "dtype", "bfloat16, float16 or float32",
              dtype)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        check(check_positive_int(total_heads, "total_heads") % world == 0, "total_heads",
              f"a multiple of the world size {world}", total_heads)
        self.dtype = dtype
        self.total_heads, self.head_dim = total_heads, head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [check_positive_int(max_rows, "max_rows"), total_heads,
                                 check_positive_int(head_dim, "head_dim"), elem], **kwargs)

    @property
    def local_heads(self) -> int:
        return self.total_heads // self.world_size

    def combine(self, partial_out: Tensor, partial_lse: Tensor, *, lse_base: str = "e",
                return_lse: bool = False):
        """partial_out [T, H, D], partial_lse [T, H] fp32 over this rank's KV
        shard -> this rank's heads [T, H/N, D] (and their LSE [T, H/N])."""
        if self._rows_fit(partial_out.shape[0]):
            out, lse = ops.output_lse_combine(partial_out, partial_lse, self.handle, lse_base=lse_base)
        else:  # the fused collective path; its output is a [T, H/N, D] view of head-major storage
            out, lse = collective.lse_all_gather_correct_reduce_scatter(
                partial_out, partial_lse, base2=ops.lse_is_base2(lse_base), return_lse=True, group=self.group)
        return (out, lse) if return_lse else out

    def combine_out(self, partial_out: Tensor, partial_lse: Tensor, out: Tensor, out_lse: Tensor, *,
                    lse_base: str = "e") -> None:
        """As combine, written into caller-owned out [T, H/N, D] and out_lse [T, H/N]."""
        if self._rows_fit(partial_out.shape[0]):
            ops.output_lse_combine_out(partial_out, partial_lse, self.handle, out, out_lse, lse_base=lse_base)
        else:
            collective.lse_all_gather_correct_reduce_scatter(
                partial_out, partial_lse, base2=ops.lse_is_base2(lse_base), return_lse=True, group=self.group,
                out=out, out_lse=out_lse)


class TopKWorkspace(PeerWorkspace):
    """Top-K boundary: each owner sorts its candidates once and publishes its
    best min(C, k) in its own shard; every consumer reads the shards in place
    and merges them (no inbox of N copies).

    Physical memory per rank: control + max_rows x min(C, k) x 8 bytes (one
    slot: consumers acknowledge before an owner reuses its shard),
    granularity-rounded.
    """

    kind = WorkspaceKind.TOPK
    PARAMS = ("max_rows", "candidates_per_rank", "k")
    PARTS = ("keys", "keys_per_row")  # an owner's sorted keys [row][min(C, k)]; min(C, k)

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, k: int,
                 candidates_per_rank: Optional[int] = None, **kwargs):
        self.k = check_positive_int(k, "k")
        self.candidates_per_rank = check_positive_int(k if candidates_per_rank is None else candidates_per_rank,
                                                      "candidates_per_rank")
        super().__init__(group, [check_positive_int(max_rows, "max_rows"), self.candidates_per_rank, self.k],
                         **kwargs)

    def merge(self, scores: Tensor, ids: Tensor) -> Tensor:
        """scores [T, C] fp32, global ids [T, C] int32 (-1: none) -> the global
        top-k ids [T, k] int32 in selection order, identical on every rank."""
        if self._rows_fit(scores.shape[0]):
            return ops.topk_merge(scores, ids, self.handle, self.k)
        return collective.topk_all_gather_merge(scores, ids, self.k, group=self.group)


class QueryWorkspace(PeerWorkspace):
    """Query boundary: the fused RoPE/FP8 producer stores this rank's head shard
    into every consumer's inbox [T, N*H_loc, nope+rope].

    Two ways to consume it: ``gather`` returns a fresh tensor (safe anywhere,
    torch.compile included); ``gather_view`` returns a zero-copy view of this
    rank's inbox, valid until ``release()``. The inbox has one slot: no producer
    stores the next call's query into it before every consumer has finished
    with the last one (``gather`` acknowledges inside the call, a view's reader
    by ``release()``), so a late reader never sees a torn or overwritten inbox.

    Physical memory per rank: control + max_rows x N x local_heads x
    (nope + rope) x element size, granularity-rounded.
    """

    kind = WorkspaceKind.QUERY
    PARAMS = ("max_rows", "local_heads", "head_dim", "elem_bytes")
    PARTS = ("inbox",)  # [row][src*H_loc + h][nope + rope]

    def __init__(self, group: Optional[dist.ProcessGroup], max_rows: int, local_heads: int, nope_dim: int = 512,
                 rope_dim: int = 64, dtype: torch.dtype = torch.float8_e4m3fn, rope_style: str = "interleaved",
                 **kwargs):
        check(dtype in ops.QUERY_DTYPES, "dtype", f"one of {ops.QUERY_DTYPES}", dtype)
        ops.rope_is_neox(rope_style)
        check(check_positive_int(rope_dim, "rope_dim") % 2 == 0, "rope_dim", "an even value", rope_dim)
        self.dtype, self.rope_style = dtype, rope_style
        self.local_heads = local_heads
        self.nope_dim, self.rope_dim = check_positive_int(nope_dim, "nope_dim"), rope_dim
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [check_positive_int(max_rows, "max_rows"),
                                 check_positive_int(local_heads, "local_heads"), nope_dim + rope_dim, elem], **kwargs)
        self._open_view: Optional[Tensor] = None
        self._inbox_view: Optional[Tensor] = None

    @property
    def inbox(self) -> Optional[Tensor]:
        """This rank's whole inbox [max_rows, N*H_loc, nope+rope] (None in
        collective mode). Read it only between gather_view() and release()."""
        if self.arena is None:
            return None
        width = self.nope_dim + self.rope_dim
        elem = torch.empty((), dtype=self.dtype).element_size()
        raw = self.arena.local_view(torch.uint8, (self.max_rows, self.world_size * self.local_heads, width * elem),
                                    self.layout.data_offset + self.part("inbox"))
        return raw.view(self.dtype)

    def _check_resizable(self) -> None:
        if self._open_view is not None:
            raise RuntimeError("torch_sdcp: QueryWorkspace.resize: a view from gather_view() is still open; "
                               "release() it first")

    def close(self) -> None:
        """As PeerWorkspace.close; an open view becomes invalid."""
        self._open_view = self._inbox_view = None
        super().close()

    def _check_no_open_view(self, what: str) -> None:
        if self._open_view is not None:
            raise RuntimeError(f"torch_sdcp: QueryWorkspace.{what} on rank {self.rank}: the view returned by the "
                               "last gather_view() is still open; call release() once its reader is done, "
                               "before producing the next query")

    def gather(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
               q_scale: Optional[Tensor] = None) -> Tensor:
        """A fresh gathered query [T, N*H_loc, nope+rope] (head = src*H_loc + h),
        bit-identical to producing locally then all_gather on heads."""
        if not torch.compiler.is_compiling():
            self._check_no_open_view("gather")
        if self._rows_fit(ql_nope.shape[0]):
            return ops.query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.handle,
                                    rope_style=self.rope_style, out_dtype=self.dtype)
        return collective.query_all_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale,
                                           neox=self.rope_style == "neox", out_dtype=self.dtype, group=self.group)

    def gather_view(self, ql_nope: Tensor, q_pe: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                    q_scale: Optional[Tensor] = None) -> Tensor:
        """Zero-copy: as gather, but returns a view [T, N*H_loc, nope+rope] of
        this rank's inbox. The view stays valid until ``release()``, which the
        caller must call after the last kernel that reads it has been enqueued
        (same stream) and before the next gather or gather_view. Eager and CUDA
        graphs only: under torch.compile use ``gather``. A call with more rows
        than max_rows takes the collective path and returns a fresh tensor
        (release() is still required, and does nothing on the device)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("torch_sdcp: QueryWorkspace.gather_view is not traceable by torch.compile (its "
                               "result aliases workspace memory); use gather() inside compiled regions")
        self._check_no_open_view("gather_view")
        rows = ql_nope.shape[0]
        if self._rows_fit(rows):
            ops.query_publish(ql_nope, q_pe, positions, cos_sin_cache, q_scale, self.handle,
                              rope_style=self.rope_style, out_dtype=self.dtype)
            if self._inbox_view is None:
                self._inbox_view = self.inbox
            view = self._inbox_view[:rows]
        else:
            view = self.gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale)
        self._open_view = view
        return view

    def release(self) -> None:
        """The reader of the last gather_view() is done: producers may reuse
        this rank's inbox. Enqueued on the current stream (capturable)."""
        if self._open_view is None:
            raise RuntimeError(f"torch_sdcp: QueryWorkspace.release on rank {self.rank}: no view is open "
                               "(gather_view() was not called, or release() was already called)")
        view, self._open_view = self._open_view, None
        if self.peer and self._inbox_view is not None and view.data_ptr() == self._inbox_view.data_ptr():
            self._check_stream()
            ops.query_release(self._inbox_view, self.handle)
