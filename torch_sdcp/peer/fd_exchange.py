"""File-descriptor exchange over AF_UNIX sockets (SCM_RIGHTS), with SO_PEERCRED checks."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("torch_sdcp")

_MAGIC = b"SDCP"
_HELLO = struct.Struct("<4sI")   # magic, rank of the connecting process
_REPLY = struct.Struct("<4sIQ")  # magic, rank of the serving process, bytes of its allocation
_UCRED = struct.Struct("3i")     # struct ucred: pid, uid, gid


def _check_peer_credentials(sock: socket.socket, expected_pids, uid: int) -> int:
    """Return the pid of the process at the other end of the connected AF_UNIX socket `sock` if
    it runs as `uid` and its pid is in `expected_pids`; raise PermissionError otherwise."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, peer_uid, _gid = _UCRED.unpack(raw)
    if peer_uid != uid:
        raise PermissionError(f"peer pid {pid} runs as uid {peer_uid}, expected uid {uid}")
    if pid not in expected_pids:
        raise PermissionError(
            f"peer pid {pid} (uid {peer_uid}) is not an expected rank of this group "
            f"(expected one of pids {sorted(expected_pids)})")
    return pid


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return buf


def _serve_fd(listener: socket.socket, fd: int, my_rank: int, nbytes: int,
              expected: dict[int, int], uid: int, deadline: float,
              stop: threading.Event | None = None) -> set:
    """Accept connections on `listener` and send `fd` to each verified peer, until every rank of
    `expected` (rank -> pid) has been served, `deadline` (time.monotonic()) passes, or `stop` is
    set. A connection is served only if SO_PEERCRED gives our uid and the pid that `expected`
    gives for the rank it claims; anything else is refused (closed) and logged as a warning.
    Returns the set of ranks served."""
    served: set = set()
    pids = set(expected.values())
    refused = 0  # a flood of foreign connections logs _WARNED_CONNECTIONS warnings, then one count
    while len(served) < len(expected):
        if stop is not None and stop.is_set():
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        listener.settimeout(min(left, 0.1))
        try:
            conn, _ = listener.accept()
        except (TimeoutError, BlockingIOError, InterruptedError):
            continue
        with conn:
            try:
                pid = _check_peer_credentials(conn, pids, uid)
                magic, peer = _HELLO.unpack(_recv_exact(conn, _HELLO.size, deadline))
                if magic != _MAGIC:
                    raise PermissionError(f"pid {pid} sent an unknown greeting {magic!r}")
                if expected.get(peer) != pid:
                    raise PermissionError(
                        f"pid {pid} claims to be rank {peer}, whose pid is {expected.get(peer)}")
                if peer in served:
                    raise PermissionError(f"rank {peer} (pid {pid}) was already served")
                conn.settimeout(_remaining(deadline))
                socket.send_fds(conn, [_REPLY.pack(_MAGIC, my_rank, nbytes)], [fd])
                served.add(peer)
            except PermissionError as e:
                refused += 1
                if refused <= _WARNED_CONNECTIONS:
                    logger.warning("torch_sdcp: PeerArena rank %d refused a connection on its "
                                   "descriptor-exchange socket: %s", my_rank, e)
            except (OSError, ValueError, struct.error) as e:
                refused += 1
                if refused <= _WARNED_CONNECTIONS:
                    logger.warning("torch_sdcp: PeerArena rank %d dropped a connection on its "
                                   "descriptor-exchange socket: %r", my_rank, e)
    if refused > _WARNED_CONNECTIONS:
        logger.warning("torch_sdcp: PeerArena rank %d refused or dropped %d more connections on its "
                       "descriptor-exchange socket", my_rank, refused - _WARNED_CONNECTIONS)
    return served


