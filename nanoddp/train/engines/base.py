"""The Engine: a model plus the rule for syncing its gradients, one small object per kind.

Each kind is a subclass (`engines.ddp`, `manual`, `single`, `zero2`, `fsdp`) and answers for
itself: how it is built from a bare model (`build`), what it needs before resume (`prepare`),
what runs around one micro-step (`micro_step`), the whole model's state (`state_dict`), and how
a timeline draws its communication (`trace_comm`). Its class attributes are its registry entry
(`engines.registry`): `name`, `help`, `zero_optimizer`, `sharded`, `local_gradients`,
`option_defaults`. Nothing asks an engine its name. Two hooks finish the trainer's setup and
step record: `wrap_optimizer` (the optimizer the trainer steps) and `step_comm_bytes` (what a
step sent). Three more serve a fault-tolerant step, which averages over replica groups after the
engine's own reduction within its group: `use_cross_replica` (once, before the first backward),
`cross_replica_grads` (the buffers to sum across groups) and `finish_cross_replica`; a restart
run never calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.metrics import CommTimer

SyncFn = Callable[[nn.Module], None]


class Engine:
    """A model plus the rule for syncing its gradients.

    `model` is what the trainer calls forward on; `module` is the bare model (for saving,
    evaluation and the optimizer). `comm` times gradient communication where it can be seen.
    The base class is the model as it is, no communication (what `single` and the benchmark's
    own variants are).
    """

    name = ""
    help = ""
    zero_optimizer = False  # the optimizer must be a ZeroRedundancyOptimizer (ZeRO-1)
    # After backward each rank holds a shard of the gradients (fsdp: of the parameters too), so
    # clipping, saving and evaluation must involve every rank, and optimizer state is per rank.
    sharded = False
    # After backward each rank holds its own gradient, never averaged (the low-communication
    # engines): an fp16 overflow verdict must be agreed over ranks, and clipping is per rank.
    local_gradients = False
    # TrainConfig fields this engine reads, with their defaults (filled where left at None);
    # such a field set for an engine that does not list it is refused (`config.validate_loop`).
    option_defaults: dict[str, float | str] = {}

    def __init__(self, name: str, model: nn.Module, module: nn.Module, comm: CommTimer | None = None):
        self.name = name  # the class's for a registry engine; a benchmark's variant names itself
        self.model = model
        self.module = module
        self.comm = comm

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        """Wrap `module` (already on `env.device`, prepared by `prepare`) for this engine."""
        return cls(cls.name, module, module)

    @classmethod
    def prepare(cls, module: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, config: Any) -> None:
        """The trainer's step before resume: refuse a model sharded for another engine (each
        rank's pieces would pass for the whole model)."""
        from nanoddp.parallel.detect import sharded_by

        kind = sharded_by(module)
        if kind is not None and kind != cls.name:
            raise ValueError(
                f"the model is already sharded ({kind}): engine {cls.name!r} would treat each rank's pieces "
                f"as the whole model; use engine={kind!r} (--engine {kind}), or pass the model unsharded"
            )

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, config: Any) -> torch.optim.Optimizer:
        """The optimizer the trainer steps, built once the engine is (the low-communication
        engines wrap it in their periodic sync); here: `optimizer` itself."""
        return optimizer

    def step_comm_bytes(self, counted: int) -> int:
        """Bytes this rank sent in one training step's collectives, given `counted`: what
        nanoddp's transport counted over the step (`comm.transport.transport.sent_bytes`). Here: that
        count; an engine whose traffic bypasses our transport models its own (torch's DDP)."""
        return counted

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients by their global norm: `nanoddp.clip_grad_norm_`, which
        takes each kind of gradient's part of the norm (replicated as is, fsdp's DTensors over
        the mesh, zero2's pieces over the group; collective for the sharded engines). With
        `local_gradients` the gradients are this rank's own, so each rank clips by its own norm."""
        from nanoddp.parallel.clip import clip_grad_norm_

        return clip_grad_norm_(self.module, max_norm)

    def use_cross_replica(self) -> None:
        """From the next backward on, leave the gradients in the form `cross_replica_grads` hands
        out (DDP: reduce-scattered shards only). Here: they are already."""

    def cross_replica_grads(self) -> list[torch.Tensor]:
        """After backward: the gradient buffers, already averaged within this engine's group, that a
        fault-tolerant step sums across replica groups, as 1-D views: changed in place, they are the
        gradients (after `finish_cross_replica`). Each rank of a group holds different ones (a shard
        each, for the sharded engines); the same rank of every group holds the same shapes. Here:
        every parameter's whole gradient."""
        return [p.grad.view(-1) for p in self.module.parameters() if p.grad is not None]

    def finish_cross_replica(self) -> None:
        """The cross-group sum is in `cross_replica_grads()`'s buffers: make the gradients whole
        again where the engine split them (DDP: a gather within the group). Here: nothing to do."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's plain state_dict (collective for sharded engines: call on every rank)."""
        return self.module.state_dict()

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """Run one forward+backward inside this; gradients are averaged over ranks iff `sync`.

        A wrapper that syncs inside backward skips it under its `no_sync()` on the non-final
        micro-steps; `after_backward` then runs on the final one.
        """
        no_sync = getattr(self.model, "no_sync", None)
        with no_sync() if (not sync and no_sync is not None) else contextlib.nullcontext():
            yield
        if sync:
            self.after_backward()

    def after_backward(self) -> None:
        """The final micro-step's backward is done (the manual engines sync here)."""

    def weights_replaced(self) -> None:
        """Some rank's weights may have been replaced in place (a fault-tolerant heal puts a peer's
        state into a joiner's tensors, `nanoddp.ft.live_state`): re-derive what the engine keeps
        from them. Called on every rank of the group alike, so that a collective it implies runs
        everywhere. Here: nothing is derived."""

    def end_step(self) -> None:
        """The optimizer step is done: close the step's communication window."""
        if self.comm is not None:
            self.comm.close_step()

    def trace_comm(
        self, env: DistEnv, wrap_hook: Callable[[Callable], Callable], wrap_sync: Callable[[SyncFn], SyncFn]
    ) -> None:
        """Have a timeline draw this engine's gradient communication (`train.trace`): DDP comm
        hooks through `wrap_hook`, an after-backward sync through `wrap_sync`. Here: none to draw."""


def device_ids_for(env: DistEnv) -> list[int] | None:
    """DDP's `device_ids`: this rank's GPU, or None on CPU."""
    return [env.device.index] if env.device.type == "cuda" else None
