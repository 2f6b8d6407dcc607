"""The one way the low-communication optimizers average tensors over ranks: flat, one message.

LocalSGD averages the parameters themselves, DiLoCo the pseudo-gradients; both send the same
kind of thing (every trainable tensor, once every H steps), so both use this. The tensors of one
dtype are laid end to end in a flat buffer and all-reduced once, which is what makes a sync cost
one message per dtype instead of one per parameter.

[Note: divide, then sum] Each rank divides its own copy by the world size before the all-reduce,
as torch's `PeriodicModelAverager` (`torch.distributed.algorithms.model_averaging.utils`) does,
so that our LocalSGD gives bitwise torch's result on two ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.replicas import group_size_rank_src
from nanoddp.parallel.tensors import through_flat


@torch.no_grad()
def average_(tensors: Sequence[torch.Tensor], collectives: Collectives, group=None) -> int:
    """Replace every tensor by its mean over the ranks of `group`, in place; returns the payload
    bytes this rank handed to the all-reduce (0 when there is nothing to average or one rank)."""
    world_size = group_size_rank_src(group)[0]
    if world_size == 1 or not tensors:
        return 0

    def mean(flat: torch.Tensor) -> None:
        flat.div_(world_size)
        collectives.all_reduce(flat, group=group)

    through_flat(tensors, mean)
    return sum(t.numel() * t.element_size() for t in tensors)
