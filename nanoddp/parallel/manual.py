"""Teaching strategies: gradient synchronisation written out by hand. Read this file first.

Data parallelism in one file, before `ddp/` (the engine) and `zero/`/`fsdp/` (sharding): every
rank holds the whole model, runs its own batch, and the ranks average their gradients so every
replica takes the same step. These strategies run *after* `loss.backward()` has finished, so
communication never overlaps compute; that is exactly the cost `nanoddp.DistributedDataParallel`
removes. They are kept small and readable on purpose, and they are correct: a ws-N run with
per-rank batch B matches a single process with batch N*B.

- `allreduce_gradients`: one all-reduce per parameter, then divide by the world size.
- `reduce_scatter_all_gather_gradients`: one flat tensor; reduce-scatter gives each rank the
  averaged sum of one shard, all-gather hands every shard to everyone (a ring all-reduce,
  spelled out as its two phases).
- `SimpleDDP`: the minimal wrapper around them: replica check, sync, no_sync.

A parameter without a gradient on some rank contributes zeros there, so every rank issues the
same collectives (skipping it on one rank only would hang the others).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.replicas import check_same_structure, group_size_rank_src
from nanoddp.parallel.tensors import write_grads

logger = logging.getLogger(__name__)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sum_to_mean(summed: torch.Tensor, world_size: int) -> None:
    """The ranks' summed gradients into their mean, in place: how both strategies average.

    [Note: after the sum] Sum first, then divide: the order a reader writes by hand. torch's
    DDP divides before the sum instead (nanoddp.parallel.ddp.gradient_average), which rounds differently
    when the world size is not a power of two; both are the mean within float rounding."""
    summed.div_(world_size)


@torch.no_grad()
def allreduce_gradients(model: nn.Module, group: Any = None, comm_backend: str = DEFAULT_COMM_BACKEND) -> None:
    """Average every parameter's gradient over the ranks of `group`, one all-reduce each."""
    collectives = collectives_for(comm_backend)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    for param in _trainable(model):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        collectives.all_reduce(param.grad, group=group)
        _sum_to_mean(param.grad, world_size)


@torch.no_grad()
def reduce_scatter_all_gather_gradients(
    model: nn.Module, group: Any = None, comm_backend: str = DEFAULT_COMM_BACKEND
) -> None:
    """Average all gradients with one reduce-scatter and one all-gather per dtype."""
    collectives = collectives_for(comm_backend)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in _trainable(model):
        by_dtype.setdefault(param.dtype, []).append(param)
    for params in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        numel = sum(g.numel() for g in grads)
        padding = (-numel) % world_size  # the flat tensor must split into ws equal shards
        flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_zeros(padding)])  # (ws*S,)
        shard = flat.new_empty(flat.numel() // world_size)  # (S,)
        collectives.reduce_scatter_tensor(shard, flat, group=group)  # shard = sum over ranks
        _sum_to_mean(shard, world_size)
        collectives.all_gather_into_tensor(flat, shard, group=group)  # every shard, everywhere
        write_grads(flat, params)


class SimpleDDP:
    """SimpleDistributedDataParallelism, the smallest honest DDP (the notebook tutorials' version).

    At construction it checks that every rank built the same model with the same values
    (seeds!). Call `sync_gradients()` after `loss.backward()`; inside `no_sync()` (or after
    `disable_grad_sync()`) it does nothing, so gradients accumulate locally.
    """

    def __init__(self, model: nn.Module, group: Any = None, comm_backend: str = DEFAULT_COMM_BACKEND):
        self.model = model
        self.group = group
        self.comm_backend = comm_backend
        self._collectives = collectives_for(comm_backend)
        self._do_sync = True
        if dist.get_world_size(group) > 1:
            check_same_structure(model, self._collectives, group)
            self._check_same_values()

    @torch.no_grad()
    def _check_same_values(self) -> None:
        """Compare each parameter with rank 0's; raise on every rank naming the first mismatch."""
        _, _, src = group_size_rank_src(self.group)
        named = list(self.model.named_parameters())
        differs = torch.zeros(len(named), dtype=torch.int32)  # (P,) 1 where ours != rank 0's
        for i, (_, param) in enumerate(named):
            reference = param.detach().clone()
            self._collectives.broadcast(reference, src=src, group=self.group)
            differs[i] = int(not torch.equal(reference, param))
        self._collectives.all_reduce(differs, group=self.group)  # (P,) ranks that differ
        bad = differs.nonzero().flatten().tolist()
        if bad:
            name, count = named[bad[0]][0], int(differs[bad[0]])
            raise ValueError(
                f"Expected model parameters to be identical on every rank at construction, but "
                f"'{name}' differs from rank 0's on {count} rank(s) ({len(bad)} parameter(s) differ). "
                "Set the same seed on every rank before building the model "
                "(nanoddp.seed_everything(seed, same_across_ranks=True))."
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def sync_gradients(self) -> None:
        """Average gradients over ranks; call after backward. A no-op while sync is disabled."""
        if self._do_sync:
            allreduce_gradients(self.model, self.group, self.comm_backend)

    @property
    def do_sync(self) -> bool:
        return self._do_sync

    def enable_grad_sync(self) -> None:
        self._do_sync = True

    def disable_grad_sync(self) -> None:
        self._do_sync = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next sync reduces their sum."""
        previous = self._do_sync
        self._do_sync = False
        try:
            yield
        finally:
            self._do_sync = previous

    def train(self, mode: bool = True) -> SimpleDDP:
        self.model.train(mode)
        return self

    def eval(self) -> SimpleDDP:
        self.model.eval()
        return self
