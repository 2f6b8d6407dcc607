"""A probe's world: a fresh temp dir with a private TMPDIR, the subprocesses it starts, and the
tiny training run every probe builds on.

Each probe gets its own context, removed (with every process it started) when the probe ends,
so one probe's leftovers cannot pass or fail the next one.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .watched import Watched

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# A refusal in the launcher: imports and checks, no worker start-up. Well under the minutes a
# rendezvous or a collective waits before giving up (torchrun's join timeout, --collective-timeout),
# so a refusal that waited on workers fails it; torch's import alone takes 5-15 s cold on a
# 2-core host with both cores busy.
FAST_S = 30.0
REFUSAL_TIMEOUT_S = 120
TRAIN_TIMEOUT_S = 300
SUITE_TIMEOUT_S = 900
GONE_WITHIN_S = 5.0  # "every worker gone within a few seconds"
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
INTERRUPT_LINE = re.compile(r"nanoddp: interrupted at step (\d+); snapshot saved; rerun the same command to continue")
FAILURE_LINE = re.compile(r"^nanoddp: rank (\d+) failed: (.*) \(full log: (.*)\)$", re.M)
# GPT, 2 blocks of width 32, on 16-byte windows of 1900 bytes of stdlib text: milliseconds a step.
TINY = {
    "nproc": 2,
    "text_max_bytes": 1900,
    "seq_len": 16,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "d_ff": 64,
    "batch_size": 8,
    "steps": 3,
    "warmup_steps": 1,
    "snapshot_every": 1,
    "eval_every": 0,
    "log_every": 10,
}
LONG = {"steps": 400, "snapshot_every": 10, "log_every": 50}  # long enough to be hit mid-run


def flags(**overrides: object) -> list[str]:
    """TINY's flags with `overrides` (a None value drops the flag), plus --no-progress."""
    values = {**TINY, **overrides}
    argv: list[str] = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return [*argv, "--no-progress"]


def nanoddp_argv(*args: object) -> list[str]:
    return [PYTHON, "-m", "nanoddp", *(str(a) for a in args)]


def snap(out: Path, step: int) -> Path:
    return out / "snapshots" / f"step-{step:08d}.pt"


def short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProbeError(Exception):
    """A probe could not reach the state it checks (e.g. its setup run failed)."""


class Ctx:
    """One probe's world: a fresh temp dir (with a private TMPDIR inside) and its subprocesses."""

    active: list[Ctx] = []

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="nanoddp-probe-"))
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.procs: list[Watched] = []
        Ctx.active.append(self)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS and not k.startswith("TORCHELASTIC_")}
        return {**env, "TMPDIR": str(self.tmp)}

    def start(self, argv: list[str], cwd: Path | None = None) -> Watched:
        proc = Watched(argv, cwd or self.dir, self.env())
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float, cwd: Path | None = None) -> Watched:
        proc = self.start(argv, cwd)
        proc.wait(timeout)
        return proc

    def nanoddp(self, *args: object, timeout: float = REFUSAL_TIMEOUT_S, cwd: Path | None = None) -> Watched:
        return self.run(nanoddp_argv(*args), timeout, cwd)

    def trained(self, out: Path, **overrides: object) -> Watched:
        """A finished tiny run in `out` (setup for a probe); ProbeError if it fails."""
        run = self.nanoddp("train", *flags(out=out, **overrides), timeout=TRAIN_TIMEOUT_S)
        if run.rc != 0:
            raise ProbeError(f"setup run failed (exit {run.rc}): {short(run.err[-600:])}")
        return run

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self in Ctx.active:
            Ctx.active.remove(self)


def close_all() -> None:
    for ctx in list(Ctx.active):
        ctx.close()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ProbeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def python_snippet(ctx: Ctx, code: str, *args: object, timeout: float = 120) -> str:
    """Run `code` with `python -c` in a subprocess; return its stdout (ProbeError on failure)."""
    run = ctx.run([PYTHON, "-c", code, *(str(a) for a in args)], timeout)
    if run.rc != 0:
        raise ProbeError(f"helper script failed (exit {run.rc}): {short(run.err[-600:])}")
    return run.out
