"""``SymmMemOutputLSE`` ("symm-mem"): each rank copies every destination's head
shard (payload and LSE) into that peer's symmetric inbox with one copy kernel
per destination and tensor, a device-side barrier signals, then the owner
combines locally with the fp32 kernel torch_sdcp uses (``sdcp::lse_combine``).
A second barrier before the stores keeps a fast rank from overwriting an
inbox that a slow peer is still reading: two signal rounds per call."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_sdcp.competitors._symm import _default_group, _enable_for_group, _symmetric_memory


class SymmMemOutputLSE:
    def __init__(self, group, max_rows: int, total_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        symm_mem = _symmetric_memory()

        self.group = group if group is not None else _default_group()
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.hl = total_heads // self.n
        self.dim = head_dim
        self.dtype = dtype
        _enable_for_group(symm_mem, self.group)
        out_elems = self.n * max_rows * self.hl * head_dim
        self.out_buf = symm_mem.empty(out_elems, dtype=dtype, device=device)
        self.lse_buf = symm_mem.empty(self.n * max_rows * self.hl, dtype=torch.float32, device=device)
        self.h_out = symm_mem.rendezvous(self.out_buf, self.group.group_name)
        self.h_lse = symm_mem.rendezvous(self.lse_buf, self.group.group_name)
        self.peer_out = [self.h_out.get_buffer(r, (out_elems,), dtype) for r in range(self.n)]
        self.peer_lse = [self.h_lse.get_buffer(r, (self.n * max_rows * self.hl,), torch.float32)
                         for r in range(self.n)]
        self.physical_bytes = (out_elems * self.out_buf.element_size() + self.lse_buf.numel() * 4)

    def combine(self, partial_out: torch.Tensor, partial_lse: torch.Tensor, base2: bool = False):
        t, hl, d, n, r = partial_out.shape[0], self.hl, self.dim, self.n, self.rank
        block = t * hl * d
        self.h_out.barrier(channel=0)  # every peer finished reading the previous call's inbox
        for dst in range(n):
            heads = slice(dst * hl, (dst + 1) * hl)
            self.peer_out[dst][r * block:(r + 1) * block].view(t, hl, d).copy_(partial_out[:, heads])
            self.peer_lse[dst][r * t * hl:(r + 1) * t * hl].view(t, hl).copy_(partial_lse[:, heads])
        self.h_out.barrier(channel=1)  # every producer's stores are visible
        inbox = self.out_buf[: n * block].view(n, t, hl, d)
        inbox_lse = self.lse_buf[: n * t * hl].view(n, t, hl)
        return torch.ops.sdcp.lse_combine(inbox, inbox_lse, base2)
