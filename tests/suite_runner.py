"""Run many named checks in ONE multi-process launch and report each check separately.

Process start-up costs seconds, so DDP/strategy tests batch their cases per world size. Each
rank appends one JSON line per finished case to a file; the parent reads the files even when
the launch failed or timed out, so a hang in one backend's cases (run last) does not hide the
results of the cases that ran before it.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from conftest import run_on_ranks

from nanoddp import LaunchError

Case = tuple[str, Callable[..., None]]


def run_cases(env, cases: Sequence[Case], out_dir: str) -> None:
    """Worker side: run every case (fn(env)), recording 'ok' or the traceback, in order."""
    path = Path(out_dir, f"rank{env.rank}.jsonl")
    with path.open("a") as out:
        for name, fn in cases:
            try:
                fn(env)
                error = None
            except Exception:
                error = traceback.format_exc()
            out.write(json.dumps({"case": name, "error": error}) + "\n")
            out.flush()


class SuiteResults:
    """Parent side: per-case outcomes of every rank, plus the launch error if there was one."""

    def __init__(self, world_size: int, out_dir: Path, launch_error: BaseException | None):
        self.world_size = world_size
        self.launch_error = launch_error
        self.by_case: dict[str, dict[int, str | None]] = {}
        for rank in range(world_size):
            path = out_dir / f"rank{rank}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    self.by_case.setdefault(record["case"], {})[rank] = record["error"]

    def check(self, case: str) -> None:
        """Fail the calling test unless `case` passed on every rank."""
        outcomes = self.by_case.get(case, {})
        missing = [r for r in range(self.world_size) if r not in outcomes]
        if missing:
            raise AssertionError(f"case {case!r} never finished on ranks {missing}; launch: {self.launch_error}")
        failures = {r: e for r, e in outcomes.items() if e is not None}
        if failures:
            rank, error = next(iter(failures.items()))
            raise AssertionError(f"case {case!r} failed on ranks {sorted(failures)}; rank {rank}:\n{error}")


def suites_by_world_size(
    worker: Callable, tmp_path_factory, name: str, timeout: float
) -> Callable[[int], SuiteResults]:
    """For a module-scoped fixture: `get(world_size)` launches `worker` once per world size and
    caches its results, so every parametrized case of that world size reads the same run."""
    results: dict[int, SuiteResults] = {}

    def get(world_size: int) -> SuiteResults:
        if world_size not in results:
            out_dir = tmp_path_factory.mktemp(f"{name}-ws{world_size}")
            results[world_size] = run_suite(worker, world_size, out_dir, timeout=timeout)
        return results[world_size]

    return get


def run_suite(worker: Callable, world_size: int, out_dir: Path, *args, timeout: float = 240.0) -> SuiteResults:
    """Launch `worker(env, *args, out_dir)` on `world_size` ranks and collect per-case results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    error = None
    try:
        run_on_ranks(worker, world_size, *args, str(out_dir), timeout=timeout)
    except (LaunchError, TimeoutError) as exc:
        error = exc
    return SuiteResults(world_size, out_dir, error)
