"""Workspaces: the fallback policy (collective mode when peer memory is
unavailable, logged; calls with more rows than max_rows agreed on the group's
store before any collective), argument errors, teardown, resizing, and the
one-stream-at-a-time rule."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from _dist import run_workers
from _helpers import GPU_WORLD, rank_workspace_args, requires_gpus, stopped_wait


def _collective_mode_worker(rank, world):
    import torch_sdcp
    from torch_sdcp import peer as peer_mod
    from torch_sdcp import reference

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch_sdcp").addHandler(handler)

    def refuse(stage):  # every rank's gate fails: peer memory is unusable
        if stage == "probe":
            raise RuntimeError("peer writes were dropped")

    peer_mod._TEST_HOOK = refuse
    with pytest.raises(RuntimeError, match="PeerArena creation failed"):
        torch_sdcp.ExchangeWorkspace(None, 64, backend="host")  # without fallback: an error
    g = torch.Generator().manual_seed(3)
    out, lse = torch.randn(world, 4, 8, 128, generator=g).to(torch.bfloat16), torch.randn(world, 4, 8, generator=g)
    with torch_sdcp.OutputLSEWorkspace(None, 16, 8, 128, backend="host", fallback=True) as ws:
        assert not ws.peer and ws.physical_bytes == 0
        got, got_lse = ws.combine(out[rank], lse[rank], return_lse=True)
        ref_out, ref_lse = reference.lse_combine_ref64(out, lse)
        ref_out, ref_lse = reference.output_lse_shard(ref_out, ref_lse, rank, world)
        torch.testing.assert_close(got.double(), ref_out, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    scores = torch.randn(world, 4, 32, generator=g)
    ids = torch.randperm(world * 4 * 32, generator=g).view(world, 4, 32).to(torch.int32)
    with torch_sdcp.TopKWorkspace(None, 16, 16, candidates_per_rank=32, backend="host", fallback=True) as ws:
        assert torch.equal(ws.merge(scores[rank], ids[rank]),
                           reference.topk_merge_ref([(scores[r], ids[r]) for r in range(world)], 16))
    with torch_sdcp.ExchangeWorkspace(None, 64, backend="host", fallback=True) as ws:
        x = torch.full((3,), float(rank))
        assert torch.equal(ws.all_gather(x), torch.stack([torch.full((3,), float(r)) for r in range(world)]))
    peer_mod._TEST_HOOK = None
    messages = [r.getMessage() for r in records]
    assert any("peer memory unavailable" in m and "collective path" in m for m in messages), messages
    return True


def test_fallback_runs_the_collective_path_and_logs_it():
    assert run_workers(_collective_mode_worker, 2, timeout=180) == [True, True]


def _argument_worker(rank, world):
    import torch_sdcp

    with pytest.raises(ValueError, match="'total_heads'.*multiple of the world size 2, got 7"):
        torch_sdcp.OutputLSEWorkspace(None, 8, 7, 128, backend="host")
    with pytest.raises(ValueError, match="'dtype'"):
        torch_sdcp.OutputLSEWorkspace(None, 8, 8, 128, dtype=torch.int8, backend="host")
    with pytest.raises(ValueError, match="'max_rows'.*positive int, got 0"):
        torch_sdcp.TopKWorkspace(None, 0, 16, backend="host")
    with pytest.raises(ValueError, match="'rope_style'"):
        torch_sdcp.QueryWorkspace(None, 8, 4, rope_style="gptj", backend="host")
    with pytest.raises(ValueError, match="'timeout_s'"):
        torch_sdcp.ExchangeWorkspace(None, 64, backend="host", timeout_s=0)
    ws = torch_sdcp.ExchangeWorkspace(None, 64, backend="host")
    assert ws.param("max_bytes") == 64 and ws.part("source_stride") == 256 and ws.layout.slots == 2
    with pytest.raises(AttributeError, match="no parameter 'max_rows'"):
        ws.resize(8)  # bounded in bytes, not in rows
    handle = ws.handle
    assert handle in torch.ops.sdcp.workspace_handles()
    ws.close()
    ws.close()  # idempotent
    assert handle not in torch.ops.sdcp.workspace_handles() and not ws.peer
    with pytest.raises(ValueError, match="'workspace'.*live exchange workspace handle, got"):
        torch.ops.sdcp.peer_all_gather(torch.ones(2), handle)
    return True


def test_workspace_argument_errors_and_teardown():
    assert run_workers(_argument_worker, 2, timeout=120) == [True, True]


def test_layout_names_the_cpp_layout():
    import torch_sdcp
    from torch_sdcp.families import FAMILIES
    from torch_sdcp.workspaces import (
        ExchangeWorkspace,
        OutputLSEWorkspace,
        QueryWorkspace,
        TopKWorkspace,
        WorkspaceKind,
        WorkspaceLayout,
        workspace_layout,
    )

    # The family records are the Python side's one list of families: kinds
    # 0..n-1 in order, as the C++ table (kFamilies) numbers them, each class
    # defined where its record says and reading its kind, parameters and
    # parts from it.
    assert [f.kind for f in FAMILIES] == list(WorkspaceKind) and [int(k) for k in WorkspaceKind] == [
        *range(len(FAMILIES))]
    with pytest.raises(ValueError, match=rf"argument 'kind': expected 0\.\.{len(FAMILIES) - 1}, got {len(FAMILIES)}"):
        torch.ops.sdcp.workspace_layout(len(FAMILIES), [1], 2)
    for family in FAMILIES:
        cls = family.load()
        assert (cls.__name__, cls.__module__, cls.family) == (family.workspace, family.module, family)
        assert (cls.kind, cls.PARAMS, cls.PARTS) == (family.kind, family.params, family.parts)
        with pytest.raises(ValueError, match=f"expected {len(family.params)} values"):
            torch.ops.sdcp.workspace_layout(int(family.kind), [1] * (len(family.params) + 1), 2)
        assert getattr(torch_sdcp, family.workspace) is cls and family.workspace in torch_sdcp.__all__
        for op in family.peer_ops:
            assert getattr(torch.ops.sdcp, op).default in torch_sdcp.fake.PEER_OPS
    # The engine faces' boundary table: one row per family that names one, in family order.
    from torch_sdcp.integrations._boundaries import BOUNDARIES
    assert list(BOUNDARIES) == [f.integration for f in FAMILIES if f.integration]
    world = 2
    params = {ExchangeWorkspace: [100], OutputLSEWorkspace: [8, 8, 128, 2], TopKWorkspace: [8, 32, 16],
              QueryWorkspace: [8, 4, 576, 1]}
    layouts = {}
    for cls, p in params.items():
        assert len(p) == len(cls.PARAMS)  # the C++ side checks the count per kind
        layout = layouts[cls] = workspace_layout(cls.kind, p, world)
        assert layout.region_bytes == torch.ops.sdcp.workspace_nbytes(int(cls.kind), p, world)
        assert layout.data_offset == layout.control_bytes and len(layout.part_values) == 4
        # The op's flat list, in the field order of WorkspaceLayout (the C++ side's
        # [control_bytes, data_offset, slots, slot_bytes, region_bytes, part_values x 4]).
        flat = torch.ops.sdcp.workspace_layout(int(cls.kind), p, world)
        assert flat == [layout.control_bytes, layout.data_offset, layout.slots, layout.slot_bytes,
                        layout.region_bytes, *layout.part_values]
    assert WorkspaceLayout._fields == ("control_bytes", "data_offset", "slots", "slot_bytes", "region_bytes",
                                       "part_values")

    def part(cls, name):
        return layouts[cls].part_values[cls.PARTS.index(name)]

    # Data-as-flag buffers hold one entry per peer (world - 1): the exchange's
    # 100 bytes are 25 tagged 64-bit words (200 bytes, aligned to 256).
    # Then one call header per peer: 4 tagged words (32 bytes), aligned to 256.
    assert part(ExchangeWorkspace, "source_stride") == 256 and part(ExchangeWorkspace, "headers") == (world - 1) * 256
    assert layouts[ExchangeWorkspace].slot_bytes == (world - 1) * 256 + 256 and layouts[ExchangeWorkspace].slots == 2
    assert layouts[ExchangeWorkspace].control_bytes == 4096
    out_bytes = (world - 1) * 8 * 4 * 128 * 2  # [peer][row][h_loc][d] bf16
    assert (part(OutputLSEWorkspace, "out_inbox"), part(OutputLSEWorkspace, "lse_inbox")) == (0, out_bytes)
    lse_bytes = 256  # [peer][row][h_loc] fp32 = 128 bytes, aligned; then the 16-byte headers [peer], aligned
    assert part(OutputLSEWorkspace, "headers") == out_bytes + lse_bytes
    assert layouts[OutputLSEWorkspace].slot_bytes == out_bytes + lse_bytes + 256
    assert layouts[OutputLSEWorkspace].slots == 2
    assert part(TopKWorkspace, "keys_per_row") == 16 and layouts[TopKWorkspace].slots == 2
    keys = (world - 1) * 8 * 16 * 8  # [peer][row][min(C, k)] 8-byte keys; then the 16-byte headers [peer], aligned
    assert part(TopKWorkspace, "headers") == keys and layouts[TopKWorkspace].slot_bytes == keys + 256
    assert layouts[TopKWorkspace].control_bytes == 4096
    # Query: the view [row][src*H_loc + h][576], then two buffers of peer entries, then the call headers
    # [buffer 0, buffer 1, view][peer][16 bytes], aligned to 256.
    view, buffer = 8 * world * 4 * 576, (world - 1) * 8 * 4 * 576
    assert (part(QueryWorkspace, "inbox"), part(QueryWorkspace, "buffers"), part(QueryWorkspace, "buffer_bytes"),
            part(QueryWorkspace, "headers")) == (0, view, buffer, view + 2 * buffer)
    headers = -(-3 * (world - 1) * 16 // 256) * 256
    assert layouts[QueryWorkspace].slot_bytes == view + 2 * buffer + headers and layouts[QueryWorkspace].slots == 1
    assert layouts[QueryWorkspace].control_bytes == 4096


def _resize_worker(rank, world):
    import torch_sdcp
    from torch_sdcp import reference

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(world, 12, 32, generator=g)
    ids = torch.randperm(world * 12 * 32, generator=g).view(world, 12, 32).to(torch.int32)
    want = reference.topk_merge_ref([(scores[r], ids[r]) for r in range(world)], 16)
    with torch_sdcp.TopKWorkspace(None, 4, 16, candidates_per_rank=32, backend="host") as ws:
        old = ws.handle
        ws.resize(16)  # collective: every rank re-creates it
        assert ws.max_rows == 16 and ws.handle != old and old not in torch.ops.sdcp.workspace_handles()
        assert torch.equal(ws.merge(scores[rank], ids[rank]), want)
        with pytest.raises(ValueError, match="'max_rows'.*positive int"):
            ws.resize(0)
    return True


def test_resize_recreates_the_workspace():
    assert run_workers(_resize_worker, 2, timeout=120) == [True, True]


def _stream_worker(rank, world):
    import torch_sdcp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    with torch_sdcp.OutputLSEWorkspace(None, 8, 8, 128, device=device) as ws:
        out = torch.randn(4, 8, 128, device=device, dtype=torch.bfloat16)
        lse = torch.randn(4, 8, device=device)
        ws.combine(out, lse)  # default stream, then idle: a switch is fine
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            ws.combine(out, lse)
        # The side stream still runs (a long kernel ahead of the call): a call
        # from the default stream now would race with it.
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            ws.combine(out, lse)
        with pytest.raises(RuntimeError, match="still runs an earlier call"):
            ws.combine(out, lse)
        side.synchronize()
        # Capture, then resizing is refused.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            ws.combine(out, lse)
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="'max_rows'.*captured in a CUDA graph"):
            ws.resize(16)
    return True


@requires_gpus(GPU_WORLD)
def test_one_stream_at_a_time_and_no_resize_after_capture():
    assert run_workers(_stream_worker, GPU_WORLD, timeout=300) == [True] * GPU_WORLD


# ---------------------------------------------------------------------------
# Reliability: one layout on both paths, forks refused, abort(), Ctrl-C, stale sockets
# ---------------------------------------------------------------------------


def _layout_fork_worker(rank, world):
    import os

    import torch_sdcp

    with torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, dtype=torch.float32, backend="host", timeout_s=30) as ws:
        for rows in (2, 5):  # the peer path, then the collective path (rows > max_rows)
            g = torch.Generator().manual_seed(rows * 10 + rank)
            out = ws.combine(torch.randn(rows, 8, 64, generator=g), torch.randn(rows, 8, generator=g))
            assert out.is_contiguous(), (rows, out.stride())
            again, lse = torch.empty_like(out), torch.empty(rows, 8 // world)
            ws.combine_out(torch.randn(rows, 8, 64, generator=g), torch.randn(rows, 8, generator=g), again, lse)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child must not act as its parent's rank
            os.close(read)
            refused = []
            for what, call in (("combine", lambda: ws.combine(torch.zeros(1, 8, 64), torch.zeros(1, 8))),
                               ("check", ws.check), ("close", ws.close), ("abort", ws.abort)):
                try:
                    call()
                except RuntimeError as e:
                    refused.append(f"belongs to process {os.getppid()}: {what}() from process {os.getpid()}" in str(e))
            os.write(write, bytes(refused))
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert status == 0 and os.read(read, 16) == bytes([1, 1, 1, 1])
        os.close(read)
        ws.check()  # the parent's workspace is untouched and still pairs with its peers
        g = torch.Generator().manual_seed(7 + rank)
        assert ws.combine(torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, generator=g)).shape == (2, 4, 64)
    return True


def test_combine_layout_and_forks_refused():
    assert run_workers(_layout_fork_worker, 2, timeout=120) == [True, True]


def _abort_interrupt_worker(rank, world):
    return [stopped_wait(rank, stop) for stop in ("abort", "sigint")]


def test_abort_from_a_thread_and_ctrl_c_end_a_wait_at_once():
    r0s, r1s = run_workers(_abort_interrupt_worker, 2, timeout=120)
    for stop, r0, r1 in zip(("abort", "sigint"), r0s, r1s, strict=True):
        # rank 0 waits for a peer that never calls; a thread aborts, or Ctrl-C arrives
        assert r0["raised"] == ("RuntimeError" if stop == "abort" else "KeyboardInterrupt"), (stop, r0)
        assert r0["call_s"] < 1.3 and r0["poisoned"], (stop, r0)
        assert ("watchdog" if stop == "abort" else "KeyboardInterrupt") in (r0["check"] or ""), (stop, r0)
        assert "peer 0 aborted" in (r1["check"] or ""), (stop, r1)  # the peer is told at once


def _stale_socket_worker(rank, world):
    import os
    import subprocess
    import tempfile

    import torch_sdcp

    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    base = tempfile.gettempdir()
    stale, live = os.path.join(base, f"sdcp-{dead.pid}-abcdefgh"), os.path.join(base, f"sdcp-{os.getppid()}-abcdefgh")
    for d in (stale, live):
        os.mkdir(d, 0o700)
        open(os.path.join(d, "socket"), "w").close()
    torch_sdcp.ExchangeWorkspace(None, 64, backend="host").close()
    return os.path.exists(stale), os.path.exists(live)


def test_stale_socket_directories_of_dead_processes_are_removed():
    assert run_workers(_stale_socket_worker, 2, timeout=120) == [(False, True), (False, True)]


def test_connection_flood_warnings_are_rate_limited(caplog):
    import os
    import socket
    import time

    from torch_sdcp.peer import fd_exchange

    d, path, listener = fd_exchange._make_socket_dir()
    clients = []
    try:
        for _ in range(12):  # connections from a process that is no rank of the group
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(path)
            clients.append(c)
        with caplog.at_level(logging.WARNING, logger="torch_sdcp"):
            served = fd_exchange._serve_fd(listener, 0, 0, 64, {1: 2**22 + 1}, os.getuid(),
                                          time.monotonic() + 1.0)
    finally:
        for c in clients:
            c.close()
        listener.close()
        fd_exchange._remove_socket_dir(d, path)
    assert served == set()
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == fd_exchange._WARNED_CONNECTIONS + 1, texts
    assert "9 more connections" in texts[-1]


def _killed_peer_worker(rank, world):
    import os
    import signal
    import time

    import torch_sdcp

    ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.float32, backend="host", timeout_s=60)
    other = torch_sdcp.ExchangeWorkspace(None, 64, backend="host", timeout_s=60)
    if rank == 0:  # killed while its peer waits in a call that it never makes
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"peer 0 \(pid \d+\) exited") as raised:
        ws.combine(torch.zeros(2, 8, 64), torch.zeros(2, 8))
    waited = time.monotonic() - start  # from before the peer's 0.5 s
    assert waited < 1.5, (waited, str(raised.value))
    start = time.monotonic()
    other.close()  # no barrier with a peer known gone
    ws.close()
    assert time.monotonic() - start < 1.0
    return True


def test_a_killed_peer_is_reported_at_once_whatever_the_timeout():
    assert run_workers(_killed_peer_worker, 2, timeout=120, may_die=(0,)) == [None, True]


def _rows_fallback_worker(rank, world, calls, mode):
    import torch.distributed as dist

    import torch_sdcp
    from torch_sdcp import reference

    out = {}
    kwargs = rank_workspace_args(rank, mode)
    dev = kwargs.get("device", torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    partial, lse = torch.randn(world, 8, 8, 64, generator=g), torch.randn(world, 8, 8, generator=g)
    want = reference.output_lse_shard(*reference.lse_combine_ref64(partial, lse), rank, world)[0]
    partial, lse = partial.to(dev), lse.to(dev)

    def workspace(timeout_s=2.0):
        return torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, dtype=torch.float32, timeout_s=timeout_s, **kwargs)

    def combine(ws, rows):  # on CUDA a kernel's failure is learnt once it ran
        got = ws.combine(partial[rank, :rows], lse[rank, :rows])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            ws.check()
        return got.cpu().double()

    ws = workspace()
    # agreed: every rank takes the collective path; the store round trip per call, measured
    torch.testing.assert_close(combine(ws, 8), want, rtol=1e-5, atol=1e-5)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        combine(ws, 8)
    out["agreed_us"] = (time.perf_counter() - t0) / calls * 1e6
    t0 = time.perf_counter()
    for _ in range(calls):
        torch_sdcp.collective.lse_all_gather_correct_reduce_scatter(partial[rank], lse[rank], return_lse=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out["bare_us"] = (time.perf_counter() - t0) / calls * 1e6
    # rows that differ above max_rows: a named mismatch on every rank, at once, and no collective
    with pytest.raises(RuntimeError, match="call mismatch on the collective path") as e:
        combine(ws, 6 + rank)
    out["mismatch"] = str(e.value)
    ws.close()
    # one rank over the bound, the other within it (the peer path): a void call, named on both
    # ranks at once (docs/PROTOCOL.md), and the workspace stays usable
    ws = workspace()
    t0 = time.monotonic()
    with pytest.raises((ValueError, torch_sdcp.VoidedCallError)) as e:
        combine(ws, 8 if rank == 0 else 2)
    out["disagree"], out["disagree_s"] = str(e.value), time.monotonic() - t0
    torch.testing.assert_close(combine(ws, 8), want, rtol=1e-5, atol=1e-5)
    ws.close()
    # a rank that comes late to the collective path finds the call given up and fails at once
    ws = workspace(timeout_s=1.0)
    if rank == 1:
        time.sleep(1.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        combine(ws, 8)
    out["late"], out["late_s"] = str(e.value), time.monotonic() - t0
    ws.close()
    # nothing was left in flight: the group's collectives and a new workspace on the same group work
    t = torch.tensor([rank + 1.0], device=dev)
    dist.all_reduce(t)
    out["sum"] = t.item()
    with workspace() as ws:
        torch.testing.assert_close(combine(ws, 8), want, rtol=1e-5, atol=1e-5)
    return out


def _check_rows_fallback(results, calls, mode):
    r0, r1 = results
    for r in (r0, r1):
        assert "rank 0: combine() with 6 rows, rank 1: combine() with 7 rows; no rank entered a collective" in \
            r["mismatch"], r["mismatch"]
        assert r["sum"] == 3.0
    # the rank over the bound names the peer's rows; the peer is told of its void call
    assert r0["disagree"].startswith("torch_sdcp: argument 'partial_out': expected 2 rows (rank 1 with 2 rows, the "
                                     "peer path), got 8 rows (over max_rows = 4 on this rank only)"), r0["disagree"]
    assert "rank 0 voided call" in r1["disagree"] and "[rank 0: ValueError: " in r1["disagree"], r1["disagree"]
    assert r0["disagree_s"] < 1.5 and r1["disagree_s"] < 1.5, (r0, r1)  # not timeout_s = 2 s
    assert "but rank 1 did not take the collective path within timeout_s = 1 s" in r0["late"], r0["late"]
    # the late rank learns it from rank 0's abort, or (when it comes first) from the given-up agreement
    assert ("peer 0 aborted" in r1["late"]
            or "but rank 0 gave up on this call after" in r1["late"] and "before this rank came" in r1["late"]), r1
    assert r1["late_s"] < 0.5, r1
    print(f"rows fallback, 2 ranks, {mode}: {max(r0['agreed_us'], r1['agreed_us']):.0f} us per agreed call against "
          f"{max(r0['bare_us'], r1['bare_us']):.0f} us for the bare collective ({calls} calls)")


def test_rows_fallback_is_agreed_before_any_collective():
    results = run_workers(_rows_fallback_worker, 2, args=(200, "host"), timeout=180)
    _check_rows_fallback(results, 200, "host, gloo, FileStore")


def _rows_log_worker(rank, world):
    import torch_sdcp

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("torch_sdcp").addHandler(handler)
    with torch_sdcp.OutputLSEWorkspace(None, 2, 8, 64, dtype=torch.float32, backend="host", timeout_s=60) as ws:
        for rows in (3, 5, 3, 2, 4):  # over the bound, over again with other counts, within it
            ws.combine(torch.randn(rows, 8, 64), torch.randn(rows, 8))
    over = [r for r in records if "exceed max_rows" in r.getMessage()]
    assert [r.levelno for r in over] == [logging.WARNING], [r.getMessage() for r in records]
    assert over[0].getMessage().startswith("torch_sdcp: OutputLSEWorkspace on rank 0: 3 rows exceed max_rows=2;")
    return True


def test_rows_over_the_bound_are_logged_once_per_workspace():
    assert run_workers(_rows_log_worker, 1, timeout=120) == [True]


@requires_gpus(2)
def test_cuda_rows_fallback_is_agreed_on_an_nccl_group():
    results = run_workers(_rows_fallback_worker, 2, args=(200, "cuda"), timeout=300, backend="nccl")
    _check_rows_fallback(results, 200, "cuda, nccl, FileStore")


def test_route_is_the_one_decision_of_a_call():
    import types

    from torch_sdcp.route import PEER, Route, Why, route, route_without_rows

    assert route(None, 1) == Route(False, Why.NO_WORKSPACE)
    assert route(types.SimpleNamespace(peer=False, max_rows=4), 1) == Route(False, Why.PEER_UNAVAILABLE)
    assert route(types.SimpleNamespace(peer=True, max_rows=4), 5) == Route(False, Why.ROWS_OVER_BOUND)
    assert route(types.SimpleNamespace(peer=True, max_rows=4), 4) == PEER == Route(True, None)
    # Bounded in bytes (the exchange): no rows bound is read, only the mode decides.
    assert route_without_rows(types.SimpleNamespace(peer=True)) == PEER
    assert route_without_rows(types.SimpleNamespace(peer=False)) == Route(False, Why.PEER_UNAVAILABLE)
    assert route_without_rows(None) == Route(False, Why.NO_WORKSPACE)


def test_void_placeholders_get_the_arguments_by_name():
    import inspect

    from torch_sdcp.workspaces._guard import named_arguments

    def gather(ql_nope, q_pe, positions, cos_sin_cache, q_scale=None, *, lse_base="e"):
        pass

    sig = inspect.signature(gather)
    assert named_arguments(sig, (1, 2, 3, 4, 5), {}) == dict(ql_nope=1, q_pe=2, positions=3, cos_sin_cache=4,
                                                             q_scale=5, lse_base="e")
    assert named_arguments(sig, (1,), dict(q_pe=2, positions=3, cos_sin_cache=4, lse_base="2")) == dict(
        ql_nope=1, q_pe=2, positions=3, cos_sin_cache=4, q_scale=None, lse_base="2")
    # Arguments that do not bind (a misspelt keyword, one missing): those that name a parameter.
    assert named_arguments(sig, (1, 2), dict(scale=5)) == dict(ql_nope=1, q_pe=2, q_scale=None, lse_base="e")
