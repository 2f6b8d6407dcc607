"""Local launch: run `fn(env, *args)` on N processes, like `mp.spawn`, but fail fast and loud.

Why not plain `mp.spawn`? When one rank dies the others sit in a collective forever, and the
parent learns nothing useful. Here the parent watches every child; the first failure (an
exception, a non-zero exit, a signal) stops the rest within seconds and is re-raised in the
parent with the rank and its traceback. Children also die with the parent (PR_SET_PDEATHSIG),
and each takes its own descendants along (`base.processes.take_descendants_along`), so nothing is left even if
the parent is SIGKILLed. `notebook_launch` does the same for a function that spawn cannot import
(defined in a notebook cell or `python -c`), sent by value instead.
"""

from __future__ import annotations

import linecache
import logging
import marshal
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from nanoddp import env as nd
from nanoddp import fork_server
from nanoddp.base.processes import die_with_launcher, stop, take_descendants_along
from nanoddp.fork_server import LauncherView
from nanoddp.tempdirs import make_private_dir

logger = logging.getLogger(__name__)

POLL_S = 0.05
START_METHODS = ("spawn", "forkserver")
# What a rank imports before `fn` (torch, torch.distributed, the env layer): the fork server's once.
RANK_PRELOAD = ("nanoddp.launch",)
SETTLE_S = 1.0  # after a failure, how long to wait for the others' reports


class LaunchError(RuntimeError):
    """A rank failed. `rank` is the first failure seen; `details` is its traceback or exit."""

    def __init__(self, rank: int, details: str, exitcode: int | None = None):
        self.rank = rank
        self.details = details
        self.exitcode = exitcode
        self.other_failures: dict[int, str] = {}  # usually consequences: peers losing rank `rank`
        super().__init__(f"rank {rank} failed: {details}")


