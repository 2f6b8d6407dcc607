"""`nanoddp bench restarts`: kill trials for fault tolerance.

A reference run of `nanoddp train` goes uninterrupted; then, trial after trial, the same
config runs under `--max-restarts 3` and one worker, chosen at random, gets SIGKILL at a random
moment after the first snapshot. torchrun's agent restarts the group, the trainer resumes from
the newest valid snapshot, and the trial counts as passed only when the final parameters are
bitwise equal to the reference's. Snapshots are written to a temp file and renamed, so a kill
during a write must never be read back half-written; random kill times hit writes too.

It also measures what one failure costs in wall time under `--on-failure restart`,
`--on-failure continue` and torchft's own fault-tolerant DDP on the same job, side by side
(`nanoddp.bench.failure_cost`, `--cost-trials`), or with `--cost-engine diloco` what a replica
lost mid-round costs the low-communication loop under continue; with `--hosts N`, what losing a
whole host costs, on N network-namespace hosts (`nanoddp.bench.host_failure_cost`).
"""

from __future__ import annotations

import argparse
import functools
import logging
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import torch

from nanoddp.bench import failure_cost, host_failure_cost
from nanoddp.bench.common import ChildFailed, add_output_args, write_json
from nanoddp.bench.inputs import count, number
from nanoddp.bench.training_run import run_training, train_command
from nanoddp.train.launcher.agent import train_workers

logger = logging.getLogger(__name__)

TRAIN_ARGS = [
    "--nproc", "2", "--steps", "30", "--snapshot-every", "5", "--seq-len", "32", "--batch-size", "8",
    "--text-max-bytes", "200000", "--log-every", "5", "--eval-every", "0", "--no-progress",
]  # fmt: skip
RUN_TIMEOUT_S = 600


def _argv(out: Path, max_restarts: int) -> list[str]:
    return train_command(*TRAIN_ARGS, "--max-restarts", str(max_restarts), "--out", str(out))


def _kill_random_worker(proc: subprocess.Popen, out: Path, rng: random.Random, max_delay_s: float) -> int:
    """Wait for the first snapshot, sleep a random while, SIGKILL one worker; return the step
    count of snapshots on disk at that moment."""
    first = out / "snapshots" / "step-00000005.pt"
    while not first.exists() and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, max_delay_s))
    workers = list(train_workers(psutil.Process(proc.pid)).values())
    if workers:
        rng.choice(workers).send_signal(signal.SIGKILL)
    return len(list((out / "snapshots").glob("step-*.pt")))


def _params(run_dir: Path) -> dict[str, torch.Tensor] | None:
    path = run_dir / "model.pt"
    return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def run_trials(trials: int, seed: int, max_delay_s: float) -> dict:
    """Every run's directory lives in one temp dir, removed when the trials end (pass, fail or
    Ctrl-C); each trial's own directory (~50 MB of snapshots) goes as soon as it is compared."""
    with tempfile.TemporaryDirectory(prefix="nanoddp-kill-") as root:
        return _run_trials(Path(root), trials, seed, max_delay_s)


