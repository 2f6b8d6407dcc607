"""`nanoddp run SCRIPT [ARGS...]`: any training script on torchrun's elastic agent, with
nanoddp's fault tolerance.

    nanoddp run --nproc 2 --max-restarts 1 train.py --lr 3e-4
    python -m nanoddp.run --nproc 2 train.py --lr 3e-4          # the same

What it adds to plain `torchrun`:

- a fresh rendezvous store per restart (`nanoddp.torchrun.prepare_torchrun_launch`), without which
  restarted workers can read the previous attempt's addresses and fail to connect;
- the hang watchdog on the script's torch.distributed collectives (`nanoddp.run.bootstrap`
  runs the script with them watched), so a rank that skips a collective is named within
  `--collective-timeout` seconds instead of blocking the job;
- every worker line prefixed `[rank k] ` (torchrun's tee, with a global-rank prefix);
- one line at the end saying which rank failed first and why (the exception, the signal, or the
  watchdog's report) rather than torchrun's multi-line failure table;
- workers that die with the launcher: SIGTERM or Ctrl-C stops them (torchrun forwards the signal)
  and ends in one line and exit 128 + signal; a SIGKILLed launcher takes them along too, with
  whatever they started (each worker asks Linux for that, `nanoddp.base.processes.die_with_parent`, and
  leaves a guard over its process group, `take_descendants_along`), and its temp dir, named by
  its pid, is removed by the next start (`nanoddp.tempdirs`);
- a rank that exits 0 while others run on is named after `--finished-grace` seconds, or ends the
  job with `--fail-on-early-exit` (`nanoddp.run.finished`), instead of a silent hang;
- `--on-failure continue`: no torchrun agent, but a supervisor of one process per replica and
  torchft's quorum service, so a lost rank costs the others one step, not a restart
  (`nanoddp.run.ft_launch`, `nanoddp.ft`).

The launch itself is torchrun's (`torch.distributed.run`), in this process, through the one
agent wrapper `nanoddp train` uses too (`nanoddp.train.launcher.agent`): `--nnodes/--node-rank/
--rdzv-*` and `--max-restarts` mean what they mean there.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys

from nanoddp.ft.placement import refuse_continue_flags
from nanoddp.run.finished import DEFAULT_FINISHED_GRACE_S, watched_agent
from nanoddp.train.launcher import preflight
from nanoddp.train.launcher.agent import AgentJob, failure_reason, run_torchrun_agent
from nanoddp.train.launcher.cli import add_launch_args, default_nproc
from nanoddp.train.launcher.rendezvous import check_launch_args, launch_argv

BOOTSTRAP_MODULE = "nanoddp.run.bootstrap"
RANK_PREFIX_TEMPLATE = "[rank ${rank}] "  # torchrun's template macros: ${rank}, ${local_rank}, ${role_name}
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def add_run_args(parser: argparse.ArgumentParser) -> None:
    add_launch_args(parser)
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metavar="S",
        help=f"seconds a collective may wait for the other ranks (default: {DEFAULT_COLLECTIVE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--finished-grace",
        type=float,
        default=DEFAULT_FINISHED_GRACE_S,
        metavar="S",
        help="after a rank exits 0, how long the others may run on before a line names them "
        f"(default: {DEFAULT_FINISHED_GRACE_S:g})",
    )
    parser.add_argument(
        "--fail-on-early-exit",
        action="store_true",
        help="stop the job (exit 1) instead of waiting when ranks run on --finished-grace seconds after one exited 0",
    )
    parser.add_argument("--log-dir", default=None, help="keep each worker's stdout/stderr here (default: not kept)")
    parser.add_argument(
        "--on-failure",
        choices=("restart", "continue"),
        default="restart",
        help="restart: a lost rank restarts every worker (torchrun's agent); continue: the others go on "
        "without it and a replacement joins live (the script uses nanoddp.ft; see docs/ft.md)",
    )
    parser.add_argument("--out", default=None, help="with --on-failure continue: write metrics.jsonl here")
    parser.add_argument(
        "--warm-spare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --on-failure continue and --max-restarts > 0: start one spare with the run, its imports "
        "done, to be the first replacement (default: on)",
    )
    parser.add_argument("-m", dest="as_module", action="store_true", help="SCRIPT is a module, as in python -m")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run your own script on N processes (torchrun + restarts + hang watchdog)",
        description="Run SCRIPT on torchrun's elastic agent with nanoddp's environment: a fresh "
        "rendezvous store per restart, the hang watchdog on torch.distributed collectives, "
        "[rank k] output prefixes and a one-line failure summary.",
    )
    add_run_args(parser)
    parser.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> int:
    """Validate in the launcher, before any process starts; return processes per node."""
    nproc = args.nproc if args.nproc is not None else default_nproc(engine="")  # all GPUs, else 2
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    check_launch_args(args)
    if args.on_failure != "continue":
        refuse_continue_flags(args)
    if not args.collective_timeout > 0:
        raise ValueError(f"--collective-timeout must be > 0 seconds, got {args.collective_timeout}")
    if not args.finished_grace >= 0:
        raise ValueError(f"--finished-grace must be >= 0 seconds, got {args.finished_grace}")
    preflight.check_worker_environ()
    if not args.as_module and not os.path.isfile(args.script):
        raise FileNotFoundError(f"script {args.script!r} not found (for a module, pass -m {args.script})")
    return nproc


def agent_argv(args: argparse.Namespace, nproc: int) -> list[str]:
    """torchrun's command line for this launch (without the program name and the log dir)."""
    argv = [*launch_argv(args, nproc), "--tee", "3"]  # tee: torchrun prefixes each line it copies
    worker = ["-m", BOOTSTRAP_MODULE, "--collective-timeout", str(args.collective_timeout)]
    worker += ["-m"] if args.as_module else []
    return [*argv, *worker, "--", args.script, *args.script_args]


