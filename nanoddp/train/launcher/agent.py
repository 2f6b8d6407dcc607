"""The one torchrun-agent wrapper, shared by `nanoddp train` and `nanoddp run`.

Both start torchrun's elastic agent here, in this process, and differ only in what they pass
(`AgentJob`: their lines, log dir and watch).

What the user sees of a run is decided here: one line per outcome instead of torchrun's log
dumps. A worker failure becomes the command's failure line(s) (exception type and message per
rank: `failure_reason`); a SIGTERM/SIGINT, which torchrun forwards to the workers (`nanoddp
train`'s stop at an agreed step and snapshot it, see `signals`), becomes one line and exit
128 + signal. Around the agent, for both commands: a fresh rendezvous store per restart
(`torchrun.prepare_torchrun_launch`), workers that die with this process (`AGENT_PID_VAR`), the
rendezvous completed for this host (`rendezvous`: loopback on one node; on several, the store's
host and every listener's address from this host's interfaces, and one line when the nodes
cannot meet), torchrun's warnings kept quiet unless `-v`, and torchrun's log directory (error
files, tee'd output) in a private temp dir removed at the end unless the command keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from nanoddp import fork_server, torchrun
from nanoddp.base import processes
from nanoddp.comm.transport.watchdog import HANG_EXIT_CODE
from nanoddp.tempdirs import make_private_dir
from nanoddp.train import signals
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import TrainConfig, filled
from nanoddp.train.launcher import rendezvous

# What a `nanoddp train` worker imports before its first step, imported once by the fork server
# its workers are forked from (`nanoddp.fork_server`).
WORKER_PRELOAD = ("nanoddp.train.launcher.cli", "nanoddp.train.trainer")
WORKER_NAME = "nanoddp-rank"  # + the global rank: what ps and psutil's name() show for a worker
AGENT_PID_VAR = "NANODDP_AGENT_PID"  # the workers' parent: they die with it (cli.worker_main, run.bootstrap)
MESSAGE_CHARS = 300


class AgentStop(RuntimeError):
    """Raised inside the agent by a command's watch to end the job (exit 1); its text is the line shown."""


