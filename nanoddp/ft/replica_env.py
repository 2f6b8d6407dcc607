"""Where this replica sits in a fault-tolerant run: `ReplicaEnv`, the one reader of its variables.

`nanoddp run --on-failure continue` starts one process per replica and tells each, through the
environment, where the quorum service listens, which replica it is, how many replicas the run
starts with (on every host together) and may grow to, the address its own servers bind (loopback on one node,
the host's address towards the quorum service across hosts: `nanoddp.ft.placement`) and whether
it joins a run already under way. A replica is not a torchrun worker: it has no fixed rank (its rank in the group is
whatever the quorum of the moment gives it), so `nanoddp.env.DistEnv` does not describe it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from nanoddp.base.processes import die_with_launcher, name_this_process, named_descendants, take_descendants_along

if TYPE_CHECKING:
    import torch

LIGHTHOUSE_VAR = "NANODDP_FT_LIGHTHOUSE"  # host:port of the quorum service (torchft's Lighthouse)
REPLICA_VAR = "NANODDP_FT_REPLICA"  # this replica's id, 0 .. replicas-1, kept by its replacements
REPLICAS_VAR = "NANODDP_FT_REPLICAS"  # replicas the run starts with: the first step waits for them
MAX_REPLICAS_VAR = "NANODDP_FT_MAX_REPLICAS"  # the most the run may grow to: every replica id is below it
ATTEMPT_VAR = "NANODDP_FT_ATTEMPT"  # 0 for the first process of a replica, k for its k-th replacement
TIMEOUT_VAR = "NANODDP_FT_TIMEOUT"  # seconds a collective may wait: past it, a silent peer is lost
OUT_VAR = "NANODDP_FT_OUT"  # directory of metrics.jsonl (not set: no metrics file)
LAUNCHER_VAR = "NANODDP_FT_LAUNCHER"  # the launcher's pid: a replica dies with it
BEATS_VAR = "NANODDP_FT_BEATS"  # directory where each replica marks every step boundary it reaches
ADDRESS_VAR = "NANODDP_FT_ADDRESS"  # the address this replica's servers bind and advertise
MIN_REPLICAS_VAR = "NANODDP_FT_MIN_REPLICAS"  # the fewest replicas a step may commit with
JOIN_VAR = "NANODDP_FT_JOIN"  # "1": the run was under way when this host's launcher started
HOST_SLOT_VAR = "NANODDP_FT_HOST_SLOT"  # this replica's place among its host's: 0 .. HOST_REPLICAS-1
HOST_REPLICAS_VAR = "NANODDP_FT_HOST_REPLICAS"  # the replicas on this host (its launcher's --nproc)
LOOPBACK = "127.0.0.1"
PROCESS_NAME = "ft-replica"  # + "<id>.<attempt>": what ps and psutil's name() show for a replica's process


@dataclass(frozen=True)
class ReplicaEnv:
    """This replica's place in a fault-tolerant run. Immutable: pass it down."""

    lighthouse: str
    """`http://host:port` of the quorum service."""
    replica: int
    """This replica's id; a replacement keeps the id of the process it replaces."""
    replicas: int
    """How many replicas the run starts with."""
    max_replicas: int = 0
    """The most replicas the run may grow to (`--max-replicas`); 0: `replicas`, no growth.
    Ids from `replicas` up are growers: hosts launched later (`nanoddp.ft.placement`)."""
    attempt: int = 0
    """0 for a replica's first process, k for its k-th replacement (a joiner)."""
    timeout_s: float = 30.0
    """Seconds a collective may wait for a peer before that peer counts as lost."""
    out: str | None = None
    """Where `metrics.jsonl` goes, or None."""
    launcher_pid: int | None = None
    """The launcher's pid (a replica asks Linux to end it when the launcher dies)."""
    beats: str | None = None
    """The launcher's directory of step marks (`beat_path`): how it tells a hung replica."""
    address: str = LOOPBACK
    """Where this replica's servers listen (its Manager's, its group store, gloo's) and what its
    Manager tells the others: loopback on one node, the host's own address across hosts."""
    min_replicas: int = 1
    """The fewest replicas a step may commit with (the quorum service forms no smaller group)."""
    join: bool = False
    """Its host's launcher started while the run was under way (a host lost and started again):
    a joiner from its first process on."""
    group_rank: int = 0
    """This process's rank in its replica group (`--group-size`; set in the process by
    `nanoddp.ft.replica_members.start_members`, not by the launcher)."""
    group_size: int = 1
    """The processes of this replica group: 1, or G under `--group-size G`."""
    store_port: int = 0
    """The port of the replica group's store on `address` (G > 1; its rank 0 serves it)."""
    host_slot: int = 0
    """This replica's place among the replicas its host's launcher plays (0 .. host_replicas-1):
    with `group_rank`, which of the host's accelerators its processes take (`local_rank`)."""
    host_replicas: int = 1
    """The replicas this host's launcher plays."""

    @property
    def local_rank(self) -> int:
        """This process among every process of the run on this host, as torchrun's LOCAL_RANK."""
        return self.host_slot * self.group_size + self.group_rank

    @property
    def local_world_size(self) -> int:
        """The run's processes on this host, as torchrun's LOCAL_WORLD_SIZE."""
        return self.host_replicas * self.group_size

    @property
    def backend(self) -> str:
        """This process's groups' backend: nccl where every process of the run on this host can
        own a GPU, else gloo (the rule torchrun's workers follow: `nanoddp.env.default_backend`)."""
        from nanoddp.env import default_backend  # imports torch: only when asked

        return default_backend(self.local_world_size)

    @property
    def device(self) -> torch.device:
        """Where this process's model and the tensors its collectives move live: its `local_rank`-th
        GPU under nccl, else the CPU. A loop of one's own puts its model there before
        `FaultTolerant(model, ...)`."""
        from nanoddp.env import device_for

        return device_for(self.backend, self.local_rank)

    def beat_path(self) -> str | None:
        """The file this replica touches at every step boundary (its group's rank 0), or None."""
        return None if self.beats is None or self.group_rank else os.path.join(self.beats, f"replica-{self.replica}")

    def __post_init__(self) -> None:
        if self.max_replicas and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas must be 0 or >= replicas ({self.replicas}), got {self.max_replicas}")
        if not 0 <= self.replica < self.most_replicas:
            raise ValueError(f"replica id must be in [0, {self.most_replicas}), got {self.replica}")
        if not self.timeout_s > 0:
            raise ValueError(f"the collective timeout must be > 0 seconds, got {self.timeout_s}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"min_replicas must be in [1, {self.replicas}], got {self.min_replicas}")
        if not 0 <= self.host_slot < self.host_replicas:
            raise ValueError(f"host_slot must be in [0, {self.host_replicas}), got {self.host_slot}")

    @property
    def most_replicas(self) -> int:
        """Every replica id of the run is below this."""
        return self.max_replicas or self.replicas

    @property
    def grower(self) -> bool:
        """Past the replicas the run starts with: its host grows the run (`--max-replicas`)."""
        return self.replica >= self.replicas

    @property
    def who(self) -> str:
        """This process in a line: `replacement 2 of replica 1`, `replica 3 (its host grows the run)`."""
        if self.attempt > 0:
            return f"replacement {self.attempt} of replica {self.replica}"
        if self.grower:
            return f"replica {self.replica} (its host grows the run)"
        return f"replica {self.replica}" + (" (its host started again)" if self.join else "")

    @property
    def joiner(self) -> bool:
        """A replacement, or a process of a host that joins a running run: it takes its state from
        a peer, never from its own start (no resume, no wait for the run's first full group)."""
        return self.attempt > 0 or self.join

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ReplicaEnv:
        """Read the variables `nanoddp run --on-failure continue` sets; a clear error without them."""
        environ = os.environ if environ is None else environ
        if LIGHTHOUSE_VAR not in environ:
            raise RuntimeError(
                f"{LIGHTHOUSE_VAR} is not set: a fault-tolerant loop runs under "
                "`nanoddp run --on-failure continue SCRIPT`, which starts the quorum service and the replicas"
            )
        return cls(
            lighthouse=environ[LIGHTHOUSE_VAR],
            replica=int(environ[REPLICA_VAR]),
            replicas=int(environ[REPLICAS_VAR]),
            max_replicas=int(environ.get(MAX_REPLICAS_VAR, "0")),
            attempt=int(environ.get(ATTEMPT_VAR, "0")),
            timeout_s=float(environ.get(TIMEOUT_VAR, "30")),
            out=environ.get(OUT_VAR) or None,
            launcher_pid=int(environ[LAUNCHER_VAR]) if environ.get(LAUNCHER_VAR) else None,
            beats=environ.get(BEATS_VAR) or None,
            address=environ.get(ADDRESS_VAR) or LOOPBACK,
            min_replicas=int(environ.get(MIN_REPLICAS_VAR, "1")),
            join=environ.get(JOIN_VAR) == "1",
            host_slot=int(environ.get(HOST_SLOT_VAR, "0")),
            host_replicas=int(environ.get(HOST_REPLICAS_VAR, "1")),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that describe this replica to its process (the launcher's side)."""
        env = {
            LIGHTHOUSE_VAR: self.lighthouse,
            REPLICA_VAR: str(self.replica),
            REPLICAS_VAR: str(self.replicas),
            MAX_REPLICAS_VAR: str(self.max_replicas),
            ATTEMPT_VAR: str(self.attempt),
            TIMEOUT_VAR: repr(self.timeout_s),
            ADDRESS_VAR: self.address,
            MIN_REPLICAS_VAR: str(self.min_replicas),
            JOIN_VAR: "1" if self.join else "0",
            HOST_SLOT_VAR: str(self.host_slot),
            HOST_REPLICAS_VAR: str(self.host_replicas),
        }
        if self.out is not None:
            env[OUT_VAR] = self.out
        if self.launcher_pid is not None:
            env[LAUNCHER_VAR] = str(self.launcher_pid)
        if self.beats is not None:
            env[BEATS_VAR] = self.beats
        return env


def become_replica(env: ReplicaEnv) -> None:
    """What a replica's process does first, whatever it runs: take its name (`PROCESS_NAME`), die
    with its launcher however the launcher dies (its pid in `env`), and take what it starts along
    when it dies itself (the launcher starts it in a session of its own)."""
    name_this_process(f"{PROCESS_NAME}{env.replica}.{env.attempt}")
    die_with_launcher(env.launcher_pid)
    take_descendants_along()


def replica_processes(launcher: psutil.Process) -> dict[tuple[int, int], psutil.Process]:
    """The live replica processes among the launcher's descendants, by (replica id, attempt)."""
    found = {}
    for suffix, proc in named_descendants(launcher, PROCESS_NAME).items():
        replica, _, attempt = suffix.partition(".")
        if replica.isdigit() and attempt.isdigit():
            found[(int(replica), int(attempt))] = proc
    return found
