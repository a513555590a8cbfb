"""Tests of torch_sdcp.peer.PeerArena.

Host backend: run everywhere (spawned gloo groups, see _dist.py). CUDA backend: needs 2 GPUs.
Each spawn of N python processes importing torch costs seconds, so each test groups several
checks into one spawn; worker functions are module-level so that spawned children import them.
"""

import gc
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers
from _helpers import expect_raises, requires_gpus

from torch_sdcp import peer as peer_mod
from torch_sdcp.peer import PeerArena, fd_exchange
from torch_sdcp.peer.groups import group_store

LEAK_CYCLES = 1000


# ---------------------------------------------------------------------------------------------
# helpers used inside the workers
# ---------------------------------------------------------------------------------------------


def _sdcp_entries():
    """What PeerArena left in this worker's private temporary directory."""
    d = os.environ["SDCP_TEST_TMPDIR"]
    return sorted(e for e in os.listdir(d) if e.startswith("sdcp-"))


def _arena_mappings():
    """Lines of /proc/self/maps that map an arena memfd."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "sdcp-arena" in line]


def _runtime_mappings(lines):
    """How many lines of ``lines`` (/proc/self/maps) are glibc's per-thread
    state: thread stacks (a guard page, then the stack) and malloc's thread
    heaps (64 MiB aligned, read-write, then the reserve up to 64 MiB). Each
    arena creation runs a short-lived thread; glibc keeps the stacks and heaps
    of exited threads for reuse, and on a loaded machine a new thread can start
    before the last one's are free, so these caches grow by a few mappings at
    any cycle: bounded, and no leak of ours."""
    page, heap = os.sysconf("SC_PAGE_SIZE"), 64 << 20
    spans = []
    for line in lines:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) == 5:  # anonymous (no path)
            spans.append((lo, hi, fields[1]))
    counted = 0
    for (lo, hi, perm), (lo2, hi2, perm2) in zip(spans, [*spans[1:], (0, 0, "")], strict=True):
        if perm == "---p" and hi - lo == page and perm2 == "rw-p" and lo2 == hi:
            counted += 2  # a thread stack and its guard page
        elif perm == "rw-p" and lo % heap == 0 and hi - lo <= heap:
            counted += 2 if (perm2 == "---p" and lo2 == hi and hi2 == lo + heap) else 1  # a thread heap
    return counted


def _counts():
    """(descriptors, mappings but glibc's per-thread ones, RSS in kB, glibc's per-thread mappings)."""
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    runtime = _runtime_mappings(lines)
    maps = len(lines) - runtime
    rss_kb = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return fds, maps, rss_kb, runtime


def _word(src, dst):
    return (src + 1) * 1_000_003 + dst * 7919 + 0x1234_0000_0000


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------


def _views_worker(rank, ws):
    N = ws
    nbytes = 3 * 4096 + 100  # not a page multiple: stride rounds up
    a = PeerArena(None, nbytes, backend="host", timeout_s=30)
    stride = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    assert (a.rank, a.world_size, a.backend, a.nbytes_per_rank) == (rank, N, "host", nbytes)
    assert a.device == torch.device("cpu")
    assert a.stride == stride and not a.closed
    assert a.native_peer_atomics is True
    assert _sdcp_entries() == [], _sdcp_entries()  # the socket directory is gone
    assert len(_arena_mappings()) == N

    # data_ptr arithmetic, devices, geometry
    base = a.base_address
    assert a.address(0) == base
    for r in range(N):
        assert a.address(r) == base + r * stride
        v = a.peer_view(r)
        assert v.data_ptr() == base + r * stride and v.dtype == torch.uint8
        assert v.shape == (nbytes,) and v.device.type == "cpu"
        t = a.peer_view(r, torch.float32, (2, 3), offset=64)
        assert t.data_ptr() == a.address(r) + 64 and t.shape == (2, 3) and t.is_contiguous()
    lv = a.local_view()
    assert lv.data_ptr() == a.address(rank) and lv.numel() == nbytes
    assert int(lv.sum()) == 0  # zeroed, probe words cleared
    rm = a.rank_major_view(torch.int32, (N, 4), offset=1024)
    assert rm.shape == (N, N, 4) and rm.stride() == (stride // 4, 4, 1)
    assert rm.data_ptr() == base + 1024 and rm.device.type == "cpu"
    assert a.rank_major_view().shape == (N, nbytes)
    assert a.rank_major_view(torch.float64).shape == (N, nbytes // 8)
    a.barrier()  # every rank has checked its zeroed region before anybody writes

    # writes into every peer through peer_view (words at 0) and rank_major_view (at 1024)
    for dst in range(N):
        a.peer_view(dst, torch.int64, (N,))[rank] = _word(rank, dst)
        rm[dst, rank] = torch.arange(4, dtype=torch.int32) + 100 * rank + dst
    a.barrier()
    own = a.local_view(torch.int64, (N,)).tolist()
    assert own == [_word(src, rank) for src in range(N)], own
    for dst in range(N):
        assert a.peer_view(dst, torch.int64, (N,)).tolist() == [_word(s, dst) for s in range(N)]
        for src in range(N):
            assert rm[dst, src].tolist() == [100 * src + dst + k for k in range(4)]
        assert torch.equal(a.peer_view(dst, torch.int32, (N, 4), offset=1024), rm[dst])

    # argument validation: ValueError naming the argument, the expectation and the value
    msgs = [
        expect_raises(ValueError, a.local_view, torch.int32, None, 2),
        expect_raises(ValueError, a.local_view, torch.uint8, (nbytes + 1,)),
        expect_raises(ValueError, a.local_view, torch.uint8, None, nbytes + 1),
        expect_raises(ValueError, a.peer_view, N),
        expect_raises(ValueError, a.local_view, "float32"),
        expect_raises(ValueError, a.rank_major_view, torch.int64, (4,), nbytes // 8 * 8 - 16),
        expect_raises(ValueError, a.local_view, torch.uint8, (-1,)),
    ]
    assert "'offset'" in msgs[0] and "multiple of 4" in msgs[0] and "got 2" in msgs[0], msgs[0]
    assert "'shape'" in msgs[1] and str(nbytes + 1) in msgs[1], msgs[1]
    assert "'offset'" in msgs[2] and str(nbytes + 1) in msgs[2], msgs[2]
    assert "'rank'" in msgs[3] and f"got {N}" in msgs[3], msgs[3]
    assert "'dtype'" in msgs[4], msgs[4]
    assert "'shape'" in msgs[5] and "32 bytes" in msgs[5], msgs[5]
    assert "'shape'" in msgs[6], msgs[6]

    # close: idempotent; views kept alive stay valid until released
    keep = a.peer_view((rank + 1) % N, torch.int64, (N,))
    keep_rm = a.rank_major_view(torch.int32, (N, 4), offset=1024)
    del lv, rm, v, t
    a.barrier()  # everybody has read everything before anybody closes
    a.close()
    a.close()
    a.close(barrier=False)
    assert a.closed
    assert keep.tolist() == [_word(s, (rank + 1) % N) for s in range(N)]
    keep[0] = 42
    assert int(keep[0]) == 42
    assert keep_rm[rank, rank].tolist() == [100 * rank + rank + k for k in range(4)]
    assert len(_arena_mappings()) == N  # still mapped: views alive
    for fn, args in ((a.local_view, ()), (a.peer_view, (0,)), (a.rank_major_view, ()),
                     (a.address, (0,)), (a.barrier, ())):
        msg = expect_raises(RuntimeError, fn, *args)
        assert "closed" in msg
    del keep
    assert len(_arena_mappings()) == N  # keep_rm still holds the mapping
    del keep_rm
    gc.collect()
    assert _arena_mappings() == []  # last view released: unmapped

    # context manager; world of different sizes per call; __del__ without close (local only)
    with PeerArena(None, 1, backend="host", timeout_s=30) as b:
        assert b.stride == mmap.PAGESIZE
        b.local_view()[0] = 1
        b.barrier()
        assert [int(b.peer_view(r)[0]) for r in range(N)] == [1] * N
    assert b.closed and _arena_mappings() == []
    c = PeerArena(None, 3 * 1024 * 1024, backend="auto", timeout_s=30)  # no GPU here: host
    assert c.backend == "host" if not torch.cuda.is_available() else c.backend in ("host", "cuda")
    c.barrier()
    del c  # __del__: local release only
    gc.collect()
    assert _arena_mappings() == []
    assert _sdcp_entries() == []
    return {"base": base, "stride": stride}


def _failure_worker(rank, ws):
    PeerArena(None, 4096, backend="host", timeout_s=20).close()  # warm-up (thread stacks, ...)
    gc.collect()
    before = _counts()[:2]
    out = {}
    # (a) one rank passes a different nbytes_per_rank
    nbytes = 8192 if rank == 1 else 4096
    try:
        PeerArena(None, nbytes, backend="host", timeout_s=20)
    except Exception as e:
        out["mismatch"] = (type(e).__name__, str(e))
    assert _sdcp_entries() == [], _sdcp_entries()
    # (b) one rank passes an invalid size: every rank raises it
    try:
        PeerArena(None, 0 if rank == ws - 1 else 4096, backend="host", timeout_s=20)
    except Exception as e:
        out["invalid"] = (type(e).__name__, str(e))
    # (c) one rank asks for an unknown backend
    try:
        PeerArena(None, 4096, backend="gpu" if rank == 0 else "host", timeout_s=20)
    except Exception as e:
        out["backend"] = (type(e).__name__, str(e))
    # (d) one rank fails after the plan: allocation
    def hook(stage):
        if stage == "allocate" and rank == 1:
            raise OSError(28, "No space left on device (injected)")
    peer_mod._TEST_HOOK = hook
    try:
        PeerArena(None, 4096, backend="host", timeout_s=20)
    except Exception as e:
        out["hook"] = (type(e).__name__, str(e))
    finally:
        peer_mod._TEST_HOOK = None
    assert _sdcp_entries() == [], _sdcp_entries()
    assert _arena_mappings() == []
    gc.collect()
    out["leaked"] = (before, _counts()[:2])
    # the group is still usable: a good creation works afterwards
    with PeerArena(None, 4096, backend="host", timeout_s=20) as a:
        a.barrier()
    assert _sdcp_entries() == []
    return out


def _leak_worker(rank, ws, cycles, warmup):
    def cycle(i):
        a = PeerArena(None, 64 * 1024, backend="host", timeout_s=30)
        v = a.peer_view((rank + 1) % ws, torch.int64, (4,))
        v[rank] = i
        del v
        a.close()

    for i in range(warmup):  # allocator arenas, thread stacks, gloo buffers reach steady state
        cycle(i)
    gc.collect()
    store = group_store(dist.group.WORLD)
    keys0 = store.num_keys()
    c0 = _counts()
    snapshots = []
    t0 = time.monotonic()
    for i in range(cycles):
        cycle(i)
        if (i + 1) % (cycles // 10) == 0:
            snapshots.append(_counts())
    elapsed = time.monotonic() - t0
    gc.collect()
    c1 = _counts()
    deadline = time.monotonic() + 2.0  # until the peer, the last rank of the last agreement, removed its keys
    while store.num_keys() > keys0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"before": c0, "after": c1, "snapshots": snapshots, "elapsed": elapsed, "keys": (keys0, store.num_keys()),
            "leftover": _sdcp_entries(), "arena_mappings": len(_arena_mappings())}


def _dying_worker(rank, ws, victim, stage, timeout_s):
    def hook(s):
        if rank == victim and s == stage:
            os._exit(7)
    peer_mod._TEST_HOOK = hook
    t0 = time.monotonic()
    try:
        PeerArena(None, 4096, backend="host", timeout_s=timeout_s)
    except Exception as e:
        return {"error": (type(e).__name__, str(e)), "elapsed": time.monotonic() - t0,
                "leftover": _sdcp_entries(), "mappings": len(_arena_mappings())}
    return {"error": None, "elapsed": time.monotonic() - t0}


def _gpu_counts():
    free, _total = torch.cuda.mem_get_info()
    return len(os.listdir("/proc/self/fd")), free


def _cuda_worker(rank, ws):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    nbytes = 5 * 1024 * 1024 + 3
    a = PeerArena(None, nbytes, backend="cuda", timeout_s=60)
    assert a.backend == "cuda" and a.device == dev
    assert a.stride >= nbytes and a.stride % (2 * 1024 * 1024) == 0
    assert a.native_peer_atomics in (True, False, None)
    assert _sdcp_entries() == []
    for r in range(ws):
        v = a.peer_view(r, torch.int64, (ws,))
        assert v.device == dev and v.data_ptr() == a.address(r) == a.base_address + r * a.stride
    assert int(a.local_view().sum()) == 0
    a.barrier()
    rm = a.rank_major_view(torch.float32, (ws, 1024), offset=4096)
    assert rm.device == dev and rm.stride(0) == a.stride // 4 and rm.data_ptr() == a.base_address + 4096
    for dst in range(ws):  # kernels on the local GPU storing into every peer's memory
        a.peer_view(dst, torch.int64, (ws,))[rank] = _word(rank, dst)
        rm[dst, rank] = torch.arange(1024, device=dev, dtype=torch.float32) + rank * 10000 + dst
    torch.cuda.synchronize()
    a.barrier()
    assert a.local_view(torch.int64, (ws,)).tolist() == [_word(s, rank) for s in range(ws)]
    for dst in range(ws):
        for src in range(ws):
            want = torch.arange(1024, device=dev, dtype=torch.float32) + src * 10000 + dst
            assert torch.equal(rm[dst, src], want)
    # views outlive close() and stay valid
    keep = a.peer_view((rank + 1) % ws, torch.int64, (ws,))
    a.barrier()
    a.close()
    a.close()
    assert keep.tolist() == [_word(s, (rank + 1) % ws) for s in range(ws)]
    keep.add_(1)
    torch.cuda.synchronize()
    del keep, rm, v
    torch.cuda.synchronize()
    # "auto" picks cuda on distinct GPUs
    with PeerArena(None, 4096, timeout_s=60) as b:
        assert b.backend == "cuda" and b.device == dev and b.stride % (2 * 1024 * 1024) == 0
    # create/close cycles leak neither descriptors nor GPU memory
    for _ in range(3):
        PeerArena(None, 64 << 20, backend="cuda", timeout_s=60).close()
    torch.cuda.synchronize()
    c0 = _gpu_counts()
    t0 = time.monotonic()
    cycles = 20
    for _ in range(cycles):
        PeerArena(None, 64 << 20, backend="cuda", timeout_s=60).close()
    per_cycle = (time.monotonic() - t0) / cycles
    torch.cuda.synchronize()
    c1 = _gpu_counts()
    assert c1[0] == c0[0], (c0, c1)
    assert c0[1] - c1[1] < (64 << 20), (c0, c1)  # not one region leaked
    assert _sdcp_entries() == []
    return {"atomics": a.native_peer_atomics, "stride": a.stride, "per_cycle_s": per_cycle,
            "gpu": (c0, c1)}


def _cuda_shared_worker(rank, ws):
    torch.cuda.set_device(0)
    out = {}
    try:  # several ranks on one GPU without the opt-in: refused on every rank
        PeerArena(None, 4096, backend="cuda", timeout_s=60)
    except Exception as e:
        out["refused"] = (type(e).__name__, str(e))
    with PeerArena(None, 4096, timeout_s=60) as h:  # "auto" on a shared GPU: host
        out["auto"] = h.backend
    with PeerArena(None, 4096, backend="cuda", allow_shared_device=True, timeout_s=60) as a:
        assert a.device == torch.device("cuda", 0)
        for dst in range(ws):
            a.peer_view(dst, torch.int64, (ws,))[rank] = _word(rank, dst)
        torch.cuda.synchronize()
        a.barrier()
        assert a.local_view(torch.int64, (ws,)).tolist() == [_word(s, rank) for s in range(ws)]
        out["atomics"] = a.native_peer_atomics
    return out


def _cuda_nccl_worker(rank, ws):
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device())
    with PeerArena(None, 1 << 20, backend="cuda", timeout_s=60) as a:
        assert a.device == dev
        rm = a.rank_major_view(torch.int32, (ws,))
        rm[:, rank] = rank + 1
        torch.cuda.synchronize()
        a.barrier()
        assert rm.cpu().tolist() == [[r + 1 for r in range(ws)]] * ws
    try:  # mismatched plan: same error everywhere, also over NCCL
        PeerArena(None, (1 << 20) * (rank + 1), backend="cuda", timeout_s=60)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_views_layout_and_lifetime(world_size):
    results = run_workers(_views_worker, world_size, timeout=120)
    assert all(r["stride"] == results[0]["stride"] for r in results)


def test_collective_failures_same_error_everywhere():
    ws = 3
    results = run_workers(_failure_worker, ws, timeout=120)
    for key in ("mismatch", "invalid", "backend", "hook"):
        errs = {r[key] for r in results}
        assert len(errs) == 1, f"{key}: ranks disagree: {errs}"
    kind, msg = results[0]["mismatch"]
    assert kind == "ValueError" and "'nbytes_per_rank'" in msg and "rank 1: 8192" in msg, msg
    kind, msg = results[0]["invalid"]
    assert kind == "ValueError" and f"rank {ws - 1}" in msg and "got 0" in msg, msg
    kind, msg = results[0]["backend"]
    assert kind == "ValueError" and "'backend'" in msg and "'gpu'" in msg, msg
    kind, msg = results[0]["hook"]
    assert kind == "RuntimeError" and "rank 1" in msg and "injected" in msg, msg
    assert "'allocate'" in msg, msg
    for r in results:
        (fd0, maps0), (fd1, maps1) = r["leaked"]
        assert fd1 <= fd0, f"descriptors leaked by failed creations: {fd0} -> {fd1}"
        assert maps1 - maps0 <= 1, f"mappings leaked by failed creations: {maps0} -> {maps1}"


def test_create_close_cycles_leak_nothing():
    results = run_workers(_leak_worker, 2, args=(LEAK_CYCLES, 100), timeout=170)
    for rank, r in enumerate(results):
        (fd0, maps0, rss0, runtime0), (fd1, maps1, rss1, runtime1) = r["before"], r["after"]
        snaps = r["snapshots"]
        # descriptors: never above the baseline, at every tenth of the run (the count may drop:
        # an unrelated object collected by gc can close one)
        assert fd1 <= fd0 and all(s[0] <= fd0 for s in snaps), (fd0, fd1, snaps)
        # mappings: no arena mapping left, flat over the second half; one extra mapping is
        # tolerated once (the Python/glibc allocator may add a 1 MiB arena in the first cycles)
        assert r["arena_mappings"] == 0 and r["leftover"] == []
        assert maps1 - maps0 <= 1, f"rank {rank}: mappings {maps0} -> {maps1}: {snaps}"
        assert len({s[1] for s in snaps[len(snaps) // 2:]} | {maps1}) == 1, snaps
        # glibc's per-thread mappings: its caches of exited threads' stacks and heaps, bounded (a
        # thread left running per cycle would add a stack per cycle)
        assert runtime1 - runtime0 <= 16, f"rank {rank}: per-thread mappings {runtime0} -> {runtime1}: {snaps}"
        # RSS: small slack (a leaked 64 KiB region per cycle would be > 60 MiB)
        assert rss1 - rss0 < 4 * 1024, f"rank {rank}: RSS grew {rss0} -> {rss1} kB"
        assert r["keys"][1] <= r["keys"][0], f"rank {rank}: the group's store grew: {r['keys']} keys"
    per_cycle_ms = 1000 * max(r["elapsed"] for r in results) / LEAK_CYCLES
    print(f"{LEAK_CYCLES} create/close cycles at world size 2: {per_cycle_ms:.2f} ms per cycle; "
          f"(fds, maps, rss kB) before -> after: {[(r['before'], r['after']) for r in results]}")


@pytest.mark.parametrize("world_size,stage", [(2, "validate"), (3, "exchange")])
def test_rank_dying_during_creation_fails_survivors(world_size, stage):
    timeout_s = 5.0
    victim = world_size - 1
    results = run_workers(_dying_worker, world_size, args=(victim, stage, timeout_s),
                          timeout=90, may_die=(victim,))
    assert results[victim] is None
    for rank in range(world_size - 1):
        r = results[rank]
        assert r["error"] is not None, f"rank {rank} created an arena with a dead peer"
        kind, msg = r["error"]
        assert kind in ("RuntimeError", "TimeoutError", "GroupOutOfStepError"), r["error"]
        assert "PeerArena creation failed" in msg, msg
        # bounded: the exchange (timeout_s) plus one bounded collective (timeout_s)
        assert r["elapsed"] < 2 * timeout_s + 5, r
        assert r["leftover"] == [] and r["mappings"] == 0, r


@requires_gpus(2)
def test_cuda_views_and_peer_stores():
    results = run_workers(_cuda_worker, 2, timeout=300)
    assert results[0]["stride"] == results[1]["stride"]
    assert results[0]["atomics"] == results[1]["atomics"]
    print("cuda:", results)


@requires_gpus(1)
def test_cuda_shared_device_needs_opt_in():
    results = run_workers(_cuda_shared_worker, 2, timeout=300)
    assert len({r["refused"] for r in results}) == 1
    kind, msg = results[0]["refused"]
    assert kind == "RuntimeError" and "allow_shared_device" in msg, msg
    assert [r["auto"] for r in results] == ["host", "host"]


@requires_gpus(2)
def test_cuda_nccl_group():
    results = run_workers(_cuda_nccl_worker, 2, timeout=300, backend="nccl")
    assert results[0] is not None and results[0] == results[1]
    assert "'nbytes_per_rank'" in results[0]


# ---------------------------------------------------------------------------------------------
# single-process tests: credentials, exchange timeouts, no group
# ---------------------------------------------------------------------------------------------


def test_peer_credentials_check():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        me, uid = os.getpid(), os.getuid()
        assert fd_exchange._check_peer_credentials(a, {me}, uid) == me
        assert fd_exchange._check_peer_credentials(a, {me + 1, me}, uid) == me
        with pytest.raises(PermissionError, match="not an expected rank"):
            fd_exchange._check_peer_credentials(a, {me + 1}, uid)
        with pytest.raises(PermissionError, match="uid"):
            fd_exchange._check_peer_credentials(a, {me}, uid + 1)


_FOREIGN_CLIENT = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    # claims to be rank 1; the server may refuse (close) before the hello is sent
    s.sendall(struct.pack("<4sI", b"SDCP", 1))
    msg, fds, flags, _ = socket.recv_fds(s, 64, 4)
except OSError as e:
    msg, fds = b"", []
print(len(msg), len(fds))
"""


