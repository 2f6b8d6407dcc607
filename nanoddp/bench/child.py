"""A benchmark's child run (`nanoddp train`, torchft's launcher), which never outlives the benchmark.

`bench restarts` and `bench wan` run whole trainings as children, each in a session of its own:
the SIGKILLs a trial sends its workers must not reach the benchmark, and the child's tree must be
one thing to end. The price is that nothing ends it by itself: Ctrl-C in the terminal reaches
only the benchmark, and an exception in the benchmark (a failed measurement, a bug between two
steps) would leave the child training on, writing into a temp dir that is being removed. So a
child lives in `with child_run(...)`, which ends its whole tree on the way out, however the
block is left, before the temp dir around it goes. A child that fails raises `ChildFailed`,
which `nanoddp bench` reports (its output's tail, exit code 1) without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence

import psutil


class ChildFailed(RuntimeError):
    """A child run failed, and with it the measurement; the message carries its output's tail."""


@contextlib.contextmanager
def child_run(argv: Sequence[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start `argv` in a session of its own, its stdout and stderr in one text pipe; on leaving
    the block, end it and everything it started (a no-op for a child that finished cleanly)."""
    proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        end_tree(proc)
        if proc.stdout:
            proc.stdout.close()


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for `proc` to exit and return its output; past `timeout_s`, end its tree first."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        end_tree(proc)
        return proc.communicate()[0] + f"\n(killed after {timeout_s:g}s)"


def end_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, every descendant it has (torchrun's workers lead sessions of their own) and
    whatever is left in its process group, then reap it."""
    family = []
    if proc.returncode is None:  # not reaped yet, so its pid is still its own
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(proc.pid)
            family = [parent, *parent.children(recursive=True)]
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    # its group: what its tree lost by re-parenting (Linux keeps a group's id while it has members)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
