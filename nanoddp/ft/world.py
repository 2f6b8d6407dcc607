"""Group rebuild: the process group torchft's Manager reconfigures is torch's default group.

Why the default group: every collective of `nanoddp.comm` (and every wrapper built on it) runs on
`group=None` unless told otherwise, and `nanoddp.comm.transport.transport.Peers` reads its ranks through
`torch.distributed` (`dist.get_rank(group)`, the group's global ranks), which only knows groups
made by `init_process_group`/`new_group`. So when the quorum changes, the survivors destroy the
default group and make a new one over the quorum's store, with their new ranks; nothing else
changes and no process starts. `nanoddp.comm` keeps one runner per group: the old group's runner
is dropped (`forget_groups`), and the next collective gets a fresh one on the new group.

torchft's Manager calls `configure` from its quorum thread while the main thread waits for the
quorum (`use_async_quorum=False`), so no collective of ours is in flight on the old group then:
the one that failed has already raised on the main thread.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoddp.comm.transport.runner import forget_groups
from nanoddp.comm.transport.transport import Waitable, send_on
from nanoddp.env import pin_gloo_to_loopback

logger = logging.getLogger(__name__)


class RebuiltWorld:
    """What torchft's Manager sees as its process group (`configure`, `errored`).

    Each `configure` makes a new default group; `processes` are the processes in it, in group-rank
    order (`replica_<k>:<uuid>`, unique per process, so a replacement is told from the process it
    replaces), and `generation` counts the groups made (the step loop notices a rebuild by it)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
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
        """Replace the default group by one of `world_size` ranks over the store at `store_addr`
        (`host:port/prefix`, a prefix of its own per quorum), this process being `rank`."""
        from torchft.process_group import create_store_client

        start = time.monotonic()
        if dist.is_initialized():
            dist.destroy_process_group()
            forget_groups()  # their threads end; the next collective makes a runner on the new group
        store = create_store_client(store_addr, timeout=self.timeout)
        pin_gloo_to_loopback()  # the replicas are all here: gloo listens on loopback (unless set)
        excepthook = sys.excepthook
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        sys.excepthook = excepthook  # torch's prefixes tracebacks with a rank that the next quorum may change
        # [Note: who is who] A replacement keeps the id of the replica it replaces, and one that is
        # quick (a warm spare) is in the very quorum that leaves its predecessor out: the ids alone
        # would not change. Each member leaves its process's own name in the group's store, whose
        # rendezvous everyone has just passed, and reads the others'.
        self.process = f"{replica_id}:{self._uuid}"
        store.set(f"nanoddp/process/{rank}", self.process)
        self.processes = tuple(store.get(f"nanoddp/process/{r}").decode() for r in range(world_size))
        self.generation += 1
        self.rebuild_s = time.monotonic() - start
        logger.debug("group %d: rank %d of %d, members %s", quorum_id, rank, world_size, self.processes)

    def errored(self) -> Exception | None:
        """torchft asks before each commit; a failed collective of ours raises on the main
        thread instead, and the step loop reports it to the Manager."""
        return None

    # [Note: state over the group] torchft's `PGTransport` moves a joiner's state with send/recv
    # on the process group it is given, by group rank; given this object, it uses the current
    # group, whichever quorum made it. Its tags (1, 2, 3, ...) are not nanoddp's (`transport`).
    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Waitable:
        """Send `tensors[0]` to group rank `dst_rank` on the current group (counted in `sent_bytes`)."""
        return send_on(self._group(), tensors[0], dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        """Receive `tensors[0]` from group rank `src_rank` on the current group."""
        return self._group().recv(tensors, src_rank, tag)

    def _group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("no process group: the quorum has not formed one yet")
        return group

    def close(self) -> None:
        """Destroy the current group. After a failed collective this is what tells the others at
        once: their receives from this rank fail when its sockets close, instead of waiting for the
        timeout (a ring's peer two hops from the lost rank would otherwise wait the whole of it)."""
        if dist.is_initialized():
            dist.destroy_process_group()
            forget_groups()