def _run_trials(root: Path, trials: int, seed: int, max_delay_s: float) -> dict:
    rng = random.Random(seed)
    reference = run_training(_argv(root / "reference", max_restarts=0), root / "reference", timeout_s=RUN_TIMEOUT_S)
    expected = _params(root / "reference")
    if reference.returncode != 0 or expected is None:
        raise ChildFailed(f"the reference run failed:\n{reference.output[-3000:]}")
    results = []
    for trial in range(trials):
        out = root / f"trial-{trial}"
        kill = functools.partial(_kill_random_worker, out=out, rng=rng, max_delay_s=max_delay_s)
        run = run_training(_argv(out, max_restarts=3), out, timeout_s=RUN_TIMEOUT_S, during=kill)
        got = _params(out)
        identical = got is not None and all(torch.equal(v, got[k]) for k, v in expected.items())
        shutil.rmtree(out, ignore_errors=True)
        results.append({
            "trial": trial, "returncode": run.returncode, "snapshots_at_kill": run.acted,
            "restarted": "restart 1: resumed from" in run.output, "bit_identical": identical,
        })  # fmt: skip
        logger.info("trial %d: %s", trial, results[-1])
    passed = sum(r["bit_identical"] and r["restarted"] for r in results)
    return {"trials": trials, "passed": passed, "seed": seed, "train_args": TRAIN_ARGS, "results": results}


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "restarts", help="SIGKILL a worker mid-run; the restarted run must end bitwise equal",
        description=__doc__.split("\n\n")[1],
    )  # fmt: skip
    parser.add_argument("--trials", type=count(0), default=10, help="bitwise kill trials (0: none)")
    parser.add_argument(
        "--cost-trials", type=count(0), default=3,
        help="(clean, killed) run pairs per failure mode for the cost of a failure (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--cost-engine", choices=("ddp", "diloco", "streaming"), default="ddp",
        help="ddp: the cost trials compare restart, continue and torchft on the default engine; diloco: a "
        "replica SIGKILLed mid-round under --on-failure continue --engine diloco (the next sync's stall, the "
        "final validation loss against a clean run); streaming: the same with --fragments 2 --sync-delay 1 "
        "--pseudo-grad-dtype int8",
    )  # fmt: skip
    parser.add_argument(
        "--hosts", type=count(0), default=0,
        help="N >= 2: the cost trials lose a whole host instead, on N network-namespace hosts "
        "(restart against continue --min-replicas 1; needs root); 0: one machine (default)",
    )  # fmt: skip
    parser.add_argument(
        "--host-nproc", type=count(1), default=1,
        help="with --hosts: processes per host (under continue a host is one replica group of them)",
    )  # fmt: skip
    parser.add_argument(
        "--host-engine", choices=("nanoddp", "zero1", "zero2", "hsdp"), default="nanoddp",
        help="with --hosts: the engine every host trains in both modes (hsdp: sharded over a host's processes)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed for the victim and kill time")
    parser.add_argument(
        "--max-delay", type=number(0), default=2.5, help="latest kill, seconds after the first snapshot"
    )
    add_output_args(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.trials + args.cost_trials == 0:
        raise ValueError("--trials and --cost-trials are both 0: nothing to measure; give either a count")
    if args.hosts and (args.cost_engine != "ddp" or not args.cost_trials):
        raise ValueError("--hosts sets where the cost trials of the default engine run: give --cost-trials N "
                         "and leave --cost-engine at ddp")  # fmt: skip
    if not args.hosts and (args.host_nproc != 1 or args.host_engine != "nanoddp"):
        raise ValueError("--host-nproc and --host-engine shape the hosts of --hosts N: give --hosts, or drop them")
    if args.hosts:
        host_failure_cost.check(args.hosts)
    report: dict = {}
    passed = True
    if args.trials:
        report = run_trials(args.trials, args.seed, args.max_delay)
        print(f"{report['passed']} of {report['trials']} kill trials restarted and ended bitwise equal")
        passed = report["passed"] == report["trials"]
    if args.hosts:
        report["host_failure_cost"] = host_failure_cost.measure(
            args.cost_trials, args.hosts, args.host_nproc, args.host_engine
        )
        print(host_failure_cost.describe(report["host_failure_cost"]))
    elif args.cost_trials and args.cost_engine != "ddp":
        report["failure_cost_rounds"] = failure_cost.measure_rounds(args.cost_trials, args.cost_engine)
        print(failure_cost.describe_rounds(report["failure_cost_rounds"]))
    elif args.cost_trials:
        report["failure_cost"] = failure_cost.measure(args.cost_trials)
        print(failure_cost.describe(report["failure_cost"]))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0 if passed else 1
