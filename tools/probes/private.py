"""Probes 5.x, private by default: nothing `nanoddp train`, `nanoddp.init()`, a user's script
under `nanoddp run` or the notebook's workers start listens beyond loopback, also where the
hostname resolves to the machine's network address.

Sockets are read from outside (psutil on the worker pids), as another user of the host would
see them, while the job is up and its gloo pairs are connected.
"""

from __future__ import annotations

import json

import psutil

from .context import (
    LONG,
    PYTHON,
    REFUSAL_TIMEOUT_S,
    TRAIN_TIMEOUT_S,
    Ctx,
    ProbeError,
    flags,
    nanoddp_argv,
    short,
    snap,
    wait_until,
)
from .jobs import LOOP, Job
from .observe import LOOPBACK, ip_of, listening
from .registry import probe
from .verdicts import pytest_row


@probe(
    "5.1",
    "listening TCP sockets of a `nanoddp train` agent and its workers",
    "all on 127.0.0.1 / ::1",
)
def train_listens_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    run = ctx.start(nanoddp_argv("train", *flags(out=out, **LONG)))
    wait_until(lambda: run.done or snap(out, 10).exists(), TRAIN_TIMEOUT_S, "the first snapshot")
    if run.done:
        raise ProbeError(f"the run ended before the check (exit {run.rc})")
    run.record()
    workers = run.workers()
    sockets = {"agent": listening(psutil.Process(run.pid))}
    for worker in workers:
        sockets[f"worker {worker.pid}"] = listening(worker)
    addresses = [a for found in sockets.values() for a in found]
    public = [a for a in addresses if ip_of(a) not in LOOPBACK]
    ok = len(workers) == 2 and bool(addresses) and not public
    shown = "; ".join(f"{who}: {', '.join(found) or 'none'}" for who, found in sockets.items())
    return ok, f"{shown}" + (f"; NOT loopback: {public}" if public else "")


INIT_LISTENERS = """
import json

import psutil
import torch

import nanoddp

nanoddp.init()  # one process, no MASTER_ADDR
torch.distributed.all_reduce(torch.ones(1))
me = psutil.Process()
connections = me.net_connections(kind="tcp") if hasattr(me, "net_connections") else me.connections("tcp")
print(json.dumps(sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN)))
nanoddp.cleanup()
"""


@probe("5.2", "`nanoddp.init()` in one process without MASTER_ADDR", "listens on loopback only (or not at all)")
def init_listens_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.run([PYTHON, "-c", INIT_LISTENERS], REFUSAL_TIMEOUT_S)
    if run.rc != 0:
        return False, f"exit {run.rc}: {short(run.err[-600:])}"
    addresses = json.loads(run.out.strip().splitlines()[-1])
    public = [a for a in addresses if ip_of(a) not in LOOPBACK]
    return not public, f"listening: {', '.join(addresses) or 'none'}" + (f"; NOT loopback: {public}" if public else "")


def loopback_verdict(sockets: dict[str, list[str]], workers: int) -> tuple[bool, str]:
    """Every worker listens somewhere (gloo does on every rank) and nothing beyond loopback."""
    addresses = [a for found in sockets.values() for a in found]
    public = [a for a in addresses if ip_of(a) not in LOOPBACK]
    listed = [who for who in sockets if who.startswith("worker")]
    ok = workers == 2 and all(sockets[who] for who in listed) and not public
    shown = "; ".join(f"{who}: {', '.join(found) or 'none'}" for who, found in sockets.items())
    return ok, f"{shown}" + (f"; NOT loopback: {public}" if public else "")


@probe(
    "5.3",
    'listening TCP sockets of `nanoddp run` workers whose script calls `dist.init_process_group("gloo")`',
    "single node: every worker's (and the launcher's) listening sockets on 127.0.0.1 / ::1",
)
def run_script_listens_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    job = Job(ctx, LOOP, script_args=("sleep",))
    workers = job.wait_for_workers()
    sockets = {"launcher": listening(psutil.Process(job.run.pid))}
    for rank, worker in enumerate(workers):
        sockets[f"worker rank {rank}"] = listening(worker)
    return loopback_verdict(sockets, len(workers))


# The notebook's worker pool (what `%load_ext nanoddp` / `%dist_start 2` starts), up and joined.
NOTEBOOK_POOL = """
import json, sys, time
from nanoddp.notebook.pool import WorkerPool
pool = WorkerPool(2, "gloo", ["cpu", "cpu"], num_threads=1, pg_timeout_s=60)
pool.start(timeout_s=120)
print("POOL " + json.dumps(pool.pids()), flush=True)
time.sleep(float(sys.argv[1]))
pool.shutdown()
"""


@probe(
    "5.4",
    "listening TCP sockets of the notebook's 2 worker processes (WorkerPool, gloo)",
    "every worker's listening sockets on 127.0.0.1 / ::1",
)
def notebook_workers_listen_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.start([PYTHON, "-c", NOTEBOOK_POOL, str(TRAIN_TIMEOUT_S)])
    wait_until(lambda: run.done or "POOL " in run.out, TRAIN_TIMEOUT_S, "the notebook pool to start")
    if run.done:
        raise ProbeError(f"the pool did not start (exit {run.rc}): {short(run.err[-400:])}")
    pids = json.loads(run.out.split("POOL ", 1)[1].splitlines()[0])
    sockets = {}
    for rank, pid in enumerate(pids):
        sockets[f"worker rank {rank}"] = listening(psutil.Process(pid))
    run.kill()
    return loopback_verdict(sockets, len(pids))


@probe(
    "5.5",
    "every single-node launcher (`nanoddp train`, `nanoddp run`, `launch`, `notebook_launch`, the notebook's "
    "pool) where the hostname resolves to the network address (tests/reliability/test_loopback.py, unshare)",
    "pytest -k whatever_the_hostname passes: every listening socket of every process on 127.0.0.1 / ::1",
)
def launchers_listen_on_loopback_whatever_the_hostname(ctx: Ctx) -> tuple[bool | None, str]:
    ok, outcome = pytest_row(ctx, "tests/reliability/test_loopback.py", "-rs", "-k", "whatever_the_hostname")
    if ok and "passed" not in outcome:  # skipped: no root, no unshare or no network address here
        return None, outcome
    return ok, outcome
