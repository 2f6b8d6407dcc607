"""What one lost rank costs a run: `nanoddp bench restarts --cost N`.

For each failure mode the same job (`nanoddp train`'s built-in GPT and flags) runs once untouched
and once with one rank SIGKILLed as soon as the run has logged step `KILL_AT_STEP` (after its
first snapshot); the cost is the difference of the two wall times. The modes:

- `restart`: `nanoddp train --on-failure restart`; torchrun's agent restarts every worker, which
  resume from the newest snapshot;
- `continue`: `nanoddp train --on-failure continue`; the survivors go on (`nanoddp.ft`) and a
  replacement joins live;
- `torchft`: torchft's own fault-tolerant DDP step loop (`nanoddp.bench.torchft_ddp`) under the
  same launcher as `continue` (`nanoddp.ft.supervisor`), so that the two differ in the step loop.

Trials interleave the modes (restart clean, restart killed, continue clean, continue killed,
torchft clean, torchft killed, then again), so a change in the host's load between trials shifts
every mode alike; the report gives each mode's median and range, and the ratios of the medians.
Where the survivors record every step (`continue`, `torchft`) it also reads, within the killed
run, how long they waited to commit without the lost rank (`stall_s`; less an ordinary step,
`extra_s`: what the failure added) and, later, with its replacement (`join_s`): figures that the
host's load moves far less.

The victim is rank 1 (replica 1): never the rank that logs, so the kill moment is read from
`metrics.jsonl` the same way in every mode.

`--cost-engine diloco` measures the low-communication loop instead (`nanoddp.ft.rounds`:
`--on-failure continue --engine diloco`, a quorum per round of `--sync-every` steps): replica 1
SIGKILLed mid-round (`ROUNDS_KILL_AT_STEP`, between two syncs), a clean and a killed run per
trial. Within the killed run: the survivors' wall time at the first sync after the kill (the
`comm_time_s` its step record carries: the quorum without the lost replica, the weighted mean)
less an ordinary sync's (the median of those before the kill), and the sync where the replacement
joined; across the pair: the final validation loss of the killed run against the clean run's.
`--cost-engine streaming` does the same for Streaming DiLoCo (`STREAMING_ARGS`: 2 fragments, a
sync's quorum one step before its outer step, int8 pseudo-gradients), whose syncs come twice a
round: a stall is at the first quorum or outer step after the kill.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import Popen
from typing import Any

import psutil

from nanoddp.base.records import Record, events, last_step, step_records
from nanoddp.bench.common import ChildFailed
from nanoddp.bench.torchft_ddp import WORKER_MODULE as TORCHFT_WORKER
from nanoddp.bench.training_run import run_training, train_command
from nanoddp.ft.replica_env import replica_processes
from nanoddp.train.launcher.agent import train_workers

TRAIN_ARGS = [
    "--nproc", "3", "--steps", "60", "--snapshot-every", "20", "--seq-len", "32", "--batch-size", "12",
    "--text-max-bytes", "200000", "--log-every", "10", "--eval-every", "0", "--no-progress",
    "--max-restarts", "1", "--collective-timeout", "30",
]  # fmt: skip
KILL_AT_STEP = 30  # after the first snapshot (step 20), before the second (step 40)
MODES = ("restart", "continue", "torchft")
# The ratios of the median costs the summary gives, as (numerator, denominator).
RATIOS = (("continue", "restart"), ("torchft", "restart"), ("continue", "torchft"))
RUN_TIMEOUT_S = 600
# What `seen_by_survivors` reads inside a killed run, as each trial's record carries it.
SEEN_KEYS = ("stall_s", "join_s", "steps_short", "step_s", "extra_s")
# `--cost-engine diloco`: 3 replicas of the same GPT, a sync every 10 steps, evaluated at the end.
ROUNDS_ARGS = [
    "--nproc", "3", "--engine", "diloco", "--sync-every", "10", "--steps", "200", "--seq-len", "32",
    "--batch-size", "12", "--text-max-bytes", "200000", "--log-every", "50", "--eval-every", "200",
    "--snapshot-every", "0", "--no-progress", "--max-restarts", "1", "--collective-timeout", "30",
]  # fmt: skip
STREAMING_ARGS = ["--fragments", "2", "--sync-delay", "1", "--pseudo-grad-dtype", "int8"]  # `--cost-engine streaming`
ROUNDS_MODES = {"diloco": ROUNDS_ARGS, "streaming": [*ROUNDS_ARGS, *STREAMING_ARGS]}  # the rounds loop's runs
ROUNDS_KILL_AT_STEP = 105  # mid-round: between the syncs of steps 100 and 110 (streaming: of 105 and 109)
# What `_seen_at_syncs` reads inside a killed run of the rounds loop.
SYNC_KEYS = ("sync_s", "stall_s", "extra_s", "join_sync_s", "join_step")


def _victim(launcher: psutil.Process, mode: str) -> int | None:
    """The pid of rank 1's worker (restart: the torchrun worker named rank 1; continue, diloco and
    torchft: replica 1's process)."""
    if mode == "restart":
        victim = train_workers(launcher).get(1)
    else:
        victim = next((proc for (replica, _), proc in replica_processes(launcher).items() if replica == 1), None)
    return None if victim is None else victim.pid


