"""Probes 5.x, private by default: nothing `nanoddp train` or `nanoddp.init()` starts listens
beyond loopback.
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
from .observe import LOOPBACK, ip_of, listening
from .registry import probe


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
