"""Probes 11.x, nothing outlives its launcher: SIGKILL the launcher of `nanoddp run`, `nanoddp
train` or `nanoddp.launch` and every process of its job goes too, what the ranks started
included, and so do ranks still importing torch when the launcher died.

A SIGKILL runs no cleanup in the launcher. Every descendant is recorded while the launcher
lives (`Watched`), so a child re-parented away after the kill is still checked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil

from .context import GONE_WITHIN_S, PYTHON, TRAIN_TIMEOUT_S, Ctx, ProbeError, flags, nanoddp_argv, short, wait_until
from .jobs import alive
from .registry import probe
from .watched import Watched

STARTING_GONE_WITHIN_S = 60.0  # a rank still importing torch notices the dead launcher once through

# Each rank starts a child that would sleep for minutes, then writes READY/rank<r>.pid and holds.
CHILD = """
import os, subprocess, time
def start_child_and_hold(rank, ready_dir):
    subprocess.Popen(["sleep", "300"])
    path = os.path.join(ready_dir, f"rank{rank}.pid")
    open(path + ".tmp", "w").write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(300)
"""

RUN_SCRIPT = f"""{CHILD}
import sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
start_child_and_hold(dist.get_rank(), sys.argv[1])
"""

LAUNCH_SCRIPT = f"""{CHILD}
import sys
import torch
import nanoddp

def rank_main(env, ready_dir):
    torch.set_num_threads(1)
    torch.distributed.all_reduce(torch.ones(1))
    start_child_and_hold(env.rank, ready_dir)

if __name__ == "__main__":
    nanoddp.launch(rank_main, 2, args=(sys.argv[1],), backend="gloo", timeout=600)
"""
# The same job with ranks that start as fresh interpreters: a window of seconds (torch's import)
# in which a rank is alive but not yet in its function. (Forked ranks have their imports done.)
SPAWNING_LAUNCH_SCRIPT = LAUNCH_SCRIPT.replace("timeout=600)", 'timeout=600, start_method="spawn")')

# `nanoddp train`'s workers run no user code; a library that starts a helper process when it is
# imported (a metrics or profiling service) stands in for it: Python imports `sitecustomize`
# from PYTHONPATH at start-up, and this one starts the child in torchrun's workers only.
# (tests/reliability/test_orphans.py runs these same jobs.)
# Each torchrun worker (and each replica under --on-failure continue) starts a child once it
# leads its own process group: a worker run as a fresh interpreter does from its first line
# (torchrun starts it in a session of its own); one forked from a fork server learns its rank
# and makes its group after the fork, so a thread started at the fork waits for both.
SITECUSTOMIZE = """
import os, subprocess, threading, time
def a_worker():
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
    return (torchrun or "NANODDP_FT_REPLICA" in os.environ) and os.getpgid(0) == os.getpid()
def start_child_once_a_worker():
    while not a_worker():
        time.sleep(0.05)
    subprocess.Popen(["sleep", "300"])
if a_worker():
    subprocess.Popen(["sleep", "300"])
else:
    os.register_at_fork(after_in_child=lambda: threading.Thread(target=start_child_once_a_worker, daemon=True).start())