def _fetch_fd(path: str, my_rank: int, peer: int, peer_pid: int, uid: int, nbytes: int,
              deadline: float) -> int:
    """Connect to rank `peer`'s socket at `path`, check that the listener is that rank's process,
    and receive its descriptor. Returns the received fd (the caller closes it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        s.settimeout(_remaining(deadline))
        s.connect(path)
        _check_peer_credentials(s, {peer_pid}, uid)
        s.sendall(_HELLO.pack(_MAGIC, my_rank))
        s.settimeout(_remaining(deadline))
        msg, fds, flags, _ = socket.recv_fds(s, 4 * _REPLY.size, 4)
        if not msg and not fds:
            raise ConnectionError("the peer closed the connection without sending its "
                                  "descriptor (it refused us or failed)")
        if flags & getattr(socket, "MSG_CTRUNC", 0) or len(fds) != 1 or len(msg) != _REPLY.size:
            raise ConnectionError(f"malformed reply: {len(msg)} bytes, {len(fds)} descriptors, "
                                  f"flags 0x{flags:x}")
        magic, r, n = _REPLY.unpack(msg)
        if magic != _MAGIC or r != peer or n != nbytes:
            raise ConnectionError(f"unexpected reply (magic {magic!r}, rank {r}, {n} bytes), "
                                  f"expected (rank {peer}, {nbytes} bytes)")
        return fds.pop()
    finally:
        for f in fds:
            os.close(f)
        s.close()


def _exchange_fds(listener: socket.socket, fd: int, rank: int, world_size: int, nbytes: int,
                  pids: Sequence[int], paths: Sequence[str], uid: int,
                  timeout_s: float) -> dict[int, int]:
    """Serve our fd to every peer (a thread) while fetching every peer's fd (this thread).
    Returns {rank: received fd} for every peer; on failure closes what it received and raises."""
    deadline = time.monotonic() + timeout_s
    expected = {r: pids[r] for r in range(world_size) if r != rank}
    stop = threading.Event()
    box: dict[str, Any] = {}
    # The server's own descriptor: a server still running after the join's bound can never send
    # a file that reused the caller's fd number once the caller closed it.
    served_fd = os.dup(fd)

    def serve():
        try:
            box["served"] = _serve_fd(listener, served_fd, rank, nbytes, expected, uid, deadline, stop)
        except BaseException as e:
            box["error"] = e
        finally:
            os.close(served_fd)

    thread = threading.Thread(target=serve, name=f"sdcp-fd-server-{rank}", daemon=True)
    try:
        thread.start()
    except BaseException:
        os.close(served_fd)
        raise
    received: dict[int, int] = {}
    ok = False
    try:
        for k in range(1, world_size):
            peer = (rank + k) % world_size
            try:
                received[peer] = _fetch_fd(paths[peer], rank, peer, pids[peer], uid, nbytes,
                                           deadline)
            except TimeoutError as e:
                raise TimeoutError(f"timed out after {timeout_s} s fetching the descriptor of "
                                   f"rank {peer}") from e
            except (OSError, ValueError, struct.error) as e:
                raise RuntimeError(f"could not fetch the descriptor of rank {peer} from its "
                                   f"socket: {e!r}") from e
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if thread.is_alive():
            stop.set()
            thread.join(5.0)
        if "error" in box:
            raise RuntimeError(f"descriptor server failed: {box['error']!r}")
        missing = sorted(set(expected) - box.get("served", set()))
        if missing:
            raise TimeoutError(f"ranks {missing} did not fetch this rank's descriptor within "
                               f"{timeout_s} s")
        ok = True
        return received
    finally:
        if not ok:
            stop.set()
            thread.join(5.0)
            for f in received.values():
                os.close(f)


_MAX_UNIX_PATH = 107
# Warnings per exchange about refused or dropped connections (then one count).
_WARNED_CONNECTIONS = 3
_SOCKET_DIR_PREFIX = "sdcp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_stale_socket_dirs(base: str) -> None:
    """Remove the socket directories (sdcp-<pid>-*) that processes of this user
    left behind when they died before close(): their pid no longer runs."""
    uid = os.getuid()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "sdcp" or not parts[1].isdigit() or _pid_alive(int(parts[1])):
            continue
        d = os.path.join(base, name)
        try:
            if os.lstat(d).st_uid != uid or not os.path.isdir(d) or os.path.islink(d):
                continue
            for entry in os.listdir(d):
                os.unlink(os.path.join(d, entry))
            os.rmdir(d)
        except OSError:  # another process cleaning up at the same time, or not ours to remove
            continue


def _make_socket_dir() -> tuple[str, str, socket.socket]:
    base = tempfile.gettempdir()
    if len(os.path.join(base, "sdcp-4194304-XXXXXXXX", "x" * 32)) > _MAX_UNIX_PATH:
        base = "/tmp"
    _remove_stale_socket_dirs(base)
    d = tempfile.mkdtemp(prefix=f"{_SOCKET_DIR_PREFIX}{os.getpid()}-", dir=base)  # mode 0700
    path = os.path.join(d, secrets.token_hex(16))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        s.listen(128)
    except BaseException:
        s.close()
        _remove_socket_dir(d, path)
        raise
    return d, path, s


def _remove_socket_dir(d: str | None, path: str | None) -> None:
    for name, remove in ((path, os.unlink), (d, os.rmdir)):
        if name:
            try:
                remove(name)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("torch_sdcp: could not remove %s: %s", name, e)



class _ExchangeSocket:
    """This rank's listening socket for one exchange, in its private directory. close() closes
    the socket and removes both; idempotent, so it can run on success and on failure."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.path: str | None = None
        self.listener: socket.socket | None = None

    def open(self) -> str:
        self.dir, self.path, self.listener = _make_socket_dir()
        return self.path

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        _remove_socket_dir(self.dir, self.path)
        self.dir = self.path = None