def _command(mode: str, out: Path) -> list[str]:
    """The run of `mode`: `nanoddp train`, or the torchft launcher with the same flags."""
    if mode == "torchft":
        return [sys.executable, "-m", TORCHFT_WORKER, *TRAIN_ARGS, "--on-failure", "continue", "--out", str(out)]
    if mode in ROUNDS_MODES:  # `--cost-engine diloco|streaming`: the rounds loop under continue
        return train_command(*ROUNDS_MODES[mode], "--on-failure", "continue", "--out", str(out))
    return train_command(*TRAIN_ARGS, "--on-failure", mode, "--out", str(out))


def _logged_step(out: Path) -> int:
    """The newest step record in `out`'s metrics.jsonl (0 before the first)."""
    return last_step(out)


def _run(mode: str, kill: bool, out: Path) -> dict:
    """One run of `mode`; with `kill`, rank 1 is SIGKILLed once step KILL_AT_STEP (diloco:
    ROUNDS_KILL_AT_STEP) is logged."""
    start = time.monotonic()
    kill_at = ROUNDS_KILL_AT_STEP if mode in ROUNDS_MODES else KILL_AT_STEP

    def kill_rank_1(proc: Popen) -> tuple[float | None, float | None]:
        """(seconds after the start, wall clock) of the kill; (None, None) when the run ended first."""
        launcher = psutil.Process(proc.pid)
        while kill and proc.poll() is None:
            if _logged_step(out) >= kill_at and (pid := _victim(launcher, mode)) is not None:
                os.kill(pid, signal.SIGKILL)
                return time.monotonic() - start, time.time()
            time.sleep(0.02)
        return None, None

    run = run_training(_command(mode, out), out, timeout_s=RUN_TIMEOUT_S, during=kill_rank_1)
    killed_after, killed_at = run.acted
    if run.returncode != 0:
        raise ChildFailed(f"mode {mode}: the run failed (exit {run.returncode}):\n{run.output[-3000:]}")
    if kill and killed_after is None:
        raise ChildFailed(f"mode {mode}: the run ended before step {kill_at} was logged; no kill")
    seen_by = _seen_at_syncs if mode in ROUNDS_MODES else seen_by_survivors
    seen = seen_by(run.records, killed_at) if killed_at is not None else {}
    evals = events(run.records, "eval")
    return {"wall_s": round(time.monotonic() - start, 2), "killed_after_s": killed_after,
            "val_loss": evals[-1]["val_loss"] if evals else None, **seen}  # fmt: skip


