"""The Output/LSE family: the attention output and LSE combine (csrc/output_lse.*)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_sdcp import collective, ops
from torch_sdcp._checks import arg_error, check, check_bool, check_dim, check_mask_args
from torch_sdcp.families import OUTPUT_LSE
from torch_sdcp.semantics import mask_empty_shards
from torch_sdcp.workspaces._guard import call_method
from torch_sdcp.workspaces._policy import (
    leading_rows,
    placeholder_tag,
    refuse_overlap,
    resolve_group,
    validate_size_param,
)
from torch_sdcp.workspaces.base import PeerWorkspace


def _validate_combine_inputs(ws: OutputLSEWorkspace, partial_out: Any, partial_lse: Any) -> None:
    """The inputs of combine and combine_out, checked alike on the peer and the
    collective path (the C++ op checks the same, but cannot tell two dtypes of
    one element size apart)."""
    check_dim(partial_out, "partial_out", 3, "[T, H, D]")
    check_dim(partial_lse, "partial_lse", 2, "[T, H]")
    if partial_out.dtype != ws.dtype:
        raise arg_error("partial_out", f"dtype {ws.dtype} (the dtype of this OutputLSEWorkspace)",
                        f"dtype {partial_out.dtype}")
    if partial_lse.dtype != torch.float32:
        raise arg_error("partial_lse", "dtype torch.float32", f"dtype {partial_lse.dtype}")
    # The wording of csrc (check_size), so that both paths read alike.
    for d, want, what in ((1, ws.total_heads, "total_heads"), (2, ws.head_dim, "head_dim")):
        if partial_out.shape[d] != want:
            raise arg_error("partial_out", f"size {want} at dim {d} ({what} of this OutputLSEWorkspace)",
                            f"{partial_out.shape[d]} (shape {list(partial_out.shape)})")
    for d in (0, 1):
        if partial_lse.shape[d] != partial_out.shape[d]:
            raise arg_error("partial_lse", f"size {partial_out.shape[d]} at dim {d} (that of 'partial_out')",
                            f"{partial_lse.shape[d]} (shape {list(partial_lse.shape)})")
    if partial_out.device != ws.device:  # blame the tensor that is wrong (a meta one)
        raise arg_error("partial_out", f"a tensor on {ws.device} (the device of this OutputLSEWorkspace)",
                        f"a tensor on {partial_out.device}")
    if partial_lse.device != partial_out.device:
        raise arg_error("partial_lse", f"device {partial_out.device} (that of 'partial_out')",
                        f"device {partial_lse.device}")


def _validate_mask(partial_out: Tensor, seq_lens: Any, query_start_loc: Any) -> bool:
    """The empty-shard mask's arguments, checked alike on both paths (as
    csrc/output_lse.cpp checks them); True when a mask is asked for."""
    if not check_mask_args(seq_lens, query_start_loc):
        return False
    for t, arg in ((seq_lens, "seq_lens"), (query_start_loc, "query_start_loc")):
        if not t.is_contiguous():
            raise arg_error(arg, "a contiguous tensor", f"strides {list(t.stride())} for shape {list(t.shape)}")
        if t.device != partial_out.device:
            raise arg_error(arg, f"device {partial_out.device} (that of 'partial_out')", f"device {t.device}")
    return True


def _validate_combine_outputs(ws: OutputLSEWorkspace, partial_out: Tensor, out: object, out_lse: object) -> None:
    """combine_out's caller-owned outputs, checked alike on both paths (as
    csrc/output_lse.cpp checks them): exact shape, dtype, contiguous, device."""
    rows, hl, d = partial_out.shape[0], ws.local_heads, ws.head_dim
    for t, arg, shape, dtype in ((out, "out", (rows, hl, d), partial_out.dtype),
                                 (out_lse, "out_lse", (rows, hl), torch.float32)):
        if not isinstance(t, Tensor):
            raise arg_error(arg, "a Tensor", type(t).__name__)
        if tuple(t.shape) != shape:
            raise arg_error(arg, f"shape {list(shape)}", f"shape {list(t.shape)}")
        if t.dtype != dtype:
            raise arg_error(arg, f"dtype {dtype}", f"dtype {t.dtype}")
        if not t.is_contiguous():
            raise arg_error(arg, "a contiguous tensor", f"strides {list(t.stride())} for shape {list(t.shape)}")
        if t.device != partial_out.device:
            raise arg_error(arg, f"device {partial_out.device} (that of 'partial_out')", f"device {t.device}")


def _lse_base_text(base2: bool) -> str:
    """The LSE base as a call mismatch names it (csrc/output_lse.cpp output_lse_flags_text)."""
    return f"lse base {'2' if base2 else 'e'}"


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

    family = OUTPUT_LSE
    SENTINEL_FILLED = True
    POISON_ON_ERROR = True

    def __init__(self, group: dist.ProcessGroup | None, max_rows: int, total_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, **kwargs):
        check(dtype in (torch.bfloat16, torch.float16, torch.float32), "dtype", "bfloat16, float16 or float32",
              dtype)
        _, _, world = resolve_group(group)
        validate_size_param(max_rows, "max_rows")
        check(validate_size_param(total_heads, "total_heads") % world == 0, "total_heads",
              f"a multiple of the world size {world}", total_heads)
        validate_size_param(head_dim, "head_dim")
        self.dtype = dtype
        self.total_heads, self.head_dim = total_heads, head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(group, [max_rows, total_heads, head_dim, elem], **kwargs)

    @property
    def local_heads(self) -> int:
        return self.total_heads // self.world_size

    def void_placeholder(self, what, arguments, rows=None):
        """A void combine: the rows of ``partial_out``, every shard empty
        (LSE -inf), the call's LSE base and tag; base e when the call's is not a base
        (a void header pairs with a peer's call of any base: csrc/dataflag.h
        call_header_mismatch)."""
        if rows is None:
            rows = leading_rows((arguments.get("partial_out"), 3), (arguments.get("partial_lse"), 2))
        base = arguments.get("lse_base", "e")
        if not isinstance(base, str) or base not in ops.LSE_BASES:
            base = "e"
        if rows is None or rows > self.max_rows:
            return None
        out = torch.zeros(rows, self.total_heads, self.head_dim, dtype=self.dtype, device=self.device)
        lse = torch.full((rows, self.total_heads), -math.inf, device=self.device)
        tag = placeholder_tag(arguments)
        return lambda: ops.output_lse_combine(out, lse, self.peer_handle, lse_base=base, tag=tag)

    @call_method
    def combine(self, partial_out: Tensor, partial_lse: Tensor, *, lse_base: str = "e",
                return_lse: bool = False, seq_lens: Tensor | None = None, query_start_loc: Tensor | None = None,
                tag: int | None = None):
        """partial_out [T, H, D] of the workspace dtype, partial_lse [T, H] fp32
        over this rank's KV shard -> this rank's heads [T, H/N, D] (and their
        LSE [T, H/N]). With vLLM's seq_lens [R] and query_start_loc [R + 1]
        (this rank's, int32 or int64, on the inputs' device), padding rows and
        rows of empty shards get no weight, inside the one combine kernel
        (torch_sdcp.semantics.mask_empty_shards). ``tag``: the call tag (None,
        or an int in [0, 2**23 - 1), e.g. the layer index), compared by every
        peer."""
        with self._call("combine"):
            _validate_combine_inputs(self, partial_out, partial_lse)
            self._require_on_device(partial_out=partial_out, partial_lse=partial_lse, seq_lens=seq_lens,
                                query_start_loc=query_start_loc)
            masked = _validate_mask(partial_out, seq_lens, query_start_loc)
            base2 = ops.lse_is_base2(lse_base)
            check_bool(return_lse, "return_lse")
            if self._take_path(partial_out.shape[0], "partial_out", tag, _lse_base_text(base2)):
                out, lse = ops.output_lse_combine(partial_out, partial_lse, self.peer_handle, lse_base=lse_base,
                                                  seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)
            else:  # the fused collective path, made contiguous like the peer path's output
                if masked:
                    partial_lse = mask_empty_shards(partial_lse, seq_lens, query_start_loc)
                out, lse = (t.contiguous() for t in collective.lse_all_gather_correct_reduce_scatter(
                    partial_out, partial_lse, base2=base2, return_lse=True, group=self.group))
            return (out, lse) if return_lse else out

    @call_method
    def combine_out(self, partial_out: Tensor, partial_lse: Tensor, out: Tensor, out_lse: Tensor, *,
                    lse_base: str = "e", seq_lens: Tensor | None = None,
                    query_start_loc: Tensor | None = None, tag: int | None = None) -> None:
        """As combine, written into caller-owned out [T, H/N, D] (the workspace
        dtype) and out_lse [T, H/N] fp32, both contiguous, on the inputs'
        device; the same checks on the peer and the collective path."""
        with self._call("combine_out"):
            _validate_combine_inputs(self, partial_out, partial_lse)
            _validate_combine_outputs(self, partial_out, out, out_lse)
            self._require_on_device(partial_out=partial_out, partial_lse=partial_lse, out=out, out_lse=out_lse,
                                seq_lens=seq_lens, query_start_loc=query_start_loc)
            if not torch.compiler.is_compiling():
                refuse_overlap({"out": out, "out_lse": out_lse},
                               {"partial_out": partial_out, "partial_lse": partial_lse, "seq_lens": seq_lens,
                                "query_start_loc": query_start_loc})
            masked = _validate_mask(partial_out, seq_lens, query_start_loc)
            base2 = ops.lse_is_base2(lse_base)
            if self._take_path(partial_out.shape[0], "partial_out", tag, _lse_base_text(base2)):
                ops.output_lse_combine_out(partial_out, partial_lse, self.peer_handle, out, out_lse, lse_base=lse_base,
                                           seq_lens=seq_lens, query_start_loc=query_start_loc, tag=tag)
            else:
                if masked:
                    partial_lse = mask_empty_shards(partial_lse, seq_lens, query_start_loc)
                collective.lse_all_gather_correct_reduce_scatter(
                    partial_out, partial_lse, base2=base2, return_lse=True, group=self.group, out=out,
                    out_lse=out_lse)

