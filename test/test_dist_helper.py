"""The multi-process test helper (test/_dist.py): a run whose rank fails
names that rank's error first, and a peer's gloo error of a lost connection
that followed it (the failed rank exited, closing its connections) is shown
after it, marked secondary; the run still fails. A gloo call after a rank
that may exit (``may_die``) is gone fails the run too, saying so."""

from __future__ import annotations

import re
import time

import pytest
from _dist import run_workers


def _exit_then_barrier_worker(rank, world, how):
    import os

    import torch.distributed as dist

    if rank == 0:
        if how == "raise":
            raise ValueError("rank 0's own failure")
        os._exit(3)  # an expected exit (may_die)
    time.sleep(0.5)
    dist.barrier()  # meets rank 0's closed connection
    return True


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_the_first_real_error_comes_first_and_a_lost_connection_is_secondary(how):
    with pytest.raises(AssertionError) as failed:
        run_workers(_exit_then_barrier_worker, 2, args=(how,), timeout=120, may_die=(0,) if how == "exit" else ())
    text = str(failed.value)
    lost = re.search(r"rank 1 raised RuntimeError: .*(Connection closed by peer|reset by peer|Broken pipe)", text)
    assert lost is not None, text
    if how == "raise":
        assert text.startswith("first error: rank 0 raised ValueError: rank 0's own failure\n"), text
        assert text.index("[secondary: the connection closed when rank 0 raised") > lost.start(), text
    else:
        assert text.startswith("first error: rank 1 raised RuntimeError: "), text
        assert "[the connection closed when rank 0 exited (allowed: may_die): a gloo call after a rank that may " \
               "exit was gone" in text, text
