"""What is specific to torchrun, srun and mpirun: their variables, read as one job of N ranks.

torchrun's elastic agent sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; srun and
mpirun set their own names, mapped here to torchrun's so that `DistEnv` reads one set (never N
single-rank jobs). Two workarounds for the agent run in-process sit here too: a fresh rendezvous
store per restart, and silence for a report the rendezvous timer prints after the last line.

Why: `srun -n 2 python train.py` or `mpirun -n 2 python train.py` starts N processes that set
none of torchrun's RANK/WORLD_SIZE. Read naively, each is a one-process job that trains alone
(N copies of the same run, each writing the same files). Here the scheduler's own variables
give rank, size and this node's layout; the rendezvous address, which neither scheduler sets,
comes from MASTER_ADDR/MASTER_PORT, and without them the job is refused in one line that is the
same on every rank (so every rank stops, none waits for the others).

`env.DistEnv.from_environ` calls `scheduler_vars` only when torchrun's variables are absent:
`srun torchrun ...` keeps torchrun's meaning.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sys import UnraisableHookArgs


@dataclass(frozen=True)
class Scheduler:
    """Where one scheduler keeps each fact (None: it does not say)."""

    name: str
    launch: str
    rank: str
    size: str
    local_rank: str | None
    local_size: str | None
    node_rank: str | None


# Checked in this order: Open MPI and MPICH's hydra inside a SLURM allocation set the SLURM_*
# variables of the allocation too, and their own describe the processes they started.
SCHEDULERS = (
    Scheduler("Open MPI", "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    Scheduler("MPICH/PMI", "mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
    Scheduler("SLURM", "srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID"),
)  # fmt: skip


def scheduler_vars(environ: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (and MASTER_ADDR/PORT,
    as given) from srun's or mpirun's variables; None when no scheduler started this process
    as part of a job of more than one rank. Raises ValueError, one line, when such a job gives
    no rendezvous address."""
    for scheduler in SCHEDULERS:
        if scheduler.rank in environ and scheduler.size in environ:
            break
    else:
        return None
    rank, size = _int(environ, scheduler.rank), _int(environ, scheduler.size)
    if size <= 1:
        return None  # `srun -n 1`: a one-process job is what it is
    unset = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in environ]
    if unset:
        raise ValueError(
            f"{scheduler.launch} ({scheduler.name}) started {size} processes but {' and '.join(unset)} "
            f"{'is' if len(unset) == 1 else 'are'} not set, so they cannot find each other: export "
            f"MASTER_ADDR=<the first node's host> MASTER_PORT=<a free port> before {scheduler.launch} "
            "(or start the job with torchrun / `nanoddp run`)"
        )
    local_rank = _optional_int(environ, scheduler.local_rank)
    local_size = _local_size(environ, scheduler)
    if local_rank is None or local_size is None:  # the scheduler does not say: one node, as torchrun's defaults
        local_rank, local_size = rank, size
    node_rank = _optional_int(environ, scheduler.node_rank)
    if node_rank is None:
        node_rank = rank // local_size
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": environ["MASTER_ADDR"],
        "MASTER_PORT": environ["MASTER_PORT"],
    }


def _local_size(environ: Mapping[str, str], scheduler: Scheduler) -> int | None:
    if scheduler.local_size is not None:
        return _optional_int(environ, scheduler.local_size)
    # SLURM: SLURM_TASKS_PER_NODE lists tasks per node in node order, runs compressed as
    # "2(x3),1"; this node's entry is at SLURM_NODEID.
    spec, node = environ.get("SLURM_TASKS_PER_NODE"), environ.get("SLURM_NODEID", "0")
    if spec is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def _optional_int(environ: Mapping[str, str], name: str | None) -> int | None:
    """The variable's value; None when it is unset or the scheduler has no such variable (`name`
    None). Asked before the lookup: `None in os.environ` raises TypeError, unlike a dict's."""
    if name is None or name not in environ:
        return None
    return _int(environ, name)


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    if not raw.isdigit():
        raise ValueError(f"environment variable {name} must be a non-negative integer, got {raw!r}")
    return int(raw)


def prepare_torchrun_launch() -> None:
    """Environment for an in-process torchrun agent, inherited by its workers.

    torchrun >= 2.5 lets workers share the rendezvous TCPStore; on a restart, workers can then
    read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712). A fresh
    store per attempt avoids that, so restarts (`--max-restarts`) work.
    """
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    ignore_rendezvous_timer_self_join()


def ignore_rendezvous_timer_self_join() -> None:
    """Keep torch's rendezvous keep-alive timer from printing a traceback after our last line.

    The c10d rendezvous renews its lease from a timer thread that holds the handler while it
    runs. When the agent lets go of the handler at that moment (a run ending, a SIGTERM), the
    handler is freed on the timer thread, and the timer's finalizer joins that same thread:
    RuntimeError("cannot join current thread"), printed as "Exception ignored in: <finalize ...>"
    after the launcher's one line. The finalizer sets the timer's stop event before it joins, so
    the daemon thread ends anyway: this drops that one report (from torch's `_stop_thread`) and
    passes every other unraisable exception on."""
    previous = sys.unraisablehook
    if getattr(previous, "nanoddp_rendezvous_filter", False):
        return

    def hook(unraisable: UnraisableHookArgs) -> None:
        if not _is_timer_self_join(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    hook.nanoddp_rendezvous_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _is_timer_self_join(exc: BaseException | None, tb: TracebackType | None) -> bool:
    if not isinstance(exc, RuntimeError) or str(exc) != "cannot join current thread":
        return False
    frames = traceback.extract_tb(tb)
    return any(f.name == "_stop_thread" and f.filename.endswith("elastic/rendezvous/utils.py") for f in frames)


def inside_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by torchrun's elastic agent (it sets TORCHELASTIC_RUN_ID)."""
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ
