"""`nanoddp train` and the torchrun worker entry point.

`nanoddp train` is two programs in one:

- outside torchrun (a user's shell) it is the *launcher*: it builds and checks the config
  (so bad input fails here, before any process group exists), fixes the run directory, and
  hands the job to torchrun's elastic agent (`torch.distributed.run`), which starts the
  workers and restarts them on failure (`--max-restarts`) or joins other nodes (`--nnodes`,
  `--rdzv-endpoint`);
- inside a torchrun worker it *trains*: the same flags, run on this rank.

So these are equivalent::

    nanoddp train --nproc 2 --steps 200
    torchrun --standalone --nproc-per-node 2 -m nanoddp.train --steps 200

(with plain torchrun and `--max-restarts`, pass `--out DIR` so that every restart finds the
same run directory and resumes from its snapshots).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import sys
import traceback
from collections.abc import Sized
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from nanoddp import env as nd
from nanoddp import fork_server, torchrun
from nanoddp.base import files
from nanoddp.base.files import try_lock
from nanoddp.base.limits import PG_TIMEOUT_MARGIN_S
from nanoddp.base.processes import die_with_launcher, name_this_process, take_descendants_along
from nanoddp.comm.transport import watchdog
from nanoddp.dataclass_cli import (
    KeepLinesHelpFormatter,
    add_dataclass_args,
    config_from_args,
    to_argv,
)
from nanoddp.train import signals
from nanoddp.train.checkpoint import rundir
from nanoddp.train.config import TrainConfig, filled, validate
from nanoddp.train.data.datasets import DataSpec
from nanoddp.train.engines import engine_help
from nanoddp.train.launcher import agent, preflight, rendezvous

if TYPE_CHECKING:
    from nanoddp.ft.placement import Placement

logger = logging.getLogger(__name__)

WORKER_MODULE = "nanoddp.train"
WORKER_SCRIPT = str(Path(__file__).resolve().parents[1] / "__main__.py")  # WORKER_MODULE's, as a file


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """TrainConfig's flags; `--engine` lists the engine registry, one line per engine."""
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file of TrainConfig keys")
    add_dataclass_args(parser, TrainConfig, extra_help={"engine": engine_help()})


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launch (torchrun's meaning)")
    group.add_argument(
        "--nproc", type=int, default=None, help="processes per node (default: all GPUs, else 2; 1 for --engine single)"
    )
    group.add_argument(
        "--nnodes",
        default="1",
        help="nodes, or MIN:MAX for elastic jobs (under --on-failure continue: start with MIN hosts, grow to MAX "
        "hosts' replicas, as --max-replicas; default: 1)",
    )
    group.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    group.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node)")
    group.add_argument("--rdzv-backend", default="c10d", help="rendezvous backend (default: c10d)")
    group.add_argument("--rdzv-id", default="none", help="job id shared by all nodes")
    group.add_argument(
        "--rdzv-timeout",
        type=float,
        default=rendezvous.RDZV_TIMEOUT_S,
        metavar="S",
        help=f"multi-node: seconds a node waits for the store and for all nodes (default: {rendezvous.RDZV_TIMEOUT_S})",
    )
    group.add_argument("--max-restarts", type=int, default=0, help="restart the workers this often on failure")
    group.add_argument("--standalone", action="store_true", help="single node, private rendezvous")
    quorum = parser.add_argument_group("quorum (--on-failure continue)")
    quorum.add_argument(
        "--lighthouse",
        default="",
        metavar="HOST:PORT",
        help="a quorum service (torchft's Lighthouse) already running; default: node 0's launcher runs one on "
        "--rdzv-endpoint (one node: on loopback)",
    )
    quorum.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        metavar="M",
        help="the fewest replicas that may go on training (default: a majority of the replicas the run starts "
        "with, --nnodes x --nproc, whatever --max-replicas; 1 lets the last host of two go on alone)",
    )
    quorum.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        metavar="M",
        help="the most replicas the run may grow to (default: --nnodes x --nproc, no growth): a host started "
        "later with --node-rank K >= --nnodes, its replica ids K*nproc.. below M, joins the running group and "
        "the global batch is split over it too",
    )


