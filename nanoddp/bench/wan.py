"""`nanoddp bench wan`: DDP and DiLoCo over a simulated slow link, side by side.

`nanoddp train` runs the built-in GPT on 2 ranks twice with the same steps, batch and seed: engine
`nanoddp` (DDP: every step all-reduces every gradient) and engine `diloco --sync-every H` (each
rank takes H AdamW steps alone, then one all-reduce of the pseudo-gradient), with every gloo send
of nanoddp's collectives shaped as a link of `--bandwidth` and `--latency` would carry it
(`nanoddp.comm.transport.link`, a simulation: no loss, no jitter, no shared bottleneck). Then the same pair
unshaped (loopback), unless `--no-unshaped`. Each run's metrics.jsonl gives its validation curve
and the bytes rank 0 sent (`comm_bytes`); the report puts side by side the training time, the
bytes, the final validation loss and the training time at which each run first reached DDP's final
validation loss on the same link.

Time is training time: the sum of the step times the trainer records (evaluation, snapshots and
start-up excluded, the same for both engines); each run's whole wall time is reported beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from nanoddp.base.records import step_records
from nanoddp.bench.common import ChildFailed, add_output_args, save_figure, write_json
from nanoddp.bench.inputs import count
from nanoddp.bench.training_run import run_training, train_command
from nanoddp.comm.transport.link import BANDWIDTH_VAR, LATENCY_VAR, link_environ
from nanoddp.train.launcher.cli import check_train_argv

logger = logging.getLogger(__name__)

ENGINES = ("nanoddp", "diloco")  # DDP first: its final validation loss is the target
RUN_TIMEOUT_S = 4 * 3600
# The built-in GPT (tiny preset, the stdlib's text), 2 ranks; nothing written that is not needed.
BASE_ARGS = ["--nproc", "2", "--snapshot-every", "0", "--no-progress", "--overwrite"]


def train_argv(engine: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The `nanoddp train` command of one run."""
    return train_command(*train_flags(engine, args, out))