def describe_failure(rank: int, exitcode: int, message: object) -> str:
    """`rank 1 (exit code 1): ValueError: bad shape`, in words for signals and hangs."""
    return f"rank {rank} (exit code {exitcode}): {failure_reason(exitcode, message)}"


def failure_summary(script: str, failures: dict) -> str:
    """One line: the rank that failed first and why, then the others (torchrun's ProcessFailures).

    Ranks the agent stopped with SIGTERM, once another had failed, are consequences and go last;
    among the rest the earliest wins, as in torchrun's own root-cause choice.
    """
    ordered = sorted(
        failures.items(), key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0])
    )
    first_rank, first = ordered[0]
    line = f"nanoddp run: {script} failed on {describe_failure(first_rank, first.exitcode, first.message)}"
    if len(ordered) > 1:
        others = ", ".join(f"rank {rank} (exit code {failure.exitcode})" for rank, failure in ordered[1:])
        line += f"; then {others}"
    return line


def run(args: argparse.Namespace) -> int:
    """`nanoddp run`: launch, wait, and return 0; 1 with the failure summary on stderr; 128 +
    signal with one line when stopped by SIGTERM or Ctrl-C (torchrun has stopped the workers)."""
    nproc = check_args(args)
    if args.on_failure == "continue":
        from nanoddp.run.ft_launch import run_fault_tolerant

        return run_fault_tolerant(args, nproc)
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX_TEMPLATE)
    job = AgentJob(
        torchrun_argv=agent_argv(args, nproc),
        scratch_prefix="nanoddp-run-",
        failure_lines=lambda failures: [failure_summary(args.script, failures)],
        stopped_line=lambda sig: f"nanoddp run: stopped by {sig.name}",
        log_dir=args.log_dir,
        watch=functools.partial(watched_agent, args.finished_grace, args.fail_on_early_exit),
        verbose=getattr(args, "verbose", False),
    )
    return run_torchrun_agent(job)


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoddp.run ...`: the same as `nanoddp run ...`."""
    from nanoddp.cli import main as cli_main

    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])
