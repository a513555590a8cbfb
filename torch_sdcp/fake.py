"""Fake (meta) implementations of every torch.ops.sdcp operator, for
torch.compile and FakeTensor tracing. Shapes, dtypes, devices and strides
match the real kernels exactly; peer ops read the world size from the
workspace registry (workspaces are created before tracing)."""

from __future__ import annotations

import torch
from torch.library import register_fake

from torch_sdcp import _registry
from torch_sdcp.families import FAMILIES


@register_fake("sdcp::query_rope_quant")
def _query_rope_quant(ql_nope, q_pe, positions, cos_sin_cache, q_scale, neox, out_dtype):
    t, h, nope = ql_nope.shape
    return ql_nope.new_empty((t, h, nope + q_pe.shape[2]), dtype=out_dtype)


@register_fake("sdcp::topk_select")
def _topk_select(scores, ids, k):
    return ids.new_empty((scores.shape[0], k))


@register_fake("sdcp::lse_combine")
def _lse_combine(partial_out, partial_lse, base2):
    _, t, h, d = partial_out.shape
    return partial_out.new_empty((t, h, d)), partial_lse.new_empty((t, h))


@register_fake("sdcp::lse_correct")
def _lse_correct(partial_out, gathered_lse, rank, base2):
    t, h, d = partial_out.shape
    return partial_out.new_empty((h, t, d)), gathered_lse.new_empty((t, h))


@register_fake("sdcp::peer_all_gather")
def _peer_all_gather(x, workspace, tag=-1):
    n = _registry.world_size(workspace)
    return x.new_empty((n, *x.shape))


@register_fake("sdcp::output_lse_combine")
def _output_lse_combine(partial_out, partial_lse, workspace, base2, seq_lens=None, query_start_loc=None, tag=-1):
    n = _registry.world_size(workspace)
    t, h, d = partial_out.shape
    return partial_out.new_empty((t, h // n, d)), partial_lse.new_empty((t, h // n))


@register_fake("sdcp::output_lse_combine_out")
def _output_lse_combine_out(partial_out, partial_lse, workspace, base2, out, out_lse, seq_lens=None,
                            query_start_loc=None, tag=-1):
    return None


@register_fake("sdcp::topk_merge")
def _topk_merge(scores, ids, workspace, k, tag=-1):
    return ids.new_empty((scores.shape[0], k))


@register_fake("sdcp::query_gather")
def _query_gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, neox, out_dtype, tag=-1):
    n = _registry.world_size(workspace)
    t, h, nope = ql_nope.shape
    return ql_nope.new_empty((t, n * h, nope + q_pe.shape[2]), dtype=out_dtype)


@register_fake("sdcp::query_publish")
def _query_publish(ql_nope, q_pe, positions, cos_sin_cache, q_scale, workspace, neox, out_dtype, tag=-1):
    return None


@register_fake("sdcp::query_release")
def _query_release(inbox, workspace):
    return None


@register_fake("sdcp::query_all_gather_heads")
def _query_all_gather_heads(q, workspace, tag=-1):
    n = _registry.world_size(workspace)
    t, h, w = q.shape
    return q.new_empty((t, n * h, w))


@register_fake("sdcp::query_all_gather_heads_out")
def _query_all_gather_heads_out(q, workspace, out, tag=-1):
    return None


# Peer ops publish into other ranks' memory: never dead code, even when the
# caller drops the result on this rank. Every family's record names its own.
PEER_OPS = tuple(getattr(torch.ops.sdcp, op).default for family in FAMILIES for op in family.peer_ops)
for _op in PEER_OPS:
    torch.fx.node.has_side_effect(_op)