def seen_by_survivors(records: list[Record], killed_at: float) -> dict[str, Any]:
    """What the kill cost the survivors, read from their per-step records (`continue` and
    `torchft` record every step with its wall-clock `time`; `restart` only every `--log-every`,
    so None there): `stall_s`, the wait between their last commit before the kill and their first
    after it (the loss noticed, the quorum, the rebuild, the step redone); `join_s`, the wait
    before the first commit at full size again after the kill (the replacement's join: the same
    as `stall_s` when a warm spare joined in that very quorum; None if it never joined);
    `steps_short`, the steps committed at the smaller size; `step_s`, the median wait between two
    commits over the 10 steps before the kill; `extra_s`, the stall less that: what the failure
    added to the one step the wait would have held anyway (the in-run estimate of its cost).

    [Note: figures the host's load does not drown] The cost (killed run - clean run) compares
    two runs half a minute long each; on a shared 2-core host their wall times drift by seconds.
    These are read within the killed run, over the step or two around each event."""
    steps = step_records(records)
    unseen = dict.fromkeys(SEEN_KEYS)
    if not steps or any("time" not in r for r in steps):
        return unseen
    full = max(r["world_size"] for r in steps)
    first_after = next((i for i, r in enumerate(steps) if r["time"] > killed_at), None)
    # the run ended before the survivors committed again, or the kill came before an ordinary step
    if first_after is None or first_after < 2:
        return {**unseen, "steps_short": 0}
    short = [i for i in range(first_after, len(steps)) if steps[i]["world_size"] < full]
    back = next((i for i in range(first_after, len(steps)) if steps[i]["world_size"] == full), None)

    def wait_before(i: int) -> float:
        return round(steps[i]["time"] - steps[i - 1]["time"], 3)

    stall = wait_before(first_after)
    step = statistics.median(wait_before(i) for i in range(max(1, first_after - 10), first_after))
    return {"stall_s": stall, "join_s": None if back is None else wait_before(back), "steps_short": len(short),
            "step_s": round(step, 3), "extra_s": round(stall - step, 3)}  # fmt: skip


def _seen_at_syncs(records: list[Record], killed_at: float) -> dict[str, Any]:
    """What a replica lost mid-round cost the survivors of the rounds loop, read from their step
    records (a sync step's record carries the sync's wall time as `comm_time_s`; the others None):
    `sync_s`, the median sync before the kill; `stall_s`, the first sync after it (the quorum
    without the lost replica and the mean of the survivors'); `extra_s`, the stall less `sync_s`;
    `join_sync_s`, the sync where the replacement joined (its heal; the stall's own sync when it
    joined there), at step `join_step`. The last sync is left out (it holds the final evaluation)."""
    steps = step_records(records)
    unseen = dict.fromkeys(SYNC_KEYS)
    syncs = [r for r in steps[:-1] if r.get("comm_time_s") is not None and "time" in r]
    before = [r["comm_time_s"] for r in syncs if r["time"] < killed_at]
    after = [r for r in syncs if r["time"] > killed_at]
    if not before or not after:  # the kill came before the first sync, or after the last
        return unseen
    joins = {event["step"] - 1 for event in events(records, "rank_joined")}  # noted on the step after the sync
    joined = [r for r in after if r["step"] in joins]
    sync, stall = statistics.median(before), after[0]["comm_time_s"]
    return {"sync_s": round(sync, 3), "stall_s": round(stall, 3), "extra_s": round(stall - sync, 3),
            "join_sync_s": round(joined[0]["comm_time_s"], 3) if joined else None,
            "join_step": joined[0]["step"] if joined else None}  # fmt: skip


