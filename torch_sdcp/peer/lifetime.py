"""Lifetime of an arena's local memory: reference counting, and the interpreter-exit flag."""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading

# Interpreter exit: nothing collective runs once this is set.
_AT_EXIT = False


def _mark_exit() -> None:
    global _AT_EXIT
    _AT_EXIT = True


atexit.register(_mark_exit)


def _interpreter_exiting() -> bool:
    return _AT_EXIT or sys.is_finalizing()


class _Mapping:
    """The memory backend of one arena, reference counted: the arena holds one reference, the
    storage of its views holds one; the last unref() releases the backend. release() is
    idempotent."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._refs = 0
        self._lock = threading.Lock()

    def ref(self) -> None:
        with self._lock:
            self._refs += 1

    def unref(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs <= 0
        if last:
            self.release()

    def release(self) -> None:
        self.backend.release()

    def __del__(self) -> None:  # backstop; normally released through unref()
        with contextlib.suppress(BaseException):
            self.release()
