"""What `--on-failure continue` costs a run that loses nothing: `nanoddp bench continue-price`.

Fault tolerance is paid for on every step, failure or not, so the question a user asks before
turning it on is what a step costs under it. For each engine both modes run the same job
(`nanoddp train`'s built-in GPT at 3 ranks, or `--nproc`, no snapshot, no evaluation, a step
record per step) without any failure:

- `restart`: `--on-failure restart`, torchrun's workers, the engine over every rank (hsdp: in
  groups of `--group-size` ranks);
- `continue`: `--on-failure continue`, one replica per rank (or per `--group-size` ranks) under
  torchft's quorum, the engine over the replica's processes and the average across replicas in
  rank order (`nanoddp.ft`).

Each run gives two figures read from its own step records, past the first `WARMUP_STEPS` (the
first buckets, the allocator, torchft's first quorum): the median step time, and the median bytes
a rank sent in the step's collectives (`comm_bytes`, which both modes count the same way, on our
transport). The summary is, per engine, continue's median over restart's: the step-time ratio (the
price of the quorum) and the bytes ratio (the average across replicas must move no more than the
engine's own reduction does).

Trials interleave the runs (engine by engine, the two modes in turn, the mode that goes first
alternating from trial to trial), so a change in the host's load between runs shifts both modes of
an engine alike; each run's figure is its own median, not its wall time, so a slow start-up does
not count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nanoddp.base.records import step_records
from nanoddp.bench.common import ChildFailed, add_output_args, write_json
from nanoddp.bench.inputs import count
from nanoddp.bench.machine import git_commit, machine_description
from nanoddp.bench.training_run import run_training, train_command

ENGINES = ("nanoddp", "zero1", "zero2", "hsdp")  # what `nanoddp train --on-failure continue` runs per step
MODES = ("restart", "continue")
TRAIN_ARGS = [
    "--steps", "40", "--seq-len", "32", "--batch-size", "12", "--text-max-bytes", "200000",
    "--log-every", "1", "--eval-every", "0", "--snapshot-every", "0", "--no-progress", "--collective-timeout", "30",
]  # fmt: skip
WARMUP_STEPS = 5  # step records left out of each run's medians
RUN_TIMEOUT_S = 600


def layout_args(engine: str, mode: str, nproc: int, group_size: int) -> list[str]:
    """The processes, and the replica groups: `--group-size` under continue (hsdp's mesh rows under
    restart too, where the other engines reduce over every rank)."""
    grouped = group_size > 1 and (mode == "continue" or engine == "hsdp")
    return ["--nproc", str(nproc), *(["--group-size", str(group_size)] if grouped else [])]


def _run(engine: str, mode: str, out: Path, layout: list[str]) -> dict[str, Any]:
    """One run of `engine` under `mode`: its medians of step time and bytes per step."""
    argv = train_command(*TRAIN_ARGS, *layout, "--engine", engine, "--on-failure", mode, "--out", str(out))
    run = run_training(argv, out, timeout_s=RUN_TIMEOUT_S)
    steps = [r for r in step_records(run.records) if r["step"] > WARMUP_STEPS]
    if run.returncode != 0 or not steps:
        raise ChildFailed(f"{engine} under --on-failure {mode} failed (exit {run.returncode}):\n{run.output[-3000:]}")
    comm_s = [r["comm_time_s"] for r in steps if r.get("comm_time_s") is not None]  # none where not timed
    return {
        "engine": engine, "mode": mode, "steps": len(steps), "wall_s": round(run.wall_s, 2),
        "step_time_s": statistics.median(r["step_time_s"] for r in steps),
        "comm_bytes": statistics.median(r["comm_bytes"] for r in steps),
        "comm_time_s": statistics.median(comm_s) if comm_s else None,
    }  # fmt: skip


def measure(trials: int, engines: tuple[str, ...] = ENGINES, nproc: int = 3, group_size: int = 1) -> dict[str, Any]:
    """`trials` interleaved runs of every engine in both modes, `nproc` processes each (under
    continue in replicas of `group_size`); every run directory is removed."""
    if nproc % group_size:
        raise ValueError(f"--group-size {group_size} must divide --nproc {nproc} into whole replica groups")
    load_before = list(os.getloadavg())
    results = []
    with tempfile.TemporaryDirectory(prefix="nanoddp-continue-price-") as root:
        for trial in range(trials):
            for engine in engines:
                for mode in MODES if trial % 2 == 0 else MODES[::-1]:
                    layout = layout_args(engine, mode, nproc, group_size)
                    out = Path(root) / f"{engine}-{mode}-{trial}"
                    results.append({"trial": trial, **_run(engine, mode, out, layout)})
    return {
        "meta": {
            "train_args": TRAIN_ARGS, "nproc": nproc, "group_size": group_size, "engines": list(engines),
            "trials": trials, "warmup_steps": WARMUP_STEPS,
            "machine": machine_description(), "load_average_before": load_before,
            "load_average_after": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
        },
        "results": results,
        "summary": summarize(results),
    }  # fmt: skip


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per engine: each mode's median over trials of its runs' median step time (ms) and bytes per
    step, continue's over restart's for both, and the range of the step-time ratio trial by trial."""
    summary = {}
    for engine in dict.fromkeys(r["engine"] for r in results):
        runs = {mode: [r for r in results if r["engine"] == engine and r["mode"] == mode] for mode in MODES}
        step_ms = {mode: statistics.median(r["step_time_s"] for r in runs[mode]) * 1e3 for mode in MODES}
        sent = {mode: statistics.median(r["comm_bytes"] for r in runs[mode]) for mode in MODES}
        by_trial = [c["step_time_s"] / r["step_time_s"] for r, c in zip(runs["restart"], runs["continue"], strict=True)]
        summary[engine] = {
            "restart_step_ms": round(step_ms["restart"], 1), "continue_step_ms": round(step_ms["continue"], 1),
            "step_time_ratio": round(step_ms["continue"] / step_ms["restart"], 3),
            "step_time_ratio_range": [round(min(by_trial), 3), round(max(by_trial), 3)],
            "restart_comm_bytes": sent["restart"], "continue_comm_bytes": sent["continue"],
            "comm_bytes_ratio": round(sent["continue"] / sent["restart"], 4) if sent["restart"] else None,
        }  # fmt: skip
    return summary