def test_foreign_connection_is_refused_and_logged(caplog):
    d = tempfile.mkdtemp(prefix="sdcp-")
    path = os.path.join(d, "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    memfd = os.memfd_create("sdcp-test", os.MFD_CLOEXEC)
    os.ftruncate(memfd, 8192)
    served = {}
    deadline = time.monotonic() + 30
    # rank 0 serves; the only expected peer is "rank 1" = this process (the legit client below)
    server = threading.Thread(target=lambda: served.setdefault("ranks", fd_exchange._serve_fd(
        listener, memfd, 0, 8192, {1: os.getpid()}, os.getuid(), deadline)))
    try:
        with caplog.at_level(logging.WARNING, logger="torch_sdcp"):
            server.start()
            # a foreign process (not in the group) claiming to be rank 1: refused
            out = subprocess.run([sys.executable, "-c", _FOREIGN_CLIENT, path],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["0", "0"], out.stdout
            # an in-group process claiming a rank it is not: refused
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(path)
            s.sendall(fd_exchange._HELLO.pack(fd_exchange._MAGIC, 2))
            assert s.recv(64) == b""
            s.close()
            # the legitimate peer: served
            fd = fd_exchange._fetch_fd(path, 1, 0, os.getpid(), os.getuid(), 8192,
                                       time.monotonic() + 10)
            try:
                assert os.fstat(fd).st_size == 8192
                assert os.path.samestat(os.fstat(fd), os.fstat(memfd))
            finally:
                os.close(fd)
            server.join(10)
        assert served["ranks"] == {1}
        refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refusals) == 2, refusals
        assert "not an expected rank" in refusals[0]
        assert "claims to be rank 2" in refusals[1]
    finally:
        listener.close()
        os.close(memfd)
        os.unlink(path)
        os.rmdir(d)


def test_exchange_times_out_naming_the_missing_rank():
    d = tempfile.mkdtemp(prefix="sdcp-")
    mine, silent = os.path.join(d, "a"), os.path.join(d, "b")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(mine)
    listener.listen(8)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a peer that never answers
    mute.bind(silent)
    mute.listen(8)
    memfd = os.memfd_create("sdcp-test", os.MFD_CLOEXEC)
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 1"):
            fd_exchange._exchange_fds(listener, memfd, 0, 2, 4096, [os.getpid(), os.getpid()],
                                      [mine, silent], os.getuid(), 1.0)
        assert time.monotonic() - t0 < 5
        assert len(os.listdir("/proc/self/fd")) == fds_before
    finally:
        listener.close()
        mute.close()
        os.close(memfd)
        for p in (mine, silent):
            os.unlink(p)
        os.rmdir(d)


def test_requires_initialised_group():
    # A fresh interpreter: the test process may hold a group from other tests.
    code = ("import torch_sdcp\n"
            "from torch_sdcp.peer import PeerArena\n"
            "try:\n"
            "    PeerArena(None, 4096, backend='host')\n"
            "except RuntimeError as e:\n"
            "    assert 'init_process_group' in str(e), e\n"
            "    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stdout + out.stderr


def test_a_ctrl_c_inside_a_release_callback_is_delivered_again():
    """A Ctrl-C whose handler runs inside a callback that C calls (the DLPack deleter of a mapping's
    tensor, a destructor, a finalizer) must not be swallowed there: it is delivered again, so the
    wait that it was meant to end (a host wait checks for it every 20 ms) still ends."""
    from torch_sdcp.peer import dlpack

    class Interrupted:
        def unref(self):
            raise KeyboardInterrupt

    key = -12345
    dlpack._LIVE[key] = (None, None, Interrupted())
    with pytest.raises(KeyboardInterrupt):
        dlpack._dl_deleter_impl(key)
        for _ in range(200):  # the handler runs at the next check of this thread
            time.sleep(0.005)
    assert key not in dlpack._LIVE