def train_flags(engine: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The flags of one run's `nanoddp train`: the benchmark's, then `--train-args`."""
    argv = ["--engine", engine, *BASE_ARGS, "--out", str(out)]
    argv += ["--steps", str(args.steps), "--seed", str(args.seed), "--eval-every", str(args.eval_every)]
    argv += ["--log-every", str(args.eval_every), "--eval-samples", str(args.eval_samples)]
    if engine == "diloco":
        argv += ["--sync-every", str(args.sync_every)]
    return argv + shlex.split(args.train_args)


def check_runs(args: argparse.Namespace) -> None:
    """Refuse now, in one line, what `nanoddp train` would refuse of either engine's run a minute
    in (`--train-args` parsed by its own parser, the config checked against its data)."""
    for engine in ENGINES:
        try:
            check_train_argv(train_flags(engine, args, Path(tempfile.gettempdir(), "nanoddp-wan-unused")))
        except (ValueError, FileNotFoundError) as exc:
            given = f" with --train-args {args.train_args!r}" if args.train_args else ""
            raise ValueError(f"`nanoddp train` would refuse the {engine} run{given}: {exc}") from None


def _run_env(link: dict[str, str]) -> dict[str, str]:
    """This process's environment for a child run, shaped by `link` (empty: at full speed)."""
    env = {k: v for k, v in os.environ.items() if k not in (BANDWIDTH_VAR, LATENCY_VAR)}
    return {**env, **link}


def run_one(engine: str, link: dict[str, str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run `nanoddp train` once; return its summary (`summarize`) with its wall time."""
    argv = train_argv(engine, args, out)
    logger.info("running %s", shlex.join(argv))
    run = run_training(argv, out, timeout_s=RUN_TIMEOUT_S, env=_run_env(link))
    if run.returncode != 0:
        raise ChildFailed(f"`{shlex.join(argv)}` failed (exit {run.returncode}):\n{run.output[-3000:]}")
    return {"engine": engine, "shaped": bool(link), **summarize(run.records), "wall_s": run.wall_s}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """From one run's metrics.jsonl records: its validation curve as [step, training seconds, val
    loss] (training seconds: the step times summed up to that step), total training time, the
    bytes rank 0 sent (sum of `comm_bytes`) and the final validation loss."""
    train_s, last_step, curve, comm_bytes = 0.0, 0, [], 0
    for record in step_records(records):
        train_s += record["step_time_s"] * (record["step"] - last_step)  # the mean over its window
        last_step = record["step"]
        comm_bytes += record.get("comm_bytes") or 0
        if record.get("val_loss") is not None:
            curve.append([record["step"], train_s, record["val_loss"]])
    if not curve:
        raise ValueError("metrics.jsonl holds no val_loss: the run must evaluate (--eval-every)")
    return {"steps": last_step, "train_s": train_s, "comm_bytes": comm_bytes, "final_val_loss": curve[-1][2],
            "curve": curve}  # fmt: skip


def time_to_reach(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose loss is <= `target` (None: never reached)."""
    return next((train_s for _, train_s, loss in curve if loss <= target), None)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link, DiLoCo against DDP: the loss gap at the same samples, the bytes ratio, and the
    training time each engine takes to DDP's final validation loss and to the loss both reach (the
    worse of the two finals), with their ratios (None: DiLoCo never reached it)."""
    summary: dict[str, Any] = {}
    for shaped in (True, False):
        ddp, diloco = (next((r for r in runs if r["engine"] == e and r["shaped"] == shaped), None) for e in ENGINES)
        if ddp is None or diloco is None:
            continue
        target, common = ddp["final_val_loss"], max(ddp["final_val_loss"], diloco["final_val_loss"])
        to_target = {r["engine"]: time_to_reach(r["curve"], target) for r in (ddp, diloco)}
        to_common = {r["engine"]: time_to_reach(r["curve"], common) for r in (ddp, diloco)}
        summary["shaped" if shaped else "unshaped"] = {
            "val_loss_gap": diloco["final_val_loss"] / target - 1,  # at the same steps, hence samples
            "bytes_ratio": ddp["comm_bytes"] / diloco["comm_bytes"] if diloco["comm_bytes"] else None,
            "time_to_ddp_final_s": to_target,
            "time_to_ddp_final_speedup": _quotient(to_target["nanoddp"], to_target["diloco"]),
            "common_val_loss": common,
            "time_to_common_s": to_common,
            "time_to_common_speedup": _quotient(to_common["nanoddp"], to_common["diloco"]),
            "train_time_speedup": ddp["train_s"] / diloco["train_s"],
        }
    return summary


def _quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every run (shaped, then unshaped), compared; the report `--json` writes."""
    shaped = link_environ(args.bandwidth, args.latency)
    load_before = os.getloadavg()[0]  # other work on the host slows compute, the same for every run
    links = [shaped] + ([] if args.no_unshaped else [{}])
    runs = [run_one(engine, link, args, root / f"{engine}-{'shaped' if link else 'unshaped'}")
            for link in links for engine in ENGINES]  # fmt: skip
    meta = {
        "bandwidth": args.bandwidth, "latency": args.latency, "steps": args.steps, "sync_every": args.sync_every,
        "eval_every": args.eval_every, "eval_samples": args.eval_samples, "seed": args.seed,
        "train_args": args.train_args, "nproc": 2, "date": time.strftime("%Y-%m-%d"),
        "host_cpus": os.cpu_count(), "load_avg_1min": [load_before, os.getloadavg()[0]], "command": _command(args),
    }  # fmt: skip
    return {"meta": meta, "results": runs, "summary": compare(runs)}  # the table re-derives it from the runs


def _command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    words = ["nanoddp", "bench", "wan", "--bandwidth", args.bandwidth, "--latency", args.latency]
    words += ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--eval-every", str(args.eval_every)]
    words += ["--eval-samples", str(args.eval_samples), "--seed", str(args.seed)]
    words += (["--no-unshaped"] if args.no_unshaped else []) + (
        ["--train-args", args.train_args] if args.train_args else []
    )
    return shlex.join(words)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _seconds(s: float | None) -> str:
    return "not reached" if s is None else f"{s:,.0f} s"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×"


def format_markdown(report: dict[str, Any]) -> str:
    """The table (one row per run) and one line per link on the goals, derived from the runs' own
    figures (`compare`), so the text cannot drift from the data."""
    meta, summary = report["meta"], compare(report["results"])
    rows = ["| link | engine | steps | training time | wall time | bytes sent (rank 0) | final val loss "
            "| training time to DDP's final val loss |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    shaped_name = f"{meta['bandwidth']}, {meta['latency']}"
    for r in report["results"]:
        engine = "DDP (`nanoddp`)" if r["engine"] == "nanoddp" else f"DiLoCo H={meta['sync_every']}"
        reached = summary["shaped" if r["shaped"] else "unshaped"]["time_to_ddp_final_s"][r["engine"]]
        rows.append(f"| {shaped_name if r['shaped'] else 'loopback'} | {engine} | {r['steps']:,} | "
                    f"{_seconds(r['train_s'])} | {_seconds(r['wall_s'])} | {_mb(r['comm_bytes'])} | "
                    f"{r['final_val_loss']:.4f} | {_seconds(reached)} |")  # fmt: skip
    lines = ["\n".join(rows), ""]
    for name, s in summary.items():
        link = shaped_name if name == "shaped" else "loopback"
        speedup = s["time_to_ddp_final_speedup"]
        reach = (f"reaches DDP's final val loss {_ratio(speedup)} sooner" if speedup is not None
                 else f"does not reach DDP's final val loss in {meta['steps']:,} steps")  # fmt: skip
        common = s["time_to_common_s"]
        both = (f"to {s['common_val_loss']:.4f}, the val loss both reach, DDP takes {_seconds(common['nanoddp'])} "
                f"and DiLoCo {_seconds(common['diloco'])} ({_ratio(s['time_to_common_speedup'])})")  # fmt: skip
        lines.append(f"- {link}: DiLoCo's final val loss is {s['val_loss_gap']:+.1%} from DDP's at the same "
                     f"samples, with {_ratio(s['bytes_ratio'])} fewer bytes; it {reach}; {both}; training time "
                     f"{_ratio(s['train_time_speedup'])} shorter.")  # fmt: skip
    return "\n".join(lines).rstrip()


def plot(report: dict[str, Any], path: str) -> None:
    """Validation loss against training time (left) and against steps (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report["results"]:
        name = "DDP" if r["engine"] == "nanoddp" else f"DiLoCo H={meta['sync_every']}"
        link = f"{meta['bandwidth']}, {meta['latency']}" if r["shaped"] else "loopback"
        steps, seconds, losses = zip(*r["curve"], strict=True)
        style = {"linestyle": "-" if r["shaped"] else "--", "color": "C0" if r["engine"] == "nanoddp" else "C1"}
        by_time.plot(seconds, losses, label=f"{name}, {link}", **style)
        by_step.plot(steps, losses, label=f"{name}, {link}", **style)
    by_time.set(xlabel="training time (s)", ylabel="validation loss", xscale="log")
    by_step.set(xlabel="step (same samples per step)", ylabel="validation loss")
    by_time.legend(fontsize=8)
    fig.suptitle(f"nanoddp bench wan: GPT, 2 ranks, {meta['steps']} steps ({meta['date']})")
    fig.tight_layout()
    save_figure(path, fig)


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "wan", help="DDP vs DiLoCo on a simulated slow link: time, bytes, loss", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--bandwidth", default="100mbit", help="link rate, e.g. 100mbit, 1gbit, 12.5MB/s")
    parser.add_argument("--latency", default="20ms", help="one-way latency, e.g. 20ms")
    parser.add_argument("--steps", type=count(1), default=1000, help="optimizer steps of every run")
    parser.add_argument("--sync-every", type=count(1), default=50, help="DiLoCo's H")
    parser.add_argument("--eval-every", type=count(1), default=50, help="validation loss every this many steps")
    parser.add_argument("--eval-samples", type=count(1), default=512, help="validation samples per evaluation")
    parser.add_argument("--seed", type=int, default=1337, help="the same seed for every run")
    parser.add_argument("--no-unshaped", action="store_true", help="skip the pair on loopback at full speed")
    parser.add_argument("--train-args", default="", help="more `nanoddp train` flags for every run, e.g. a model")
    add_output_args(parser, plot_help="validation loss vs training time, per engine and link (PNG)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    link_environ(args.bandwidth, args.latency)  # a bad value: refused before anything runs
    check_runs(args)
    with tempfile.TemporaryDirectory(prefix="nanoddp-wan-") as root:
        report = run_bench(args, Path(root))
    print(format_markdown(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
