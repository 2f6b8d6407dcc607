"""Run a training as a child with a deadline, and hand back its exit code, output and records.

`nanoddp bench restarts` (its kill trials and the cost of a failure), `bench wan` and the tests
that train through the command line each started `nanoddp train`, waited, killed what was left and
parsed `metrics.jsonl` by hand. Here that is written once, on the ground floor's services: the
child's lifetime is `base.processes` (`child_run`: its own session, its whole tree ended however
the block is left; `finish`: the deadline), its records are `base.records`'.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

from nanoddp import fork_server
from nanoddp.base.processes import child_run, finish
from nanoddp.base.records import Record, read_records


@dataclass(frozen=True)
class TrainingRun:
    """What one child training left: its exit code, its output (stdout and stderr together), the
    records of its `metrics.jsonl` ([] when it wrote none), its wall time, and what the `during`
    action returned (None without one)."""

    returncode: int
    output: str
    records: list[Record]
    wall_s: float
    acted: Any = None


def train_command(*args: str) -> list[str]:
    """`nanoddp train ARGS` run by this interpreter, as a child's argv."""
    return [sys.executable, "-m", "nanoddp", "train", *args]


def run_training(
    argv: Sequence[str],
    out: str | Path,
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    during: Callable[[Popen], Any] | None = None,
    forked: bool = False,
) -> TrainingRun:
    """Run `argv` (`train_command(...)`, or another training that writes `out/metrics.jsonl`) as a
    child; call `during(proc)` while it runs (a fault to plant, say: it bounds its own wait); then
    wait for the child to end, and past `timeout_s` end its tree. Nothing it started outlives
    this call.

    `forked`: for an `argv` of `python -m MODULE ...`, a caller that runs many (the tests) forks
    the child from this process's fork server, whose imports it then shares (torch's and
    nanoddp's: 4 to 5 s of CPU on a 2-core machine a launch), instead of a fresh interpreter. What
    a fresh one would differ in: a variable that torch or nanoddp reads only at import takes the
    value the server started with (`nanoddp.fork_server`).

    [Note: an unread pipe] The child's output is read once `during` returns; an action that waits
    long on a chatty child may fill the pipe and stall it, so runs with one keep their output short
    (`--no-progress`, a `--log-every` of a few steps)."""
    started = time.monotonic()
    acted = None
    with child_run(argv, env=env, start=forked_child if forked else None) as proc:
        if during is not None:
            acted = during(proc)
        output = finish(proc, timeout_s)
    assert proc.returncode is not None  # finish waited for it, or ended it
    return TrainingRun(proc.returncode, output, read_records(out, missing_ok=True), time.monotonic() - started, acted)


def forked_child(
    argv: Sequence[str], env: dict[str, str] | None = None, enter: Callable[[], None] | None = None
) -> fork_server.ForkedModule:
    """`argv`, a `python -m MODULE ...`, forked from this process's fork server (see `forked`
    above), as `base.processes.child_run` starts a child: a session of its own, stdout and stderr
    in one text pipe; `enter` is the child's first act (`fork_server.ForkedModule`)."""
    module = fork_server.python_module(argv)
    if module is None:
        raise ValueError(f"forked=True runs `python -m MODULE ...`, got {list(argv)[:3]}")
    module = "nanoddp.cli" if module == "nanoddp" else module  # what nanoddp/__main__.py runs
    return fork_server.ForkedModule(module, argv[3:], dict(os.environ) if env is None else env, stdin_pipe=False,
                                    stderr_to_stdout=True, text=True, enter=enter)  # fmt: skip
