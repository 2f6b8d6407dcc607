"""Who is in a process group: asked of torch's registry, else of the group object itself.

Why it exists: torch's `dist.get_rank(group)`, `get_world_size`, `get_backend` and
`get_process_group_ranks` answer only for groups its registry knows (made by `init_process_group`
or `new_group`). A fault-tolerance manager (torchft's `ProcessGroupGloo`/`ProcessGroupNCCL`) builds
a bare c10d `ProcessGroup` over a store of its own, and a new one whenever the quorum changes; the
registry never hears of it, and its members need not even share this process's default group. Our
collectives need only a group's rank, size, backend and send/recv, and such a group answers those
itself. So every question `nanoddp.comm` asks about a group is asked here, once per group (a
`Peers` keeps the answer): the registry first, else the object.

What src/dst name on an unregistered group: its own ranks, 0..size-1 (there are no global ranks
to translate to). Anything kept per group (runners, the watchdog's counts) is keyed by the group
object, never by member ranks, which such a group shares with the default one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Membership:
    """This process's view of one group."""

    rank: int  # this process's rank in the group; -1: not a member
    size: int
    ranks: tuple[int, ...]  # what src/dst name, by group rank: global ranks; an unregistered group's own
    backend: str  # "gloo", "nccl", ... (torch's name; a wrapper's "torchft-gloo" is "gloo")
    registered: bool  # known to torch's registry (its p2p may go through `dist.isend`)
    watch_key: GroupKey  # what the hang watchdog counts this group's calls under (`Unregistered` or ranks)


@dataclass(frozen=True)
class Unregistered:
    """The watchdog's key for a group the registry does not know: the object itself (by id), as its
    member ranks are the default group's too. Its members need not share the default store, so the
    watchdog has no progress of theirs to read (`watchdog.hang_report` says so)."""

    object_id: int
    size: int


# What the hang watchdog counts a group's calls under (`Membership.watch_key`).
GroupKey = tuple[int, ...] | Unregistered


def membership(group: dist.ProcessGroup | None) -> Membership:
    """Rank, size, member ranks and backend of `group` (None: the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        size = dist.get_world_size()
        ranks = tuple(range(size))
        return Membership(dist.get_rank(), size, ranks, dist.get_backend(), True, ranks)
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError):  # torch's registry does not know it
        return _of_the_object(group)
    rank = dist.get_rank(group)
    if rank < 0:  # registered, but not with this process in it: torch keeps no backend for it here
        return Membership(rank, len(ranks), ranks, "", True, ranks)
    return Membership(rank, len(ranks), ranks, dist.get_backend(group), True, ranks)


def _of_the_object(group: dist.ProcessGroup) -> Membership:
    if not isinstance(group, dist.ProcessGroup):  # torch's non-member sentinel, say
        return Membership(-1, 0, (), "", False, ())
    size = group.size()
    return Membership(group.rank(), size, tuple(range(size)), backend_name(group), False, Unregistered(id(group), size))


def backend_name(group: dist.ProcessGroup) -> str:
    """The backend of a group object: torchft's wrappers call theirs "torchft-gloo", "torchft-nccl"."""
    name = group.getBackendName() if hasattr(group, "getBackendName") else group._get_backend_name()
    for known in ("gloo", "nccl"):
        if name.endswith(known):
            return known
    return name
