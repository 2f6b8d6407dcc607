"""The `nanoddp train` launcher's side of a run: torchrun's elastic agent, in this process.

What the user sees of a run is decided here: one line per outcome instead of torchrun's log
dumps. A worker failure becomes one line per failed rank (exception type and message) with the
path of that rank's full log; a SIGTERM/SIGINT, which torchrun forwards to the workers (they
stop at an agreed step and snapshot it, see `signals`), becomes one line and exit 128 + signal.
torchrun's own per-run log directory (error files) goes into a temp dir removed at the end.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path

from nanoddp import env as nd
from nanoddp import torchrun
from nanoddp.comm.watchdog import HANG_EXIT_CODE
from nanoddp.tempdirs import make_private_dir
from nanoddp.train import signals
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import TrainConfig, filled

AGENT_PID_VAR = "NANODDP_AGENT_PID"  # the workers' parent: they die with it (cli.worker_main)
MESSAGE_CHARS = 300


def rank_log(out: str | Path, rank: int) -> Path:
    """The full log of one rank (every record and its traceback), written by the worker."""
    return Path(out) / "logs" / f"rank{rank}.log"


def run_agent(config: TrainConfig, torchrun_argv: list[str], verbose: bool = False) -> int:
    """Run torchrun's agent for `torchrun_argv` here; return the process exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    torchrun.prepare_torchrun_launch()
    os.environ[AGENT_PID_VAR] = str(os.getpid())
    if not verbose:
        _quiet_torchrun_logs()
    torchrun_argv, rendezvous_store = private_rendezvous(torchrun_argv)
    print(f"nanoddp: torchrun {' '.join(torchrun_argv)}", file=sys.stderr)
    log_dir = make_private_dir("nanoddp-torchrun-")  # else torchelastic leaves its own
    try:
        run(get_args_parser().parse_args(["--log-dir", log_dir, *torchrun_argv]))
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            print(f"nanoddp: {failure_line(rank, failure, filled(config.out))}", file=sys.stderr)
        return 1
    except SignalException as exc:  # torchrun forwarded it; the workers stopped and snapshotted
        print(f"nanoddp: {signals.interrupt_line(*newest_snapshot(filled(config.out)))}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        del rendezvous_store
    print(f"nanoddp: done; outputs in {config.out}/ (try: nanoddp sample --run {config.out})", file=sys.stderr)
    return 0


def private_rendezvous(torchrun_argv: list[str]) -> tuple[list[str], object | None]:
    """Single node (`--standalone`): host the rendezvous store on loopback only.

    torchrun's standalone store listens on every interface. Instead this process starts a
    loopback-only store (`env.loopback_store`) and points torchrun's c10d rendezvous at it;
    torchrun's own TCPStore for that port then shares it (multi-tenant). Returns the new argv
    and the store, which must stay referenced while the agent runs."""
    if "--standalone" not in torchrun_argv:
        return torchrun_argv, None
    store = nd.loopback_store(0, 0, 1)
    argv = list(torchrun_argv)
    argv.remove("--standalone")
    argv[argv.index("--rdzv-id") + 1] = secrets.token_hex(8)
    argv[argv.index("--rdzv-backend") + 1] = "c10d"
    return ["--rdzv-endpoint", f"127.0.0.1:{store.port}", *argv], store


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