def _worker(
    env: nd.DistEnv,
    init_method: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue,
    pg_timeout_s: float,
    launcher_pid: int,
    launcher_view: LauncherView | None,
) -> None:
    """Child entry point: join the group, run the user's function, report back."""
    die_with_launcher(launcher_pid)  # who may have died while this rank imported torch
    if launcher_view is not None:  # forked by the server: become what a spawned rank would be
        launcher_view.take_on()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # torch read it at the server's start
            torch.set_num_threads(int(threads))
    take_descendants_along(new_group=True)
    try:
        nd.init(env, init_method=init_method, timeout=timedelta(seconds=pg_timeout_s))
        value = fn(env, *args)
        # Plain pickle copies tensors into the message; the queue's own pickler would share
        # their storage through this process, which may have exited before the parent reads.
        results.put((env.rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((env.rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        os._exit(1)  # skip cleanup: a barrier with a failed peer would hang
    nd.cleanup()
    results.close()
    results.join_thread()


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode} without reporting a result"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    timeout: float | None = None,
    pg_timeout_s: float = 300.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run `fn(env, *args)` on `nprocs` local processes; return each rank's return value.

    `fn` must be importable (a module-level function), as with `mp.spawn`. The ranks are forked
    from this process's fork server (`nanoddp.fork_server`): a fresh interpreter, started at the
    first launch, that imported torch and nanoddp once (and what `fork_server.preload` named), so
    a rank starts in milliseconds instead of spending a second or two of CPU importing torch, and
    so does every rank of every later launch. Like a spawned rank, it holds nothing of this
    process: no CUDA state, no threads, and `__main__` imported anew; and it sees this process's
    environment variables, working directory and standard streams as they are at this call, not
    as they were when the server started, and `OMP_NUM_THREADS` as at this call sets its
    thread count; it can use multiprocessing itself (a Manager, processes of its own). What
    differs: torch was imported with the environment of the server's start, so another variable
    torch reads only at import changed since then takes effect through `start_method="spawn"`,
    which starts each rank as a fresh interpreter.

    Rendezvous is a `file://` store in a private temp dir, so no port is ever fixed. Raises
    `LaunchError` naming the first rank that failed, and `TimeoutError` if the whole job outlives
    `timeout` seconds; children are stopped either way.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r} "
            "(fork is not offered: the launcher's threads and torch's pools do not survive it)"
        )
    backend = backend or nd.default_backend(nprocs)
    ctx: Any = mp.get_context(start_method)  # SpawnContext or ForkServerContext: both make Processes
    launcher_view = None
    if start_method == "forkserver":
        fork_server.start(RANK_PRELOAD)
        launcher_view = LauncherView.now()
    results: mp.Queue = ctx.Queue()
    rendezvous_dir = make_private_dir("nanoddp-rdzv-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'store')}"
    base_env = nd.DistEnv(0, 0, nprocs, nprocs, 0, nd.device_for(backend, 0), backend)
    procs = []
    try:
        for rank in range(nprocs):
            env = replace(base_env, rank=rank, local_rank=rank, device=nd.device_for(backend, rank))
            proc = ctx.Process(
                target=_worker,
                args=(env, init_method, fn, tuple(args), results, pg_timeout_s, os.getpid(), launcher_view),
                name=f"nanoddp-rank{rank}",
                daemon=False,
            )
            proc.start()
            procs.append(proc)
        return _collect(procs, results, timeout)
    finally:
        stop(procs)
        results.close()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _collect(procs: Sequence[mp.process.BaseProcess], results: mp.Queue, timeout: float | None) -> list[Any]:
    """Wait for every rank's report; raise on the first failure or when time runs out."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> traceback, in arrival order
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(values) < len(procs):
        _read_reports(results, values, errors, wait_s=POLL_S)
        if errors or any(p.exitcode not in (None, 0) for p in procs):
            _raise_root_cause(procs, results, values, errors)
        if deadline is not None and time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(values))
            raise TimeoutError(f"launch timed out after {timeout}s; ranks {missing} still running")
        for rank, proc in enumerate(procs):
            if proc.exitcode == 0 and rank not in values:
                _read_reports(results, values, errors, wait_s=1.0)  # its report may lag its exit
                if rank not in values and not errors:
                    raise LaunchError(rank, _describe_exit(0), 0)
    for proc in procs:
        proc.join()
    if any(p.exitcode != 0 for p in procs):  # a rank returned, then failed leaving the group
        _raise_root_cause(procs, results, values, errors)
    return [values[r] for r in range(len(procs))]


def _read_reports(results: mp.Queue, values: dict[int, Any], errors: dict[int, str], wait_s: float) -> None:
    """Move every queued report into `values`/`errors`, waiting up to `wait_s` for the first."""
    timeout = wait_s
    while True:
        try:
            rank, status, payload = results.get(timeout=timeout)
        except queue.Empty:
            return
        if status == "error":
            errors[rank] = payload
        else:
            values[rank] = pickle.loads(payload)
        timeout = 0.01


def _raise_root_cause(procs, results, values, errors) -> None:
    """One failure drags the others down (their peers vanish mid-collective), so wait a moment
    for the dust to settle and blame the root cause: a rank that died without a word (signal,
    os._exit) if there is one, else the first rank that reported an exception."""
    settle_until = time.monotonic() + SETTLE_S
    while time.monotonic() < settle_until:
        _read_reports(results, values, errors, wait_s=POLL_S)
    silent_deaths = [
        (rank, p.exitcode)
        for rank, p in enumerate(procs)
        if p.exitcode not in (None, 0) and rank not in errors and rank not in values
    ]
    if silent_deaths:
        rank, exitcode = silent_deaths[0]
        error = LaunchError(rank, _describe_exit(exitcode), exitcode)
    elif errors:
        rank = next(iter(errors))
        error = LaunchError(rank, errors[rank], procs[rank].exitcode)
    else:  # every rank reported; one returned, then failed leaving the group (the closing barrier)
        rank, exitcode = next((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0))
        error = LaunchError(rank, f"returned its result, then exited with code {exitcode} while leaving the group "
                                  "(its traceback is on stderr)", exitcode)  # fmt: skip
    error.other_failures = {r: e for r, e in errors.items() if r != rank}
    raise error


def notebook_launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    timeout: float | None = None,
    pg_timeout_s: float = 300.0,
) -> list[Any]:
    """`launch` for a `fn` defined in a notebook cell or `python -c`: run `fn(env, *args)` on
    `nprocs` processes and return each rank's return value, failing exactly as `launch` fails.

    Why by value: `launch` pickles `fn` by reference ("`__main__.train`"), and a rank (forked
    from the fork server, or spawned) starts a fresh `__main__` in which a cell's definitions do
    not exist, so it dies unpickling ("exited with code 1"). Here `cloudpickle` serialises the
    function's code, and the globals, closures and `__main__` classes it uses, by value; the
    children run it through `_run_by_value`, an importable trampoline, on top of `launch` (same
    rendezvous, fail-fast, `LaunchError` with the failing rank's traceback, no orphans).

    Why not fork, which would inherit the cell's definitions for free: by the time a notebook
    calls this, the kernel has threads (ZMQ I/O, heartbeat) and torch has started its own
    (intra/inter-op pools, OpenMP); a forked child gets copies of the locks those threads held,
    but not the threads, and may deadlock in its first parallel op or collective. CUDA cannot be
    used in a forked child at all. A rank of `launch` (a fork of a fresh server, or spawned) plus
    a by-value function has neither problem.

    What travels is a snapshot taken at call time: globals `fn` uses are copied into every child
    (a big tensor in the notebook's namespace is copied `nprocs` times: load data inside `fn`),
    and what a child changes in them does not come back; return values do.
    """
    try:
        payload = _dumps_by_value((fn, tuple(args)))
    except Exception as exc:  # cloudpickle raises many kinds (PicklingError, TypeError, ...)
        raise ValueError(
            f"notebook_launch cannot serialise fn={fn!r} with its args ({type(exc).__name__}: {exc}); "
            "everything fn uses must be picklable by value: create locks, files, sockets and "
            "process groups inside fn instead of capturing them from the notebook"
        ) from exc
    results = launch(
        _run_by_value,
        nprocs,
        args=(payload, _in_memory_sources()),
        backend=backend,
        timeout=timeout,
        pg_timeout_s=pg_timeout_s,
    )
    return [pickle.loads(blob) for blob in results]


def _in_memory_sources() -> dict[str, tuple]:
    """The `linecache` entries of code that has no file (IPython's cells): shipped to the
    children so a failing rank's traceback shows the cell's lines, not just their numbers."""
    return {name: entry for name, entry in linecache.cache.items() if len(entry) == 4 and entry[1] is None}


def _run_by_value(env: nd.DistEnv, payload: bytes, sources: dict[str, tuple]) -> bytes:
    """Child side of `notebook_launch`: rebuild `fn` and its args, run it, and return its value
    by value too (it may be an instance of a class defined in the notebook)."""
    linecache.cache.update(sources)  # mtime None: linecache.checkcache keeps these entries
    fn, args = pickle.loads(payload)  # cloudpickle's output is read by plain pickle
    return _dumps_by_value(fn(env, *args))


def _dumps_by_value(obj: Any) -> bytes:
    """cloudpickle's bytes for `obj`, with code objects kept whole (marshal): cloudpickle >= 3.1.3
    renames every function's file to "<dynamic-code>", and the child's traceback could then no
    longer show the notebook cell's lines from `linecache`."""
    import io

    import cloudpickle  # a core dependency, imported here: `launch` alone never needs it

    class CodeKeepingPickler(cloudpickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, types.CodeType):  # same interpreter on both sides: marshal is exact
                return marshal.loads, (marshal.dumps(value),)
            return super().reducer_override(value)

    buffer = io.BytesIO()
    CodeKeepingPickler(buffer).dump(obj)
    return buffer.getvalue()
