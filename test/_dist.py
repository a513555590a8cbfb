"""Run a function in N spawned processes that share a gloo process group.

    results = run_workers(fn, world_size, args=(...), timeout=60)

`fn(rank, world_size, *args)` must be importable (a module-level function) and return something
picklable. Each worker gets a fresh process group (gloo unless backend="nccl"; FileStore in a
private temporary directory) and a
private TMPDIR (``tempfile.gettempdir()`` in the worker, also passed as ``SDCP_TEST_TMPDIR``), so
tests can check what a worker leaves in its temporary directory.

The call fails (AssertionError) with the workers' output when a worker raises (its traceback is
included), exits without a result, or the whole run exceeds `timeout` seconds (every worker is
killed). Ranks listed in `may_die` may exit without a result; their result is None. A worker that
returned stays until every peer returned or exited (a peer's gloo call after an expected error
must not meet a closed connection), with no gloo call of its own; a worker that raised exits at
once, so that a peer waiting for it in a gloo call fails instead of waiting out gloo's timeout.

The failure names the first real error first (``first error: rank r raised ...``). A gloo error
of a lost connection ("Connection closed by peer", "... reset by peer", "Broken pipe") on a rank
after another rank failed or exited is secondary: that peer's exit closed the connection. It is
shown after the errors that caused it, marked as such, and it still fails the run: it is a rank
without a result (after an expected exit only, a gloo call made after a rank may be gone: a test
to fix, and the failure says so).

`in_turn` runs several workers one after another in one process per rank (one spawn, one CUDA
context): ``run_workers(in_turn, n, args=((fn_a, args_a), (fn_b, args_b)))`` returns, per rank,
the list of the workers' results.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback


def python_ctrl_c() -> None:
    """Give SIGINT Python's own handler where the process inherited it
    ignored (a command started in the background of a shell without job
    control ignores SIGINT, and Python then keeps it ignored): the tests of
    Ctrl-C check what the library does with a KeyboardInterrupt, which an
    ignored signal never raises."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _worker_main(fn, rank, world_size, args, workdir, worker_tmp, store_path, env, backend, deadline):
    python_ctrl_c()
    log = open(os.path.join(workdir, f"log{rank}.txt"), "w", buffering=1)  # noqa: SIM115  (stdout and stderr until exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(env)
    os.environ["TMPDIR"] = worker_tmp
    os.environ["SDCP_TEST_TMPDIR"] = worker_tmp
    tempfile.tempdir = worker_tmp
    result_path = os.path.join(workdir, f"result{rank}.pkl")
    exits = None
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":  # one GPU per rank, round robin
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        # The harness's own keys live in a store of their own: tests count the group's keys.
        exits = dist.FileStore(store_path + ".exit", world_size)
        exits.set(f"pid/{rank}", str(os.getpid()))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        if backend == "gloo":
            # Every rank finishes connecting before any test code runs: a rank
            # that dies on purpose must not break a peer's connection set-up.
            dist.barrier()
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException as e:
        payload = ("error", f"{type(e).__name__}: {e}", traceback.format_exc(), time.time())
    try:
        data = pickle.dumps(payload)
    except Exception as e:
        data = pickle.dumps(("error", f"unpicklable result: {e!r}", traceback.format_exc(), time.time()))
    with open(result_path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(result_path + ".tmp", result_path)
    log.flush()
    if payload[0] == "ok" and exits is not None:
        _wait_for_peers(exits, rank, world_size, deadline)
    # No interpreter teardown: no atexit, no destructors, no collective at exit.
    os._exit(0)


def _process_gone(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _wait_for_peers(store, rank, world_size, deadline):
    """A rank that finished stays until every peer finished too or exited (found by its pid),
    so that its exit, which closes its gloo connections, cannot break a peer still inside a
    collective of its own test code (a barrier after an expected error): gloo reports a closed
    connection as "Connection closed by peer". Only the harness's own file store is used here
    (its keys are never removed: no get waits); bounded by the run's deadline."""
    try:
        store.set(f"finished/{rank}", "1")
        pending = [r for r in range(world_size) if r != rank]
        while pending and time.time() < deadline:
            for r in list(pending):
                exited = store.check([f"pid/{r}"]) and _process_gone(int(store.get(f"pid/{r}")))
                if store.check([f"finished/{r}"]) or exited:
                    pending.remove(r)
            time.sleep(0.01)
    except Exception:
        pass


def _logs(workdir, world_size):
    out = []
    for r in range(world_size):
        p = os.path.join(workdir, f"log{r}.txt")
        try:
            with open(p) as f:
                text = f.read()
        except OSError:
            text = "<no output>"
        out.append(f"----- rank {r} output -----\n{text[-6000:]}")
    return "\n".join(out)


# gloo's words for a connection that the peer's process closed (it exited): read, reset, write.
_CONNECTION_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")
# How late the parent may see an exit that closed a peer's connection (it polls every 20 ms).
_EXIT_SEEN_LATE_S = 1.0


class _Outcome:
    """How one rank ended: ``kind`` "ok", "error" (it raised), "exited" (no result) or "running"
    (killed at the run's timeout, which the failure names first); ``at``: when (time.time() of the
    error, or of the exit as the parent saw it)."""

    def __init__(self, rank, kind, at=None, text="", tb="", exitcode=None, allowed=False):
        self.rank, self.kind, self.at, self.text, self.tb = rank, kind, at, text, tb
        self.exitcode, self.allowed = exitcode, allowed

    @property
    def lost_connection(self):
        return self.kind == "error" and _CONNECTION_LOST.search(self.text) is not None

    def describe(self):
        if self.kind == "error":
            return f"rank {self.rank} raised {self.text}"
        return (f"rank {self.rank} exited with code {self.exitcode}"
                + (" (allowed: may_die)" if self.allowed else " without a result"))


def _causes(outcome, outcomes):
    """The other ranks whose failure or exit came before ``outcome`` (a lost gloo connection): an
    error that is not itself a lost connection, or an exit without a result, allowed or not."""
    found = []
    for o in outcomes:
        if o.rank == outcome.rank or o.at is None or o.lost_connection or o.kind not in ("error", "exited"):
            continue
        late = _EXIT_SEEN_LATE_S if o.kind == "exited" else 0.0
        if o.at <= outcome.at + late:
            found.append(o)
    return found


def _report(outcomes):
    """The failures of a run, the first real error first: errors and exits without a result by
    time, then the secondary errors (a gloo connection lost after another rank's failure or exit),
    each saying which rank's failure or exit came before it. Empty when no rank failed."""
    failed = [o for o in outcomes if o.kind == "error" or (o.kind == "exited" and not o.allowed)]
    secondary = {o.rank: _causes(o, outcomes) for o in failed if o.lost_connection}
    secondary = {r: c for r, c in secondary.items() if c}
    primary = sorted((o for o in failed if o.rank not in secondary), key=lambda o: (o.at is None, o.at or 0.0))
    blocks = []
    for o in primary:
        blocks.append(o.describe() + (f"\n{o.tb}" if o.tb else ""))
    for o in sorted((o for o in failed if o.rank in secondary), key=lambda o: o.at):
        causes = ", ".join(f"rank {c.rank} " + ("raised" if c.kind == "error" else
                                                "exited (allowed: may_die)" if c.allowed else "exited")
                           for c in secondary[o.rank])
        if primary:
            note = f"secondary: the connection closed when {causes} (its process exited); shown, not the cause"
        else:  # only expected exits came before: the test's own gloo call met a rank already gone
            note = (f"the connection closed when {causes}: a gloo call after a rank that may exit was gone "
                    "(order the test's collectives before the step that may end a rank)")
        blocks.append(f"{o.describe()}\n[{note}]\n{o.tb}")
    if not blocks:
        return ""
    return "first error: " + "\n".join(blocks)


def run_workers(fn, world_size, *, args=(), timeout=60.0, may_die=(), env=None, backend="gloo"):
    workdir = tempfile.mkdtemp(prefix="sdcpt-")  # short: AF_UNIX paths are limited to 108 bytes
    try:
        ctx = multiprocessing.get_context("spawn")
        store_path = os.path.join(workdir, "store")
        procs = []
        for r in range(world_size):
            worker_tmp = os.path.join(workdir, f"t{r}")
            os.mkdir(worker_tmp, 0o700)
            p = ctx.Process(target=_worker_main,
                            args=(fn, r, world_size, args, workdir, worker_tmp, store_path,
                                  dict(env or {}), backend, time.time() + timeout - 5.0),
                            daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        exited_at = {}  # rank: when this process saw it exit (the order of the failures)
        while len(exited_at) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in exited_at and not p.is_alive():
                    exited_at[r] = time.time()
            time.sleep(0.02)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:
            os.kill(procs[r].pid, signal.SIGKILL)
        for p in procs:
            p.join(5)
        results, outcomes = [], []
        for r, p in enumerate(procs):
            path = os.path.join(workdir, f"result{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                if r in alive:
                    outcomes.append(_Outcome(r, "running"))
                else:
                    outcomes.append(_Outcome(r, "exited", exited_at.get(r), exitcode=p.exitcode,
                                             allowed=r in may_die))
                continue
            with open(path, "rb") as f:
                payload = pickle.load(f)
            if payload[0] == "ok":
                results.append(payload[1])
                outcomes.append(_Outcome(r, "ok"))
            else:
                results.append(None)
                outcomes.append(_Outcome(r, "error", payload[3], payload[1], payload[2]))
        report = _report(outcomes)
        if alive:
            raise AssertionError(f"workers {alive} did not finish within {timeout} s (killed)\n"
                                 + report + "\n" + _logs(workdir, world_size))
        if report:
            raise AssertionError(report + "\n" + _logs(workdir, world_size))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def in_turn(rank, world_size, *steps):
    """A worker that runs the workers of `steps` ((fn, args) pairs) in turn on
    this rank and returns their results, so that one spawn serves them all."""
    return [fn(rank, world_size, *fn_args) for fn, fn_args in steps]
