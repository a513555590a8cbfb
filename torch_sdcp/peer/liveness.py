"""Peer liveness: one watcher thread per process over the processes of every
watched peer, through pidfds (immune to pid reuse; creation already checked
that every rank shares this host and pid namespace). When a peer's process
exits, every watch that names it is told at once (its callback runs on the
watcher thread), instead of its waits running out their timeout."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

logger = logging.getLogger("torch_sdcp")

#: Called on the watcher thread with (rank, pid) of a peer whose process exited.
ExitCallback = Callable[[int, int], None]


class Watch:
    """The peers of one workspace: ``gone`` holds (rank, pid) of the first peer
    seen to exit; ``cancel()`` stops watching (idempotent)."""

    def __init__(self, peers: dict[int, int], on_exit: ExitCallback) -> None:
        self.peers = dict(peers)
        self.on_exit = on_exit
        self.gone: tuple[int, int] | None = None

    def cancel(self) -> None:
        _watcher.remove(self)

    def exited_now(self) -> tuple[int, int] | None:
        """``gone``, or a peer whose process has exited by now although the
        watcher thread has not told this watch yet (a peer's abort, sent by
        its own watcher, can arrive first): what an error names as its cause."""
        # Polled under the lock (a zero timeout): no pidfd is closed under it,
        # so no fd number polled here can stand for another file meanwhile.
        with _watcher._lock:
            if self.gone is not None:
                return self.gone
            fds = {fd: pid for pid, fd in _watcher._pidfds.items() if pid in self.peers.values()}
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            for fd, events in poller.poll(0) if fds else ():
                if events & select.POLLIN and fd in fds:
                    pid = fds[fd]
                    return next(r for r, p in self.peers.items() if p == pid), pid
        return None


class _Watcher:
    """Only the watcher thread closes a pidfd, between its polls (one no longer
    needed waits in ``_retired`` for the thread's next turn): a fd
    closed under a running poll() can be reused at once by another file (a
    memfd, which always polls readable) or another pid's pidfd, and the poll
    would report a live peer as exited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._pidfds: dict[int, int] = {}  # pid -> pidfd
        self._retired: list[int] = []  # pidfds no longer watched, closed by the watcher thread
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        exited = []
        with self._lock:
            for pid in set(watch.peers.values()) - set(self._pidfds):
                try:
                    self._pidfds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    exited.append(pid)
                except OSError as e:  # no pidfds here (old kernel, seccomp): the timeout still bounds every wait
                    logger.info("torch_sdcp: cannot watch pid %d (%s); a peer's exit is found by the timeout",
                                pid, e)
            self._watches.add(watch)
            self._start_locked()
        for pid in exited:  # gone before it could be watched
            self._exited(pid)
        self._wake()

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
            for pid in set(self._pidfds) - {p for w in self._watches for p in w.peers.values()}:
                self._retired.append(self._pidfds.pop(pid))
        self._wake()

    def _start_locked(self) -> None:
        if self._thread is not None:
            return
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="sdcp-peer-liveness", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):  # already woken
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                for fd in self._retired:  # not polled now: closing cannot alias a fd in a poll
                    os.close(fd)
                self._retired.clear()
                by_fd = {fd: pid for pid, fd in self._pidfds.items()}
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                elif fd in by_fd and events & select.POLLIN:
                    self._exited(by_fd[fd], fd)

    def _exited(self, pid: int, fd: int | None = None) -> None:
        with self._lock:
            if fd is not None and self._pidfds.get(pid) != fd:
                return  # no longer watched (closed by remove() while polled)
            told = [w for w in self._watches if pid in w.peers.values()]
            for w in told:  # before the pidfd goes: Watch.exited_now() sees one or the other
                if w.gone is None:
                    w.gone = (next(r for r, p in w.peers.items() if p == pid), pid)
            fd = self._pidfds.pop(pid, None)
            if fd is not None:  # closed by the watcher thread's next turn (this may run on add()'s caller)
                self._retired.append(fd)
        for w in told:
            rank = next(r for r, p in w.peers.items() if p == pid)
            try:
                w.on_exit(rank, pid)
            except Exception as e:
                logger.warning("torch_sdcp: could not abort a workspace after rank %d (pid %d) exited: %s",
                               rank, pid, e)

    def after_fork_in_child(self) -> None:
        """The child watches nothing of its parent's (the thread did not fork)."""
        for fd in list(self._pidfds.values()) + self._retired + [self._wake_r, self._wake_w]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.__init__()  # type: ignore[misc]


_watcher = _Watcher()
os.register_at_fork(after_in_child=_watcher.after_fork_in_child)


def watch(peers: dict[int, int], on_exit: ExitCallback) -> Watch:
    """Watch the processes ``peers`` ({rank: pid}); ``on_exit(rank, pid)`` runs
    on the watcher thread when one exits (once per peer)."""
    w = Watch(peers, on_exit)
    if peers:
        _watcher.add(w)
    return w
