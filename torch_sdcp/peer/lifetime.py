"""Lifetime of an arena's local memory: reference counting, and the interpreter-exit flag."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import sys
import threading
from collections.abc import Iterator

# Interpreter exit: nothing collective runs once this is set.
_AT_EXIT = False


def _mark_exit() -> None:
    global _AT_EXIT
    _AT_EXIT = True


atexit.register(_mark_exit)


def _interpreter_exiting() -> bool:
    return _AT_EXIT or sys.is_finalizing()


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """Around the body of a callback whose exceptions nobody sees (a destructor, a finalizer, a
    callback from C): a Ctrl-C whose handler ran inside it is delivered again to the main thread,
    instead of being swallowed, so that the wait it was meant to end (a host wait runs the
    handlers every 20 ms) still ends. Every other exception is dropped."""
    try:
        yield
    except KeyboardInterrupt:
        _thread.interrupt_main()
    except BaseException:
        pass


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
        with interrupts_kept():
            self.release()
