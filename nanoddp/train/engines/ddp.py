"""The DDP engines: `nanoddp` (our DDP), `torch` (torch's), `zero1` (ours plus a sharded optimizer).

Gradients are averaged inside backward, bucket by bucket, by the wrapper's hooks; on the
non-final micro-steps of an accumulation `no_sync()` skips that (`Engine.micro_step`). Under a
fault-tolerant step (`use_cross_replica`) a bucket is only reduce-scattered in backward; its
shards are summed across replica groups, then gathered back (`comm_hooks.reduce_scatter_hook`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine, device_ids_for
from nanoddp.train.metrics import CommTimer, timed_comm_hook

if TYPE_CHECKING:
    from nanoddp.parallel.ddp.comm_hooks import CrossReplicaShards
    from nanoddp.parallel.ddp.wrapper import DistributedDataParallel


class DDPEngine(Engine):
    """A DDP wrapper (ours or torch's: the same comm-hook contract) around the bare model."""

    cross_shards: CrossReplicaShards | None = None  # set by `use_cross_replica`

    def use_cross_replica(self) -> None:
        """Reduce-scatter each bucket in backward instead of all-reducing it (one process:
        nothing is reduced in backward, and the gradients are the buffers as they are)."""
        from nanoddp.parallel.ddp.comm_hooks import CrossReplicaShards, reduce_scatter_hook

        self.cross_shards = CrossReplicaShards()
        if dist.get_world_size() > 1:
            cast(Any, self.model).register_comm_hook(self.cross_shards, reduce_scatter_hook)

    def cross_replica_grads(self) -> list[torch.Tensor]:
        """Each bucket's averaged shard, this rank's, in bucket order."""
        if self.cross_shards is None:
            raise RuntimeError("cross_replica_grads() before use_cross_replica(): DDP all-reduced the buckets already")
        if dist.get_world_size() == 1:
            return super().cross_replica_grads()
        return [self.cross_shards.shards[i] for i in sorted(self.cross_shards.shards)]

    def finish_cross_replica(self) -> None:
        """Gather every bucket's summed shards within the group into `.grad`."""
        if self.cross_shards is not None and dist.get_world_size() > 1:
            self.cross_shards.finish()

    def end_step(self) -> None:
        """The step is over, committed or not: its shards go (`CrossReplicaShards.clear`)."""
        super().end_step()
        if self.cross_shards is not None:
            self.cross_shards.clear()

    def trace_comm(self, env, wrap_hook, wrap_sync) -> None:
        """Reduce through `hooks.allreduce_hook` (the default path's math), drawn and timed."""
        from nanoddp.parallel.ddp.comm_hooks import allreduce_hook

        self.comm = CommTimer()
        ddp = cast(Any, self.model)  # ours or torch's: both take a (state, bucket) -> Future hook
        ddp.register_comm_hook(None, timed_comm_hook(wrap_hook(allreduce_hook), self.comm))


class TorchDDPEngine(DDPEngine):
    """torch's DDP exactly as users construct it: no comm hook, so its C++ reducer runs its own
    all-reduce path. Nothing here times it (`comm=None`); `nanoddp bench train` times every
    engine from outside (gradient hooks on the parameters and backward()'s return)."""

    name = "torch"
    help = "torch's DDP (its C++ reducer)"
    ring_bytes = 0  # what a step's gradient all-reduce sends, modelled (`build`)

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        engine = cls(cls.name, TorchDDP(module, device_ids=device_ids_for(env)), module)
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        engine.ring_bytes = ring_all_reduce_bytes(grad_bytes, env.world_size)
        return engine

    def step_comm_bytes(self, counted: int) -> int:
        """Modelled, not counted: torch's reducer sends through gloo's own all-reduce, which our
        transport never sees; a ring all-reduce of the gradient buckets sends `ring_bytes`."""
        return counted + self.ring_bytes


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """What one rank sends in a ring all-reduce of `nbytes`: a reduce-scatter and an all-gather,
    each (ws - 1) chunks of nbytes / ws (no headers: torch's gloo frames its own)."""
    return 2 * (world_size - 1) * nbytes // world_size


class NanoddpEngine(DDPEngine):
    """Our DDP, timed by its own timeline: a few timestamps per step give the comm window and
    the end of backward's compute for the log line."""

    name = "nanoddp"
    help = "our DDP: bucketed all-reduce in backward"

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        from nanoddp.parallel.ddp.wrapper import DistributedDataParallel

        model = DistributedDataParallel(module, device_ids=device_ids_for(env))
        model.record_timeline = True
        return cls(cls.name, model, module, comm=CommTimer())

    def after_backward(self) -> None:
        ddp = cast("DistributedDataParallel", self.model)
        if self.comm is not None and ddp.record_timeline:
            self.comm.add_timeline(ddp.last_timeline)

    def trace_comm(self, env, wrap_hook, wrap_sync) -> None:
        if env.world_size > 1:  # one process: no bucket is reduced, the timeline times it
            super().trace_comm(env, wrap_hook, wrap_sync)


class Zero1Engine(NanoddpEngine):
    """ZeRO-1: our DDP as is; the trainer gives it a ZeroRedundancyOptimizer (`zero_optimizer`)."""

    name = "zero1"
    help = "ZeRO-1: nanoddp + optimizer state sharded"
    zero_optimizer = True
