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
must not meet a closed connection), with no gloo call of its own.

`in_turn` runs several workers one after another in one process per rank (one spawn, one CUDA
context): ``run_workers(in_turn, n, args=((fn_a, args_a), (fn_b, args_b)))`` returns, per rank,
the list of the workers' results.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback


def _worker_main(fn, rank, world_size, args, workdir, worker_tmp, store_path, env, backend, deadline):
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
        payload = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception as e:
        data = pickle.dumps(("error", f"unpicklable result: {e!r}", traceback.format_exc()))
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
        timed_out = False
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                timed_out = True
        if timed_out:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(5)
            raise AssertionError(f"workers {alive} did not finish within {timeout} s (killed)\n"
                                 + _logs(workdir, world_size))
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(workdir, f"result{r}.pkl")
            if not os.path.exists(path):
                if r in may_die:
                    results.append(None)
                    continue
                errors.append(f"rank {r} exited with code {p.exitcode} without a result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                payload = pickle.load(f)
            if payload[0] == "ok":
                results.append(payload[1])
            else:
                errors.append(f"rank {r} raised {payload[1]}\n{payload[2]}")
                results.append(None)
        if errors:
            raise AssertionError("\n".join(errors) + "\n" + _logs(workdir, world_size))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def in_turn(rank, world_size, *steps):
    """A worker that runs the workers of `steps` ((fn, args) pairs) in turn on
    this rank and returns their results, so that one spawn serves them all."""
    return [fn(rank, world_size, *fn_args) for fn, fn_args in steps]