"""


def _start_script(ctx: Ctx, text: str, *prefix: str) -> tuple[Watched, Path]:
    ready = ctx.dir / "ready"
    ready.mkdir()
    script = ctx.dir / "job.py"
    script.write_text(text)
    return ctx.start([*prefix, str(script), str(ready)]), ready


def _ranks_ready(run: Watched, ready: Path) -> bool:
    return run.done or all((ready / f"rank{rank}.pid").exists() for rank in (0, 1))


def _sleepers(run: Watched) -> int:
    run.record()
    return sum(cmd.startswith("sleep ") for _, cmd in run.seen.values())


def _kill_survivors(survivors: list[psutil.Process]) -> None:
    """The probe's own cleanup after a failure: the survivors and what they started since the
    kill (out of the launcher's tree by then, so `Watched` never saw it)."""
    for survivor in survivors:
        with contextlib.suppress(psutil.Error):  # psutil checks it is still the process seen
            for proc in [*survivor.children(recursive=True), survivor]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()


def _killed(run: Watched, within: float) -> tuple[bool, str]:
    """SIGKILL the launcher; whether every process seen in its tree is gone `within` seconds."""
    if run.done:
        raise ProbeError(f"the launcher exited {run.rc} before the kill: {short(run.err[-600:])}")
    run.record()
    seen = run.descendants()
    os.kill(run.pid, signal.SIGKILL)
    killed = time.monotonic()
    left = alive(seen, within)
    after = time.monotonic() - killed
    run.wait(30)
    status = f"{len(seen)} process(es) seen under the launcher; "
    if not left:
        return True, status + f"all gone {after:.1f} s after the kill"
    _kill_survivors([run.seen[pid][0] for pid in left])
    shown = [run.seen[pid][1][:60] for pid in left]
    return False, status + f"{len(left)} alive {after:.0f} s after the kill: {shown}"


@probe(
    "11.1",
    "SIGKILL of the `nanoddp run` launcher whose 2 ranks each started a child (`sleep 300`)",
    f"the workers and their children all gone within {GONE_WITHIN_S:.0f} s",
)
def run_children_die(ctx: Ctx) -> tuple[bool, str]:
    run, ready = _start_script(ctx, RUN_SCRIPT, *nanoddp_argv("run", "--nproc", 2))
    wait_until(lambda: _ranks_ready(run, ready), TRAIN_TIMEOUT_S, "both ranks to start their child")
    return _killed(run, GONE_WITHIN_S)


@probe(
    "11.2",
    "SIGKILL of the `nanoddp train` launcher whose 2 workers each started a child (from sitecustomize)",
    f"the workers and their children all gone within {GONE_WITHIN_S:.0f} s",
)
def train_children_die(ctx: Ctx) -> tuple[bool, str]:
    site = ctx.dir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = ctx.dir / "run"
    argv = nanoddp_argv("train", *flags(out=out, steps=100000, snapshot_every=0, log_every=1))
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    run = ctx.start(["env", f"PYTHONPATH={pythonpath}", *argv])
    log = out / "logs" / "rank0.log"
    wait_until(lambda: run.done or (log.is_file() and "step " in log.read_text()), TRAIN_TIMEOUT_S, "a step")
    wait_until(lambda: run.done or _sleepers(run) == 2, 30, "both workers' children")
    return _killed(run, GONE_WITHIN_S)


@probe(
    "11.3",
    "SIGKILL of a `nanoddp.launch` parent whose 2 ranks each started a child (`sleep 300`)",
    f"the ranks and their children all gone within {GONE_WITHIN_S:.0f} s",
)
def launch_children_die(ctx: Ctx) -> tuple[bool, str]:
    run, ready = _start_script(ctx, LAUNCH_SCRIPT, PYTHON)
    wait_until(lambda: _ranks_ready(run, ready), TRAIN_TIMEOUT_S, "both ranks to start their child")
    return _killed(run, GONE_WITHIN_S)


@probe(
    "11.4",
    "SIGKILL of a `nanoddp.launch(start_method='spawn')` parent right after it spawned its 2 ranks "
    "(still importing torch)",
    f"no rank joins a group; all gone within {STARTING_GONE_WITHIN_S:.0f} s",
)
def launch_starting_ranks_die(ctx: Ctx) -> tuple[bool, str]:
    run, ready = _start_script(ctx, SPAWNING_LAUNCH_SCRIPT, PYTHON)

    def spawned() -> bool:
        run.record()
        return run.done or sum("spawn_main" in cmd for _, cmd in run.seen.values()) == 2

    wait_until(spawned, TRAIN_TIMEOUT_S, "both ranks spawned")
    ok, outcome = _killed(run, STARTING_GONE_WITHIN_S)
    joined = sorted(p.name for p in ready.iterdir())
    return ok and not joined, f"{outcome}; ranks that got as far as their function: {joined or 'none'}"