class _OwnUsageParser(argparse.ArgumentParser):
    """A subcommand parser that rejects unknown flags itself, so the error shows `train`'s usage
    (argparse otherwise hands them up and the top-level parser prints its own)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _load_config(args: argparse.Namespace) -> TrainConfig:
    """The config from defaults, --config FILE and flags; a malformed file is named."""
    import json

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    try:
        return config_from_args(TrainConfig, args, args.config)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {args.config!r} is not valid {Path(args.config).suffix[1:]}: {exc}") from None


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a model with data parallelism (torchrun under the hood)",
        description="Train GPT (or an MLP) data-parallel. With no flags: GPT tiny on the Python "
        "standard library's source, 2 processes, outputs in runs/<timestamp>/.",
        formatter_class=KeepLinesHelpFormatter,
    )
    train.__class__ = _OwnUsageParser
    _add_all_train_flags(train)
    train.set_defaults(run=run_train)


def _add_all_train_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of `nanoddp train`: the config's, the launch's and `--overwrite`."""
    add_train_args(parser)
    add_launch_args(parser)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="OUT holds an earlier run: move its outputs aside into OUT/previous-<time>/ and start anew",
    )


class _RaisingParser(argparse.ArgumentParser):
    """`nanoddp train`'s parser for a caller that reports errors itself: raise, don't exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def check_train_argv(argv: list[str]) -> TrainConfig:
    """Refuse now what `nanoddp train argv` would refuse in its launcher (an unknown flag, a bad
    value, a config that does not fit its data), as one ValueError, starting and writing nothing:
    for a program that runs `nanoddp train` later (`nanoddp bench wan --train-args`). Returns
    the config that run would have."""
    parser = _RaisingParser(prog="nanoddp train", add_help=False)  # `-h` is an unknown flag here
    _add_all_train_flags(parser)
    return prepare_launch(parser.parse_args(argv))[0]


# --- launcher -----------------------------------------------------------------------------


def default_nproc(engine: str) -> int:
    import torch

    if engine == "single":
        return 1
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _max_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {nnodes!r}") from None


def prepare_launch(
    args: argparse.Namespace, *, start_rank_server: bool = False
) -> tuple[TrainConfig, int, DataSpec, Placement | None]:
    """Build and check the config in the launcher process; return it, the processes per node,
    the data's spec (vocabulary) for the model checks, and under continue this host's replicas.
    With `start_rank_server` (the launcher itself), the ranks' fork server is forked from here,
    once the flags are checked and before the data's first torch computation."""
    from nanoddp.train.config import check_data
    from nanoddp.train.data.datasets import build_datasets

    config = _load_config(args)
    nproc = args.nproc if args.nproc is not None else default_nproc(config.engine)
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    rendezvous.check_launch_args(args)
    placement = None
    if config.on_failure == "continue":  # refused here, before any process starts
        from nanoddp.ft.placement import placement_for
        from nanoddp.train.ft_checks import check_continue, check_growth, continue_group_size

        across_hosts = bool(args.rdzv_endpoint or getattr(args, "lighthouse", ""))
        group_size = continue_group_size(config, nproc, across_hosts)
        if group_size > 1:  # the replicas fork their members by it (`nanoddp.ft.replica_members`)
            config = dataclasses.replace(config, group_size=group_size)
        check_continue(config)
        placement = placement_for(args, nproc, group_size)
        check_growth(config, placement.most_replicas * group_size)
    else:
        from nanoddp.ft.placement import refuse_continue_flags

        refuse_continue_flags(args)
    # under continue the run starts with --nnodes hosts' replicas (a grower splits the same global batch finer)
    if placement is not None:  # the processes of the replicas the run starts with
        world_size = placement.replicas * (config.group_size or 1)
    else:
        world_size = nproc * _max_nodes(args.nnodes)
    validate(config, world_size)
    preflight.check_worker_environ()
    if start_rank_server:
        _start_rank_server(config)
    train_set, _, spec = build_datasets(
        config.data, config.seq_len, config.val_fraction, filled(config.text_max_bytes), model=config.model
    )
    check_data(config, world_size, len(cast(Sized, train_set)))  # map-style: torch's Dataset stub has no __len__
    if config.out is None:  # fixed here, so that every worker and every restart agree on it
        config = dataclasses.replace(config, out=rundir.default_run_dir())
    return config, nproc, spec, placement


