"""The quorum's process group, and each replica's own default group beside it.

Why two groups: a replica's engine (DDP, ZeRO, HSDP) is built once over its default group and must
never be rebuilt, while the replicas present change from step to step. So the default group stays
the replica's own (`own_world`: a one-rank gloo world over an in-memory store, or a replica group's
G members over their store, the engines sharding only among them), and what torchft's Manager
reconfigures on each quorum is a second group across the replicas (one per group rank: rank g of
every replica), `ReplicaGroup`: torchft's own `ProcessGroupGloo` wrapper, whose
`configure` aborts the old c10d group and makes a new one over the quorum's store. torch's registry
never hears of that group; `nanoddp.comm` asks the group object itself who is in it
(`comm.transport.membership`), so every cross-replica collective takes it explicitly
(`group=ReplicaGroup.group()`), and nothing else runs on it.

[Note: on accelerators] Where each of this host's processes can own a GPU, both groups are nccl
and the model, the gradients and every tensor a collective of the step moves live on the
process's GPU (`ReplicaEnv.backend`, the rule torchrun's workers follow: `nanoddp.env.default_backend`);
elsewhere gloo on CPU tensors. gloo's own timeout turns a lost or hung peer into an error on the
main thread. nccl has none that spares the process (c10d's watchdog ends it), so, as torchft's own
`ProcessGroupNCCL` does for its calls, the step's cross-replica phase runs `guarded`: past the
collective timeout the communicator is aborted, which ends the kernels waiting on the lost peer,
and `errored` then tells the Manager, whose commit vote fails the step.

torchft's Manager calls `configure` from its quorum thread while the main thread waits for the
quorum (`use_async_quorum=False`), so no collective of ours is in flight on the old group then: the
one that failed has already raised on the main thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoddp.comm.transport.runner import forget_group
from nanoddp.comm.transport.transport import Waitable, count_sent, send_on
from nanoddp.env import pin_sockets_to_loopback
from nanoddp.ft.manager import torchft_modules
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.replica_members import group_store

logger = logging.getLogger(__name__)


def own_world(env: ReplicaEnv) -> None:
    """This replica's default group, made once per process and never rebuilt: a one-rank world
    over an in-memory store (one rank has nobody to meet: nothing listens for it), or with
    `--group-size G` the G members' world over their group's store (`replica_members`); nccl on
    the process's GPU where `env.backend` says so. A default group the process made itself
    is kept."""
    if dist.is_initialized():
        return
    pin_sockets_to_loopback()  # loopback on one node; across hosts the launcher set the host's interface
    timeout = timedelta(seconds=env.timeout_s)
    backend, device = env.backend, env.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.group_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    store = dist.PrefixStore("nanoddp/world", group_store(env))
    dist.init_process_group(backend, store=store, rank=env.group_rank, world_size=env.group_size, timeout=timeout)


class ReplicaGroup:
    """What torchft's Manager sees as its process group (`configure`, `errored`, `send`/`recv`).

    Each `configure` makes a new group across the replicas of the quorum (torchft's
    `ProcessGroupGloo`: the old one aborted, a new one made); `group()` is that c10d group, the
    one our collectives take; `processes` are the processes in it, in group-rank order
    (`replica_<k>:<uuid>`, unique per process, so a replacement is told from the process it
    replaces), and `generation` counts the groups made (the step loop notices a rebuild by it)."""

    def __init__(self, timeout_s: float, backend: str = "gloo") -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = backend
        kinds = torchft_modules().process_group
        kind = kinds.ProcessGroupNCCL if backend == "nccl" else kinds.ProcessGroupGloo
        self._wrapper = kind(timeout=self.timeout)
        self.processes: tuple[str, ...] = ()
        self.process = ""  # this process's own name among `processes`
        self._uuid = uuid.uuid4().hex  # what tells this process from the others that play its replica
        self.generation = 0
        self.rebuild_s = 0.0  # how long the last rebuild took

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Replace the group by one of `world_size` replicas over the store at `store_addr`
        (`host:port/prefix`, a prefix of its own per quorum), this process being `rank`."""
        from torchft.process_group import create_store_client

        start = time.monotonic()
        self._forget()
        pin_sockets_to_loopback()  # unless set: across hosts the launcher names the host's interface
        self._wrapper.configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        # [Note: who is who] A replacement keeps the id of the replica it replaces, and one that is
        # quick (a warm spare) is in the very quorum that leaves its predecessor out: the ids alone
        # would not change. Each member leaves its process's own name in the group's store, whose
        # rendezvous everyone has just passed, and reads the others'.
        store = create_store_client(store_addr, timeout=self.timeout)
        self.process = f"{replica_id}:{self._uuid}"
        store.set(f"nanoddp/process/{rank}", self.process)
        self.processes = tuple(store.get(f"nanoddp/process/{r}").decode() for r in range(world_size))
        self.generation += 1
        self.rebuild_s = time.monotonic() - start
        logger.debug("group %s: rank %d of %d, members %s", quorum_id, rank, world_size, self.processes)

    def group(self) -> dist.ProcessGroup:
        """The current group across the replicas (a c10d group torch's registry does not know)."""
        group = self._wrapper._pg
        if group is None:
            raise RuntimeError("no group across the replicas: the quorum has not formed one yet")
        return group

    def errored(self) -> Exception | None:
        """torchft asks before each commit. On gloo a failed collective of ours raises on the
        main thread instead, and the step loop reports it to the Manager; on nccl a phase
        `guarded` past its timeout aborted the communicator, and torchft's wrapper says so."""
        return self._wrapper.errored() if self.backend == "nccl" else None

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Around a phase of collectives on the current group: on nccl, abort the communicator
        if the phase, or the kernels it queued on the GPU, outlast the collective timeout (the
        module's note; torchft's own timers); on gloo nothing: its timeout raises by itself."""
        if self.backend != "nccl":
            yield
            return
        from torchft.futures import context_timeout, stream_timeout

        with context_timeout(self._abort_late, self.timeout):
            yield
        stream_timeout(self._abort_late, self.timeout)

    def _abort_late(self) -> None:
        logger.warning("a collective across the replicas outlasted %s: its communicator is aborted", self.timeout)
        self._wrapper.abort()

    # [Note: state over the group] torchft's `PGTransport` moves a joiner's state with send/recv
    # on the process group it is given, by group rank; given this object, it uses the current
    # group, whichever quorum made it. Its tags (1, 2, 3, ...) are not nanoddp's (`transport`).
    # On nccl the wrapper's own send/recv: its works abort the communicator past the timeout.
    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Waitable:
        """Send `tensors[0]` to group rank `dst_rank` on the current group (counted in `sent_bytes`)."""
        if self.backend == "nccl":
            count_sent(tensors[0])
            return self._wrapper.send(tensors, dst_rank, 0)  # nccl has no tags: its p2p is in order
        return send_on(self.group(), tensors[0], dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        """Receive `tensors[0]` from group rank `src_rank` on the current group."""
        if self.backend == "nccl":
            return self._wrapper.recv(tensors, src_rank, 0)
        return self.group().recv(tensors, src_rank, tag)

    def close(self) -> None:
        """Abort the current group. After a failed collective this is what tells the others at
        once: their receives from this rank fail when its sockets close, instead of waiting for the
        timeout (a ring's peer two hops from the lost rank would otherwise wait the whole of it)."""
        self._forget()
        self._wrapper.abort(errored=False)

    def _forget(self) -> None:
        """Drop our runner of the current group, so that nothing of ours holds it once aborted."""
        if self._wrapper._pg is not None:
            forget_group(self._wrapper._pg)