def measure_rounds(trials: int, mode: str = "diloco") -> dict:
    """`trials` (clean, killed) pairs of `--cost-engine diloco|streaming` (`mode`); every run
    directory is removed."""
    results: list[dict] = []
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="nanoddp-cost-") as root:
        for trial in range(trials):
            clean = _run(mode, False, Path(root, f"{mode}-{trial}-clean"))
            killed = _run(mode, True, Path(root, f"{mode}-{trial}-killed"))
            gap = killed["val_loss"] / clean["val_loss"] - 1 if clean["val_loss"] and killed["val_loss"] else None
            results.append({
                "trial": trial, "clean_s": clean["wall_s"], "killed_s": killed["wall_s"],
                "cost_s": round(killed["wall_s"] - clean["wall_s"], 2),
                "killed_after_s": killed["killed_after_s"], **{key: killed[key] for key in SYNC_KEYS},
                "clean_val_loss": clean["val_loss"], "killed_val_loss": killed["val_loss"],
                "val_loss_gap": None if gap is None else round(gap, 5),
            })  # fmt: skip
    return {
        "meta": {
            "train_args": ROUNDS_MODES[mode], "on_failure": "continue", "kill_at_step": ROUNDS_KILL_AT_STEP,
            "victim": "replica 1", "trials": trials, "cpus": os.cpu_count(), "load_average_before": load_before,
            "date": time.strftime("%Y-%m-%d"),
        },
        "results": results,
        "summary": summarize_rounds(results),
    }  # fmt: skip


def summarize_rounds(results: list[dict]) -> dict[str, Any]:
    """Median and worst of the survivors' extra wait at the sync after the kill, and of the final
    validation loss's relative gap (killed over clean, less 1)."""
    summary: dict[str, Any] = {}
    for key in ("cost_s", "sync_s", "stall_s", "extra_s", "join_sync_s", "val_loss_gap"):
        seen = [r[key] for r in results if r.get(key) is not None]
        summary[f"median_{key}"] = round(statistics.median(seen), 5) if seen else None
        summary[f"max_{key}"] = max(seen, key=abs) if seen else None
    return summary


def describe_rounds(report: dict) -> str:
    """Two lines: what the sync after the kill cost the survivors, and the loss it left."""
    s, trials = report["summary"], report["meta"]["trials"]
    args = report["meta"]["train_args"]
    run = "--engine diloco" + (" " + " ".join(args[args.index("--fragments") :]) if "--fragments" in args else "")
    if s["median_extra_s"] is None or s["median_val_loss_gap"] is None:
        return f"{run} under continue: no kill seen between two syncs in {trials} trial(s)"
    return (
        f"{run} under continue: a replica SIGKILLed mid-round adds {s['median_extra_s']:.2f} s to the "
        f"survivors' next sync (median of {trials}, worst {s['max_extra_s']:.2f}; an ordinary sync "
        f"{s['median_sync_s']:.2f} s)\n"
        f"final validation loss, killed run / clean run - 1: {100 * s['median_val_loss_gap']:+.2f} % "
        f"(median; worst {100 * s['max_val_loss_gap']:+.2f} %)"
    )


def interleaved_trials(trials: int, modes: Sequence[str], run: Callable[[str, bool, Path], dict], root: Path) -> list:
    """`trials` (clean, killed) pairs of `run(mode, kill, out)` per mode, the modes interleaved trial
    by trial (a change in the host's load between trials shifts every mode alike), each run in a
    directory of its own under `root`: one result per pair, its cost the killed run's wall time
    less the clean one's, with what the killed run saw (`SEEN_KEYS`, every one of which `run` gives
    for a killed run; None where it saw nothing)."""
    results: list[dict] = []
    for trial in range(trials):
        for mode in modes:
            clean = run(mode, False, root / f"{mode}-{trial}-clean")
            killed = run(mode, True, root / f"{mode}-{trial}-killed")
            results.append({
                "mode": mode, "trial": trial, "clean_s": clean["wall_s"], "killed_s": killed["wall_s"],
                "cost_s": round(killed["wall_s"] - clean["wall_s"], 2), "killed_after_s": killed["killed_after_s"],
                **{key: killed[key] for key in SEEN_KEYS},
                **({"backend": killed["backend"]} if "backend" in killed else {}),  # where a run says it
            })  # fmt: skip
    return results