def _start_rank_server(config: TrainConfig) -> None:
    """The ranks' (or replicas') fork server as a fork of this launcher (`fork_server.start_as_fork`):
    no second torch import, seconds of CPU and of start-up saved on every launch."""
    if config.on_failure == "continue":
        from nanoddp.train.ft_trainer import WORKER_MODULE as FT_WORKER

        fork_server.start_as_fork([FT_WORKER])  # replicas get the launcher's environment at their start
    else:
        agent.start_worker_server()


def torchrun_argv(args: argparse.Namespace, config: TrainConfig, nproc: int) -> list[str]:
    """The `torchrun ...` command line (without the program name) for this launch: workers forked
    from a fork server, each running `python -m nanoddp.train`'s file in its interpreter
    (torchrun's --run-path; [Note: workers forked from a server] in `agent`)."""
    worker = ["--start-method", "forkserver", "--run-path", WORKER_SCRIPT]
    return [*rendezvous.launch_argv(args, nproc), *worker, *to_argv(config)]


def run_train(args: argparse.Namespace) -> int:
    if torchrun.inside_torchrun():  # `torchrun -m nanoddp.cli train ...`: we are a worker already
        return worker_main(_worker_config(args))
    config, nproc, spec, placement = prepare_launch(args, start_rank_server=True)
    out = filled(config.out)  # prepare_launch fixed it
    created = not Path(out).exists()
    preflight.check_out_dir(out)
    # Node 0's launcher owns OUT (rank 0, which writes it, runs there on a single node; other
    # nodes' launchers share the job; under --on-failure continue they check that they share OUT
    # too, see `_check_shared_out`).
    owner = args.node_rank == 0
    lock_fd = rundir.lock_run_dir(out) if owner else None
    started = False
    try:
        if owner:
            print(f"nanoddp: {config.out}: {preflight.prepare_run_dir(config, spec, args.overwrite)}", file=sys.stderr)
        started = True
        if config.on_failure == "continue":
            return _run_fault_tolerant(args, config, nproc, cast("Placement", placement))
        return agent.run_agent(config, torchrun_argv(args, config, nproc), verbose=getattr(args, "verbose", False))
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        if created and not started:  # refused before any worker: leave no empty run directory
            rundir.remove_if_empty(out)


def _run_fault_tolerant(args: argparse.Namespace, config: TrainConfig, nproc: int, placement: Placement) -> int:
    """`--on-failure continue`: one supervised process per replica (`nanoddp.train.ft_trainer`),
    this host's replicas of the run's (`nanoddp.ft.placement`)."""
    from nanoddp.ft.supervisor import Launch, supervise
    from nanoddp.train.ft_trainer import WORKER_MODULE as FT_WORKER

    out = filled(config.out)
    shared_out = (lambda: _check_shared_out(out)) if args.node_rank > 0 and not args.lighthouse else None
    command = [sys.executable, "-m", FT_WORKER, *to_argv(config)]
    launch = Launch(command, placement.nproc, args.max_restarts, config.collective_timeout, config.out, "nanoddp train",
                    warm_spare=config.warm_spare, placement=placement, wait_s=args.rdzv_timeout,
                    on_found=shared_out)  # fmt: skip
    return supervise(launch)


def _check_shared_out(out: str) -> None:
    """[Note: one OUT across hosts] Under `--on-failure continue` the group's rank 0 writes
    `metrics.jsonl`, the snapshots and `model.pt`, and rank 0 is wherever the quorum puts it: on
    node 0's host while replica 0 lives, on another host after that. So every host must pass the
    same `--out`, on a filesystem they all share, which node 0's launcher holds locked for the
    run (`rundir.lock_run_dir`). Another node checks that the lock is held once node 0 is up (its
    quorum service answers): a free lock means this OUT is not the directory node 0 writes. (With
    `--lighthouse`, node 0 may be gone while the run goes on: no check.)"""
    fd, _ = try_lock(Path(out) / rundir.LOCK_NAME)
    if fd is None:
        return  # held: by node 0's launcher, on the filesystem this host shares with it
    os.close(fd)
    raise ValueError(
        f"--out {out} is not held by node 0's launcher: under --on-failure continue every host passes the same "
        "--out on a filesystem all hosts share (the group's rank 0, on whichever host, writes metrics.jsonl and "
        "the snapshots there); mount node 0's run directory here, or pass its path"
    )