@dataclass(kw_only=True)
class AgentJob:
    """What a command tells the one agent wrapper; everything else is the same for every command."""

    torchrun_argv: list[str]
    """torchrun's command line without the program name and without `--log-dir` (added here)."""
    scratch_prefix: str
    """Name prefix of the private temp log dir; named by pid, so the next start sweeps a killed one's."""
    failure_lines: Callable[[dict[int, Any]], list[str]]
    """The lines for a failed job, from torchrun's {global rank: ProcessFailure}."""
    stopped_line: Callable[[signal.Signals], str]
    """The line for a job stopped by SIGTERM or Ctrl-C."""
    log_dir: str | None = None
    """Keep torchrun's log dir (each worker's output) here; None: the temp dir, removed at the end."""
    done_line: str | None = None
    """The line for a job that finished; None: nothing."""
    watch: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around the agent (`nanoddp run`'s finished-ranks watch); may raise `AgentStop`."""
    verbose: bool = False
    """Show torchrun's own warnings (`nanoddp -v ...`)."""
    fork_server_preload: tuple[str, ...] = ()
    """With `--start-method forkserver` in the argv: the modules the fork server imports once, so
    that every worker (and every restart's) is a fork of a process that has them, not a fresh
    interpreter importing torch ([Note: workers forked from a server] in `nanoddp.fork_server`)."""


def _set_worker_environ() -> None:
    """What every worker inherits from the agent's process (its fork server's, for forked ones)."""
    torchrun.prepare_torchrun_launch()
    os.environ[AGENT_PID_VAR] = str(os.getpid())


def start_worker_server() -> None:
    """`nanoddp train`'s workers' fork server, forked from this launcher before its first torch
    computation (`fork_server.start_as_fork`), with the environment they inherit set first; the
    agent's `fork_server.start` later finds it running."""
    _set_worker_environ()
    fork_server.start_as_fork(WORKER_PRELOAD)


def run_torchrun_agent(job: AgentJob) -> int:
    """Run torchrun's agent for `job` here; return the exit code: 0, 1 on a failure, 128 + signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    _set_worker_environ()
    if not job.verbose:
        _quiet_torchrun_logs()  # its warnings on a stop or a failure: the job's one line instead
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    log_dir = job.log_dir or make_private_dir(job.scratch_prefix)  # else torchelastic leaves its own
    argv: list[str] = []
    hosted: list[object] = []  # the rendezvous store this process serves, if any: kept while the agent runs
    try:
        argv, store = rendezvous.rendezvous(["--log-dir", log_dir, *job.torchrun_argv])
        if job.fork_server_preload:
            fork_server.start(job.fork_server_preload)
        hosted.append(store)
        print(f"nanoddp: torchrun {' '.join(argv)}", file=sys.stderr)
        with job.watch():
            run(get_args_parser().parse_args(argv))
    except rendezvous.RendezvousUnreachable as exc:
        _say([str(exc)])
        return 1
    except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
        _say([rendezvous.failure_line(argv, exc)])
        return 1
    except ChildFailedError as exc:
        _say(job.failure_lines(exc.failures))
        return 1
    except AgentStop as exc:  # the agent stopped the workers on its way out
        _say([str(exc)])
        return 1
    except (SignalException, KeyboardInterrupt) as exc:  # torchrun forwarded it to the workers
        sig = signal.Signals(exc.sigval) if isinstance(exc, SignalException) else signal.SIGINT
        _say([job.stopped_line(sig)])
        return 128 + sig
    finally:
        hosted.clear()
        if job.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    if job.done_line is not None:
        _say([job.done_line])
    return 0


def _say(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """Until torchrun's agent installs its own (as it starts the workers), SIGTERM is raised as
    the agent raises it, so that a stop during the rendezvous ends the same way."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


# --- nanoddp train ----------------------------------------------------------------------------


def rank_log(out: str | Path, rank: int) -> Path:
    """The full log of one rank (every record and its traceback), written by the worker."""
    return Path(out) / "logs" / f"rank{rank}.log"


def train_workers(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The live workers of `nanoddp train` among the launcher's descendants, by global rank (each
    names itself `WORKER_NAME` + rank)."""
    named = processes.named_descendants(launcher, WORKER_NAME)
    return {int(rank): proc for rank, proc in named.items() if rank.isdigit()}


def run_agent(config: TrainConfig, torchrun_argv: list[str], verbose: bool = False) -> int:
    """`nanoddp train`'s launch: the agent for `torchrun_argv`, with the train lines (one per
    failed rank, the snapshot to resume from on a stop, the outputs when done)."""
    out = filled(config.out)
    job = AgentJob(
        torchrun_argv=torchrun_argv,
        scratch_prefix="nanoddp-torchrun-",
        failure_lines=lambda failures: [
            f"nanoddp: {failure_line(rank, failure, out)}" for rank, failure in sorted(failures.items())
        ],
        stopped_line=lambda sig: f"nanoddp: {signals.interrupt_line(*newest_snapshot(out))}",
        done_line=f"nanoddp: done; outputs in {config.out}/ (try: nanoddp sample --run {config.out})",
        verbose=verbose,
        fork_server_preload=WORKER_PRELOAD,
    )
    return run_torchrun_agent(job)


def failure_reason(exitcode: int, message: object) -> str:
    """Why a torchrun worker failed, on one line: its exception, the signal that killed it, or
    the watchdog's hang report. `message` is torchrun's ProcessFailure.message: a string, or the
    error file's {"message": "Type: text", "extraInfo": ...}."""
    text = message.get("message", "") if isinstance(message, dict) else message
    text = " ".join(str(text or "").split())
    if exitcode == HANG_EXIT_CODE and not text.startswith("CollectiveHang"):
        return "collective hang reported by the watchdog (its report is above)"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if not text or text.startswith("To enable traceback"):
        return f"exited with code {exitcode}"
    return text


def failure_line(rank: int, failure, out: str | Path) -> str:
    """'rank 1 failed: ValueError: ... (full log: OUT/logs/rank1.log)' for a ProcessFailure."""
    message = failure_reason(failure.exitcode, failure.message)
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    return f"rank {rank} failed: {message} (full log: {rank_log(out, rank)})"


def newest_snapshot(out: str | Path) -> tuple[int | None, bool]:
    """(step of the newest valid snapshot or None, whether the workers wrote it on the signal)."""
    found = snapshot.find_latest_valid(Path(out) / "snapshots")
    if found is None:
        return None, False
    train = snapshot.train_state(found[1], found[0])
    return int(train["step"]), bool(train.get("interrupted"))


class _TorchrunNoise(logging.Filter):
    """Drop torchrun's own warnings (signal forwarding, per-worker failure dumps) in the agent:
    the launcher prints one line per outcome instead. `nanoddp -v train` shows them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.name.startswith("torch.distributed")


def _quiet_torchrun_logs() -> None:
    noise = _TorchrunNoise()
    for name in ("", "torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(noise)
