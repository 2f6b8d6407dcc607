"""What one lost rank costs a run: `nanoddp bench restarts --cost N`.

For each failure mode (`--on-failure restart`: torchrun's agent restarts every worker, which
resume from the newest snapshot; `--on-failure continue`: the survivors go on and a replacement
joins live) the same `nanoddp train` run goes once untouched and once with one rank SIGKILLed
as soon as the run has logged step `KILL_AT_STEP` (after its first snapshot). The cost is the
difference of the two wall times. Trials interleave the modes (restart clean, restart killed,
continue clean, continue killed, then again), so a change in the host's load between trials
shifts both modes alike; the report gives each mode's median and range.

The victim is rank 1 (replica 1): never the rank that logs, so the kill moment is read from
`metrics.jsonl` the same way in both modes.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

TRAIN_ARGS = [
    "--nproc", "3", "--steps", "60", "--snapshot-every", "20", "--seq-len", "32", "--batch-size", "12",
    "--text-max-bytes", "200000", "--log-every", "10", "--eval-every", "0", "--no-progress",
    "--max-restarts", "1", "--collective-timeout", "30",
]  # fmt: skip
KILL_AT_STEP = 30  # after the first snapshot (step 20), before the second (step 40)
MODES = ("restart", "continue")
RUN_TIMEOUT_S = 600


def _victim(launcher: psutil.Process, mode: str) -> int | None:
    """The pid of rank 1's worker (restart: torchrun's worker with RANK=1; continue: replica 1)."""
    for child in launcher.children(recursive=True):
        try:
            environ, cmdline = child.environ(), " ".join(child.cmdline())
        except psutil.Error:  # exited while we looked
            continue
        if mode == "continue" and environ.get("NANODDP_FT_REPLICA") == "1" and "nanoddp.train.ft_loop" in cmdline:
            return child.pid
        if mode == "restart" and environ.get("RANK") == "1" and "nanoddp.train" in cmdline:
            return child.pid
    return None


def _logged_step(out: Path) -> int:
    """The newest step record in `out`'s metrics.jsonl (0 before the first)."""
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if '"loss"' in line]
    return max(steps, default=0)


def _run(mode: str, kill: bool, out: Path) -> dict:
    """One `nanoddp train` run; with `kill`, rank 1 is SIGKILLed once step KILL_AT_STEP is logged."""
    argv = [sys.executable, "-m", "nanoddp", "train", *TRAIN_ARGS, "--on-failure", mode, "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    launcher, killed_after = psutil.Process(proc.pid), None
    while kill and killed_after is None and proc.poll() is None:
        if _logged_step(out) >= KILL_AT_STEP and (pid := _victim(launcher, mode)) is not None:
            os.kill(pid, signal.SIGKILL)
            killed_after = time.monotonic() - start
        time.sleep(0.02)
    try:
        output = proc.communicate(timeout=RUN_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and every worker
        output = proc.communicate()[0]
    if proc.returncode != 0:
        raise RuntimeError(f"nanoddp train --on-failure {mode} failed (exit {proc.returncode}):\n{output[-3000:]}")
    if kill and killed_after is None:
        raise RuntimeError(f"--on-failure {mode}: the run ended before step {KILL_AT_STEP} was logged; no kill")
    return {"wall_s": round(time.monotonic() - start, 2), "killed_after_s": killed_after}


def measure(trials: int) -> dict:
    """`trials` interleaved (clean, killed) pairs per mode; every run directory is removed."""
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nanoddp-cost-") as root:
        for trial in range(trials):
            for mode in MODES:
                clean = _run(mode, False, Path(root, f"{mode}-{trial}-clean"))
                killed = _run(mode, True, Path(root, f"{mode}-{trial}-killed"))
                results.append({
                    "mode": mode, "trial": trial, "clean_s": clean["wall_s"], "killed_s": killed["wall_s"],
                    "cost_s": round(killed["wall_s"] - clean["wall_s"], 2), "killed_after_s": killed["killed_after_s"],
                })  # fmt: skip
    summary: dict[str, Any] = {}
    for mode in MODES:
        costs = [r["cost_s"] for r in results if r["mode"] == mode]
        summary[mode] = {"median_cost_s": statistics.median(costs), "min_cost_s": min(costs), "max_cost_s": max(costs)}
    restart, cont = summary["restart"]["median_cost_s"], summary["continue"]["median_cost_s"]
    # a cost can come out at or below 0 (the killed run was lucky with the host's load): no ratio then
    summary["continue_over_restart"] = round(cont / restart, 3) if restart > 0 and cont > 0 else None
    return {
        "meta": {
            "train_args": TRAIN_ARGS, "kill_at_step": KILL_AT_STEP, "victim": "rank 1", "trials": trials,
            "cpus": os.cpu_count(), "load_average_before": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d"),
        },
        "results": results,
        "summary": summary,
    }  # fmt: skip


def describe(report: dict) -> str:
    """Two lines: each mode's median cost and range, and the ratio."""
    lines = []
    for mode in MODES:
        s = report["summary"][mode]
        lines.append(
            f"--on-failure {mode:<8}: one SIGKILL costs {s['median_cost_s']:.1f} s "
            f"(median of {report['meta']['trials']}, range {s['min_cost_s']:.1f} to {s['max_cost_s']:.1f})"
        )
    ratio = report["summary"]["continue_over_restart"]
    lines.append(f"continue / restart: {ratio}" if ratio is not None else "continue / restart: no ratio (a cost <= 0)")
    return "\n".join(lines)
