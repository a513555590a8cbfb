"""The Triton kernel of ``FlashInferFusedCombine`` (flashinfer_combine.py
says what it reproduces): imported on first use, so that importing the
competitors needs no Triton and TRITON_INTERPRET is read when it is defined."""

import triton
import triton.language as tl


@triton.jit
def grid_sync(sync_ptr, spin_limit):
    # Central barrier: the last arrival resets the count and advances the
    # generation; the others poll the generation (bounded).
    tl.debug_barrier()  # the whole program's stores come before its arrival
    gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="sys")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="sys")
    else:
        spins = 0
        while (tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="sys") == gen) & (spins < spin_limit):
            spins += 1
        if spins >= spin_limit:
            tl.atomic_add(sync_ptr + 3, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def put_entry(po_ptr, pl_ptr, recv_ptr, recv_lse_ptr, peer_bytes_ptr, s_t, s_h, s_dst, l_t, l_h, l_dst,
              dst, e, slot, max_entries, rank, N: tl.constexpr, HL: tl.constexpr, D: tl.constexpr,
              BLOCK_D: tl.constexpr, ELEM: tl.constexpr):
    # Entry e = (row, local head) of destination dst, into dst's slot at this sender's index.
    t = e // HL
    h = e - t * HL
    delta = tl.load(peer_bytes_ptr + dst)
    row = (slot * N + rank) * max_entries + e
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x = tl.load(po_ptr + t * s_t + h * s_h + dst * s_dst + d, mask=dmask)
    dst_out = recv_ptr + tl.multiple_of(delta // ELEM, 16 // ELEM) + row * D
    tl.store(dst_out + d, x, mask=dmask)
    tl.store(recv_lse_ptr + delta // 4 + row, tl.load(pl_ptr + t * l_t + h * l_h + dst * l_dst))


@triton.jit
def fused(po_ptr, pl_ptr, s_t, s_h, s_dst, l_t, l_h, l_dst, state_ptr, ready_ptr, recv_ptr, recv_lse_ptr,
          peer_bytes_ptr, sync_ptr, out_ptr, out_lse_ptr, entries, max_entries, rank, spin_limit,
          N: tl.constexpr, HL: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ELEM: tl.constexpr,
          ROW_DISTRIBUTED: tl.constexpr, BASE_E: tl.constexpr, DO_PUT: tl.constexpr, DO_MERGE: tl.constexpr,
          GRID_SYNC: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if DO_PUT:
        # 1. program 0 picks the epoch (device state: graph replays advance it).
        if pid == 0:
            nxt = tl.load(state_ptr)
            tl.store(state_ptr + 1, nxt)
            tl.store(state_ptr, nxt + 1)
        if GRID_SYNC:
            grid_sync(sync_ptr, spin_limit)
    epoch = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")
    slot = (epoch & 1).to(tl.int64)
    signal = epoch + 1
    if DO_PUT:
        # 2. put, then one flag per destination.
        if ROW_DISTRIBUTED:
            for work in range(pid, N * entries, grid):
                dst = work // entries
                put_entry(po_ptr, pl_ptr, recv_ptr, recv_lse_ptr, peer_bytes_ptr, s_t, s_h, s_dst, l_t, l_h,
                          l_dst, dst, work - dst * entries, slot, max_entries, rank, N, HL, D, BLOCK_D, ELEM)
            if GRID_SYNC:
                grid_sync(sync_ptr, spin_limit)
            if pid < N:
                tl.atomic_xchg(ready_ptr + tl.load(peer_bytes_ptr + pid) // 4 + slot * N + rank, signal,
                               sem="release", scope="sys")
        else:
            for dst in range(pid, N, grid):
                for e in range(0, entries):
                    put_entry(po_ptr, pl_ptr, recv_ptr, recv_lse_ptr, peer_bytes_ptr, s_t, s_h, s_dst, l_t,
                              l_h, l_dst, dst, e, slot, max_entries, rank, N, HL, D, BLOCK_D, ELEM)
                tl.debug_barrier()
                tl.atomic_xchg(ready_ptr + tl.load(peer_bytes_ptr + dst) // 4 + slot * N + rank, signal,
                               sem="release", scope="sys")
    if DO_MERGE:
        # 3. program 0 waits for every source's flag of the slot (bounded); grid sync.
        if pid == 0:
            for src in range(0, N):
                spins = 0
                while ((tl.atomic_add(ready_ptr + slot * N + src, 0, sem="acquire", scope="sys") != signal)
                       & (spins < spin_limit)):
                    spins += 1
                if spins >= spin_limit:
                    tl.atomic_max(sync_ptr + 2, src + 1, sem="relaxed", scope="gpu")
        if GRID_SYNC:
            grid_sync(sync_ptr, spin_limit)
        # 4. merge, one entry per program (grid-stride), sums in rank order.
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        for e in range(pid, entries, grid):
            m = float("-inf")
            for r in tl.static_range(N):
                l = tl.load(recv_lse_ptr + (slot * N + r) * max_entries + e)
                l = tl.where((l != l) | (l == float("inf")), float("-inf"), l)
                m = tl.maximum(m, l)
            m = tl.where(m == float("-inf"), 0.0, m)
            denom = 0.0
            for r in tl.static_range(N):
                l = tl.load(recv_lse_ptr + (slot * N + r) * max_entries + e)
                l = tl.where((l != l) | (l == float("inf")), float("-inf"), l)
                denom += tl.exp(l - m) if BASE_E else tl.exp2(l - m)
            inv = tl.where(denom == 0.0, 0.0, 1.0 / denom)
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for r in tl.static_range(N):
                l = tl.load(recv_lse_ptr + (slot * N + r) * max_entries + e)
                l = tl.where((l != l) | (l == float("inf")), float("-inf"), l)
                w = (tl.exp(l - m) if BASE_E else tl.exp2(l - m)) * inv
                x = tl.load(recv_ptr + ((slot * N + r) * max_entries + e) * D + d, mask=dmask)
                acc += x.to(tl.float32) * w
            tl.store(out_ptr + e * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
            big_l = m + (tl.log(denom) if BASE_E else tl.log2(denom))
            tl.store(out_lse_ptr + e, tl.where(denom > 0.0, big_l, float("-inf")))
