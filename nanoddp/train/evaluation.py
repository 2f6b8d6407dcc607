"""Validation loss over every rank's shard of the eval set: the global mean, whatever the split.

Ranks may hold unequal shards (the set's length need not divide by the world size), so each rank
sums loss x count over its own samples and the sums are all-reduced: the result is the mean over
all samples, equal to one process evaluating the whole set. A sharded engine's forward is a
collective (it all-gathers its units), so every rank runs as many forwards as the rank with the
most batches, filling the rest with a throwaway batch. `group` splits the set over another group
than the default one (a fault-tolerant run's replicas, each of which is a default group of its own).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset

from nanoddp.env import DistEnv
from nanoddp.parallel.tensors import move_to
from nanoddp.train.data.batch_rules import batch_len
from nanoddp.train.ranks import all_reduce_sum


@torch.no_grad()
def mean_loss(
    module: nn.Module,
    dataset: Dataset,
    env: DistEnv,
    *,
    batch_size: int,
    batch_loss: Callable[[nn.Module, Any], torch.Tensor],
    collate_fn: Callable[[list[Any]], Any],
    autocast: Callable[[], Any],
    sharded: bool,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The mean of `batch_loss` over `dataset` (a collective; call it on every rank alike, of
    `group` when given)."""
    length = len(dataset)  # type: ignore[arg-type]
    rank, world_size = (env.rank, env.world_size) if group is None else (group.rank(), group.size())
    shard = Subset(dataset, range(rank, length, world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # (loss sum, count)
    module.eval()
    forwards = 0
    for batch in DataLoader(shard, batch_size=batch_size, collate_fn=collate_fn):
        batch, count = move_to(batch, env.device), batch_len(batch)
        with autocast():
            loss = batch_loss(module, batch)  # the bare model: no DDP collectives
        totals += torch.tensor([loss.item() * count, count], dtype=torch.float64, device=totals.device)
        forwards += 1
    if sharded:  # every forward all-gathers: each rank must run as many as the most
        most = math.ceil(math.ceil(length / world_size) / batch_size)
        filler = move_to(collate_fn([dataset[0]]), env.device)
        for _ in range(most - forwards):
            batch_loss(module, filler)  # result unused
    module.train()
    if group is None:
        all_reduce_sum(totals)
    else:
        from nanoddp.comm.api.collectives import all_reduce

        all_reduce(totals, group=group)
    return (totals[0] / totals[1].clamp(min=1)).item()