def markdown_table(report: dict[str, Any]) -> str:
    """The summary as a markdown table, one row per engine: what the command prints, and what
    docs/ft.md carries (a unit test renders it again from the committed JSON and finds it there,
    so the page cannot drift from its data)."""
    rows = [
        "| engine | step, restart | step, continue | continue ÷ restart (by trial) "
        "| bytes per step, continue ÷ restart |",
        "|---|---|---|---|---|",
    ]
    for engine, s in report["summary"].items():
        low, high = s["step_time_ratio_range"]
        sent = "–" if s["comm_bytes_ratio"] is None else f"{s['comm_bytes_ratio']:.3f}"
        rows.append(
            f"| {engine} | {s['restart_step_ms']:.0f} ms | {s['continue_step_ms']:.0f} ms | "
            f"{s['step_time_ratio']:.2f} ({low:.2f} to {high:.2f}) | {sent} "
            f"({s['continue_comm_bytes'] / 1e6:.1f} MB vs {s['restart_comm_bytes'] / 1e6:.1f} MB) |"
        )
    return "\n".join(rows)


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "continue-price", help="a run without failures under --on-failure continue vs restart: step time, bytes",
        description=__doc__.split("\n\n")[1],
    )  # fmt: skip
    parser.add_argument("--trials", type=count(1), default=3, help="interleaved runs per engine and mode")
    parser.add_argument(
        "--engines", default=",".join(ENGINES), type=_engines,
        help=f"comma-separated, from {','.join(ENGINES)} (the engines continue runs per step)",
    )  # fmt: skip
    parser.add_argument("--nproc", type=count(1), default=3, help="processes per run (default 3)")
    parser.add_argument(
        "--group-size", type=count(1), default=1,
        help="processes per replica under continue (default 1: a replica per process)",
    )  # fmt: skip
    add_output_args(parser)
    parser.set_defaults(run=_main)


def _engines(text: str) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in ENGINES]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(
            f"--engines takes names from {','.join(ENGINES)} (the engines continue runs per step), got {text!r}"
        )
    return chosen


def _main(args: argparse.Namespace) -> int:
    report = measure(args.trials, args.engines, args.nproc, args.group_size)
    print(markdown_table(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0
