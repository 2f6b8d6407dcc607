"""Subgroups of the world: torch's `new_group`, made safe to call the way a learner first writes it.

A process group is created collectively: every rank must call `new_group` for every group, in the
same order, members or not. These helpers do that bookkeeping, so "the even ranks" or "split by
node" is one call that cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch.distributed as dist


def new_group(ranks: Sequence[int], backend: str | None = None) -> dist.ProcessGroup | None:
    """A process group of `ranks`; call it on EVERY rank, members or not (torch requires it).

    Returns None on ranks outside the group, so `if group is not None:` reads naturally.
    """
    world_size = dist.get_world_size()
    wanted = sorted(set(int(r) for r in ranks))
    if not wanted:
        raise ValueError("new_group needs at least one rank, got an empty list")
    bad = [r for r in wanted if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside the world [0, {world_size})")
    group = dist.new_group(wanted, backend=backend)
    return group if dist.get_rank() in wanted else None


def subgroups_by(key: Callable[[int], Hashable]) -> dist.ProcessGroup:
    """Split the world by `key(rank)` and return this rank's group.

    Every rank creates every group in the same (sorted) order, which hides torch's trap: a rank
    that skips a `new_group` call, or calls them in another order, deadlocks the others.
    """
    world_size = dist.get_world_size()
    by_label: dict[Hashable, list[int]] = {}
    for r in range(world_size):
        by_label.setdefault(key(r), []).append(r)
    mine = None
    for label in sorted(by_label, key=repr):
        group = new_group(by_label[label])
        if group is not None:
            mine = group
    assert mine is not None  # every rank has a label, so it is in some group
    return mine


def even_ranks_group() -> dist.ProcessGroup | None:
    """The group of even ranks (the collectives tutorial's subgroup example); None on odd ranks. Call on every rank."""
    return new_group(range(0, dist.get_world_size(), 2))


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of `group`'s members, in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)
