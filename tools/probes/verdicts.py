"""How a probe's observations become a verdict: a launcher refusal, or a run of the repo's tests.

A refusal is strict on purpose (one stderr line, no traceback, no worker, fast): a user who
mistypes a flag should read one line, not a torchrun failure table.
"""

from __future__ import annotations

import re

from .context import FAST_S, PYTHON, REPO, SUITE_TIMEOUT_S, Ctx, short
from .watched import Watched


def refusal(run: Watched, *needles: str, code: int = 2) -> tuple[bool, str]:
    """A launcher refusal: exit `code`, exactly one stderr line (nothing on stdout) matching every
    regex in `needles`, no traceback, no worker seen, within FAST_S."""
    lines = run.err.splitlines()
    workers = run.workers()
    problems = []
    if run.rc != code:
        problems.append(f"exit {run.rc}")
    if len(lines) != 1 or run.out.strip():
        problems.append("not one line")
    if "Traceback" in run.out + run.err:
        problems.append("traceback printed")
    missing = [n for n in needles if not re.search(n, run.err)]
    if missing:
        problems.append(f"does not name {missing}")
    if workers or "nanoddp: torchrun" in run.err:
        problems.append(f"{len(workers)} worker(s) started")
    if run.seconds > FAST_S:
        problems.append(f"slow ({run.seconds:.1f} s > {FAST_S:.0f} s)")
    stdout = f" + {len(run.out.splitlines())} on stdout" if run.out.strip() else ""
    status = f"exit {run.rc}, {len(lines)} line(s){stdout}, {run.seconds:.1f} s, {len(workers)} worker(s)"
    if problems:
        status += f" [{'; '.join(problems)}]"
    shown = " // ".join(short(line, 200) for line in lines[-4:])
    return not problems, f"{status}: `{shown}`"


def pytest_row(ctx: Ctx, *args: str) -> tuple[bool, str]:
    """Run some of the repo's tests. --basetemp stays short: tests that point a notebook's TMPDIR
    at their tmp_path bind a Unix socket there, and socket paths are limited to 107 bytes."""
    argv = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(ctx.dir / "pt"), *args]
    run = ctx.run(argv, SUITE_TIMEOUT_S, cwd=REPO)
    lines = [line for line in run.out.splitlines() if line.strip()]
    summary = lines[-1] if lines else short(run.err[-300:])
    timed = f" (killed after {SUITE_TIMEOUT_S} s)" if run.timed_out else ""
    failed = [short(line, 300) for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return run.rc == 0, f"pytest exit {run.rc}{timed}: {short(summary)}" + "".join(f"; {f}" for f in failed)
