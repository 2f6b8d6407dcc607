"""The few collectives the trainer uses to keep ranks in agreement, and a plain path for one rank.

Decisions that may fail (which snapshot to resume, which run directory to use) are made on
rank 0 and broadcast, so every rank raises the same error instead of one rank raising while the
others wait in the next collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanoddp.env import DistEnv


def distributed() -> bool:
    """A process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (and return it); unchanged on a single rank."""
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_master(value: Any, env: DistEnv) -> Any:
    """Rank 0's `value` on every rank (a plain return when there is only one)."""
    if not distributed():
        return value
    box = [value if env.is_master else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
