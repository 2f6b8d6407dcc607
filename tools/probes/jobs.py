"""`nanoddp run` jobs for the probes: a user's script written to the probe's dir, launched on 2
ranks, its workers found by the pid files the script writes once it has joined the group.

A worker's own pid file is what a probe waits on (not a sleep): on a loaded machine two workers
importing torch take anywhere from seconds to minutes, and the file says the group is up.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from .context import TRAIN_TIMEOUT_S, Ctx, ProbeError, nanoddp_argv, short
from .watched import Watched

RUN_WORKER_MODULE = "nanoddp.run.bootstrap"  # `nanoddp run`'s workers run the script through it

# Joins the group the standard way, writes its pid file, then loops on all_reduce (or, in mode
# finish-rank-0, rank 0 exits 0 and rank 1 sleeps: a job that can never finish by itself).
LOOP = """
import os, sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.ones(1)
dist.all_reduce(value)
pid_dir = sys.argv[1]
open(os.path.join(pid_dir, f"rank{rank}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(pid_dir, f"rank{rank}.tmp"), os.path.join(pid_dir, f"rank{rank}.pid"))
mode = sys.argv[2] if len(sys.argv) > 2 else "loop"
if mode == "finish-rank-0" and rank == 0:
    sys.exit(0)
if mode in ("finish-rank-0", "sleep"):
    time.sleep(3600)
while True:
    dist.all_reduce(value)
    time.sleep(0.05)
"""


class Job:
    """`nanoddp run --nproc 2 RUN_ARGS SCRIPT PIDDIR SCRIPT_ARGS` started in `ctx`."""

    def __init__(self, ctx: Ctx, script: str, *run_args: object, script_args: tuple = (), name: str = "job"):
        self.pid_dir = ctx.dir / f"pids-{name}"
        self.pid_dir.mkdir()
        path = ctx.dir / f"{name}.py"
        path.write_text(script)
        argv = nanoddp_argv("run", "--nproc", 2, *run_args, path, self.pid_dir, *script_args)
        self.run: Watched = ctx.start(argv)

    def wait_for_workers(self, timeout: float = TRAIN_TIMEOUT_S) -> list[psutil.Process]:
        """Both workers, once each has joined the group and written its pid file."""
        files = [self.pid_dir / f"rank{rank}.pid" for rank in (0, 1)]
        deadline = time.monotonic() + timeout
        while not all(f.exists() for f in files):
            if self.run.done:
                raise ProbeError(f"launcher exited {self.run.rc} before its workers started: {self.tail()}")
            if time.monotonic() > deadline:
                raise ProbeError(f"workers not started after {timeout:.0f} s: {self.tail()}")
            time.sleep(0.1)
        self.run.record()
        return [psutil.Process(int(f.read_text())) for f in files]

    def wait_for_stderr(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while text not in self.run.err:
            if self.run.done or time.monotonic() > deadline:
                return text in self.run.err
            time.sleep(0.1)
        return True

    def stderr_lines(self, skip_launch_line: bool = True) -> list[str]:
        """Non-blank stderr lines; without the launcher's own `nanoddp: torchrun ...` line."""
        lines = [line for line in self.run.err.splitlines() if line.strip()]
        return [line for line in lines if not (skip_launch_line and line.startswith("nanoddp: torchrun "))]

    def tail(self, limit: int = 600) -> str:
        return short(self.run.err[-limit:])


def alive(procs: list[psutil.Process], within: float) -> list[int]:
    """Pids of `procs` still running (zombies count as gone) after waiting up to `within` s."""
    _, left = psutil.wait_procs(procs, timeout=within)
    running = []
    for proc in left:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc.pid)
        except psutil.Error:
            pass
    return running


def stale_dirs(tmp: Path, pid: int) -> list[str]:
    """`nanoddp run`'s private temp dirs of the launcher `pid` left in `tmp`."""
    return sorted(p.name for p in tmp.glob(f"nanoddp-run-{pid}-*"))
