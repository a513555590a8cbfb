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
        with _watcher._lock:  # pidfds are opened and closed under it: each fd here is its pid's
            if self.gone is not None:
                return self.gone
            for rank, pid in self.peers.items():
                fd = _watcher._pidfds.get(pid)
                if fd is not None and _has_exited(fd):
                    return rank, pid
        return None


def _has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return any(events & select.POLLIN for _, events in poller.poll(0))


class _Watcher:
    """The watcher thread polls the pidfds outside the lock, so a fd it polls
    can be closed meanwhile (a workspace closed) and its number reused by
    another file (a memfd always polls readable) or by another pidfd. What a
    poll reports is therefore only a hint: an exit counts once the pid's pidfd,
    read under the lock (where pidfds are opened and closed), polls readable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._pidfds: dict[int, int] = {}  # pid -> pidfd
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
        # Gone before it could be watched: only this watch is told (no pidfd vouches for the pid,
        # which another process may hold by now).
        for pid in exited:
            with self._lock:
                self._mark_gone_locked([watch], pid)
            self._notify([watch], pid)
        self._wake()

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
            for pid in set(self._pidfds) - {p for w in self._watches for p in w.peers.values()}:
                os.close(self._pidfds.pop(pid))
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

    def _exited(self, pid: int, fd: int) -> None:
        with self._lock:
            if self._pidfds.get(pid) != fd or not _has_exited(fd):
                return  # no longer watched, or the fd polled was another file by then (a live peer)
            told = [w for w in self._watches if pid in w.peers.values()]
            self._mark_gone_locked(told, pid)  # before the pidfd goes: Watch.exited_now() sees one or the other
            os.close(self._pidfds.pop(pid))
        self._notify(told, pid)

    @staticmethod
    def _mark_gone_locked(told: list[Watch], pid: int) -> None:
        for w in told:
            if w.gone is None:
                w.gone = (next(r for r, p in w.peers.items() if p == pid), pid)

    @staticmethod
    def _notify(told: list[Watch], pid: int) -> None:
        for w in told:
            rank = next(r for r, p in w.peers.items() if p == pid)
            try:
                w.on_exit(rank, pid)
            except Exception as e:
                logger.warning("torch_sdcp: could not abort a workspace after rank %d (pid %d) exited: %s",
                               rank, pid, e)

    def after_fork_in_child(self) -> None:
        """The child watches nothing of its parent's (the thread did not fork)."""
        for fd in list(self._pidfds.values()) + [self._wake_r, self._wake_w]:
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