# --- worker -------------------------------------------------------------------------------


class _RankFormatter(logging.Formatter):
    """Info lines plain (`step 120 | loss ...`), everything else tagged with level and rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno == logging.INFO:
            return message
        return f"[rank {self.rank}] {record.levelname.lower()} {record.name}: {message}"


_RANK_LOG: dict[str, Path] = {}  # this worker's full log, once known


def _setup_worker_logging(rank: int, out: str | None) -> None:
    """stderr: rank 0's info lines, every rank's warnings. OUT/logs/rank<r>.log: everything,
    with the traceback of a failure, which the agent summarises in one line (agent.failure_line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RankFormatter(rank))
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers: list[logging.Handler] = [handler]
    if out is not None:
        path = agent.rank_log(out, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # through no planted link: the run directory may be shared (files.open_private)
        file_handler = logging.StreamHandler(os.fdopen(files.open_private(path, os.O_WRONLY | os.O_APPEND), "a"))
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
        _RANK_LOG["path"] = path
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.INFO)


def worker_main(config: TrainConfig) -> int:
    """Train on this rank (the process group comes from torchrun's environment)."""
    from nanoddp.train.trainer import Trainer

    env = nd.DistEnv.from_environ()
    name_this_process(f"{agent.WORKER_NAME}{env.rank}")
    # Die with the agent however it dies (SIGKILL included): no worker outlives its run. A worker
    # forked by the agent's fork server leads no session of its own (torchrun's started ones
    # do), so it starts a process group for what it starts, which goes with it.
    forked = die_with_launcher(int(os.environ.get(agent.AGENT_PID_VAR, os.getppid())))
    take_descendants_along(new_group=forked)
    signals.install()  # SIGTERM/SIGINT: finish the step, snapshot it, exit 128 + signal
    _setup_worker_logging(env.rank, config.out)
    # The watchdog reports a stuck nanoddp collective after collective_timeout; torch's own
    # collectives (torch DDP, loss averaging) fail through the process-group timeout a little
    # later, so neither can block forever and torchrun gets to restart the group.
    nd.init(env, timeout=timedelta(seconds=config.collective_timeout + PG_TIMEOUT_MARGIN_S))
    watchdog.enable(config.collective_timeout)
    try:
        Trainer.from_config(config, env).train()
    except signals.Interrupted as exc:  # every rank stopped at the same step, snapshot written
        watchdog.disable()
        nd.abandon()
        return exc.exit_code
    except BaseException:
        watchdog.disable()
        nd.abandon()  # no closing barrier: a peer may be gone, and the error must surface
        raise
    watchdog.disable()
    nd.cleanup()
    return 0


def _worker_entry(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {WORKER_MODULE}",
        description="nanoddp train, one rank (run me under torchrun)",
        formatter_class=KeepLinesHelpFormatter,
    )
    add_train_args(parser)
    args = parser.parse_args(argv)
    return worker_main(_worker_config(args))


def _worker_config(args: argparse.Namespace) -> TrainConfig:
    """A worker's config: defaults, --config FILE and flags, as the launcher reads them."""
    return config_from_args(TrainConfig, args, args.config)


def worker_entry() -> int:
    """`python -m nanoddp.train` under torchrun. A crash goes to torchrun's error file (the
    agent's one-line summary reads it) and, traceback included, to this rank's log file; the
    console gets the traceback only when there is no log file to hold it."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    if isinstance(sys.stdout, io.TextIOWrapper):  # forked, not started with -u: each line to the tee as printed
        sys.stdout.reconfigure(line_buffering=True)
    error_handler = get_error_handler()
    error_handler.initialize()
    try:
        return _worker_entry()
    except Exception as exc:
        error_handler.record_exception(exc)
        if "path" not in _RANK_LOG:
            raise
        files.append_text(_RANK_LOG["path"], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1


if __name__ == "__main__":
    sys.exit(worker_entry())
