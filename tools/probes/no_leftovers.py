"""Probes 6.x, no leftovers: benchmarks, training runs and a killed notebook kernel leave
nothing in TMPDIR.
"""

from __future__ import annotations

import json

from .context import SUITE_TIMEOUT_S, Ctx
from .observe import leftovers
from .registry import probe
from .verdicts import pytest_row


@probe(
    "6.1",
    "`nanoddp bench restarts --trials 1 --cost-trials 0` with a fresh TMPDIR",
    "trial passes; TMPDIR empty afterwards (no nanoddp-kill-*, nothing else but torch's torchinductor_ cache)",
)
def bench_restarts_leaves_nothing(ctx: Ctx) -> tuple[bool, str]:
    report = ctx.dir / "restarts.json"
    run = ctx.nanoddp(
        "bench",
        "restarts",
        "--trials",
        1,
        "--cost-trials",
        0,
        "--max-delay",
        0.5,
        "--json",
        report,
        timeout=SUITE_TIMEOUT_S,
    )
    passed = json.loads(report.read_text()).get("passed") if report.is_file() else None
    left = leftovers(ctx.tmp)
    ok = run.rc == 0 and passed == 1 and not left
    return ok, f"exit {run.rc}, {run.seconds:.0f} s, trials passed: {passed}; left in TMPDIR: {left or 'nothing'}"


@probe("6.2", "`nanoddp train` with a fresh TMPDIR", "TMPDIR empty afterwards")
def train_leaves_nothing(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.trained(ctx.dir / "run")
    left = leftovers(ctx.tmp)
    return not left, f"exit {run.rc}; left in TMPDIR: {left or 'nothing'}"


@probe(
    "6.3",
    "notebook socket dir of a SIGKILLed kernel (tests/reliability/test_reliability_leftovers.py)",
    "pytest -k socket_dir_of_a_killed_kernel passes",
)
def notebook_dir_of_a_killed_kernel(ctx: Ctx) -> tuple[bool, str]:
    return pytest_row(ctx, "tests/reliability/test_reliability_leftovers.py", "-k", "socket_dir_of_a_killed_kernel")