def mode_summary(results: list[dict], mode: str) -> dict[str, float | None]:
    """`mode`'s median cost over its trials and the range, and the medians of the stall, join and
    extra wait its killed runs saw (None where its records tell none)."""
    costs = [r["cost_s"] for r in results if r["mode"] == mode]
    summary: dict[str, float | None] = {"median_cost_s": statistics.median(costs), "min_cost_s": min(costs),
                                        "max_cost_s": max(costs)}  # fmt: skip
    for key in ("stall_s", "join_s", "extra_s"):
        seen = [r[key] for r in results if r["mode"] == mode and r.get(key) is not None]
        summary[f"median_{key}"] = statistics.median(seen) if seen else None
    return summary


def measure(trials: int) -> dict:
    """`trials` interleaved (clean, killed) pairs per mode; every run directory is removed."""
    load_before = list(os.getloadavg())  # the host is shared: say how busy it was when the trials began
    with tempfile.TemporaryDirectory(prefix="nanoddp-cost-") as root:
        results = interleaved_trials(trials, MODES, _run, Path(root))
    return {
        "meta": {
            "train_args": TRAIN_ARGS, "modes": list(MODES), "kill_at_step": KILL_AT_STEP, "victim": "rank 1",
            "trials": trials, "cpus": os.cpu_count(), "load_average_before": load_before,
            "date": time.strftime("%Y-%m-%d"),
        },
        "results": results,
        "summary": summarize(results),
    }  # fmt: skip


def summarize(results: list[dict]) -> dict[str, Any]:
    """Each mode's median cost and range over its trials (and median stall and join wait, where
    its records tell them), and `A_over_B` for each of RATIOS."""
    summary: dict[str, Any] = {}
    for mode in MODES:
        summary[mode] = mode_summary(results, mode)
    for top, bottom in RATIOS:
        a, b = summary[top]["median_cost_s"], summary[bottom]["median_cost_s"]
        # a cost can come out at or below 0 (the killed run was lucky with the host's load): no ratio then
        summary[f"{top}_over_{bottom}"] = round(a / b, 3) if a > 0 and b > 0 else None
    # Where a mode's cost drowns in the host's drift, its in-run stall (an upper bound on what the
    # failure held the survivors up: it includes the redone step itself) still compares, and so
    # does its extra wait (the stall less one ordinary step: the estimate of the cost itself).
    restart = summary["restart"]["median_cost_s"]
    for mode in ("continue", "torchft"):
        for key in ("stall", "extra"):
            wait = summary[mode][f"median_{key}_s"]
            summary[f"{mode}_{key}_over_restart"] = round(wait / restart, 3) if wait and restart > 0 else None
    return summary


def describe(report: dict) -> str:
    """One line per mode (median cost and range, the survivors' median stall and join wait), then
    the ratios of the median costs."""
    lines, trials = [], report["meta"]["trials"]
    for mode in MODES:
        s = report["summary"][mode]
        name = "torchft's FT-DDP" if mode == "torchft" else f"--on-failure {mode}"
        stall = "" if s["median_stall_s"] is None else f"; survivors' stall {s['median_stall_s']:.1f} s"
        stall += "" if s["median_join_s"] is None else f", the join's {s['median_join_s']:.1f} s"
        lines.append(
            f"{name:<22}: one SIGKILL costs {s['median_cost_s']:.1f} s "
            f"(median of {trials}, range {s['min_cost_s']:.1f} to {s['max_cost_s']:.1f}){stall}"
        )
    for top, bottom in RATIOS:
        ratio = report["summary"][f"{top}_over_{bottom}"]
        lines.append(f"{top} / {bottom}: {ratio}" if ratio is not None else f"{top} / {bottom}: no ratio (a cost <= 0)")
    for mode in ("continue", "torchft"):
        ratio, extra = (report["summary"].get(f"{mode}_{key}_over_restart") for key in ("stall", "extra"))
        if ratio is not None:
            net = "" if extra is None else f" (less one ordinary step: {extra})"
            lines.append(f"{mode}'s stall / restart's cost: {ratio}{net}")
    return "\n".join(lines)
