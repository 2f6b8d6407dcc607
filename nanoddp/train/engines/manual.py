"""The manual engines (`allreduce`, `rs_ag`): no wrapper, one sync call after backward.

The sync functions are `nanoddp.parallel.manual`'s (the learner's first file): one all-reduce
per parameter, or one flat reduce-scatter then all-gather. Gradient accumulation needs nothing:
the sync simply runs on the final micro-step only, after backward, so all of it is exposed.
"""

from __future__ import annotations

import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine, SyncFn
from nanoddp.train.metrics import CommTimer


class ManualEngine(Engine):
    """The bare model, and `nanoddp.parallel.manual.<sync_function>` after the final backward."""

    sync_function = ""  # the name in nanoddp.parallel.manual

    def __init__(self, name: str, model: nn.Module, module: nn.Module, sync: SyncFn, comm: CommTimer | None = None):
        super().__init__(name, model, module, comm)
        self.sync = sync

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        from nanoddp.parallel import manual
        from nanoddp.parallel.replicas import broadcast_rank0_weights

        broadcast_rank0_weights(module)  # DDP does this itself; a bare model does not
        return cls(cls.name, module, module, getattr(manual, cls.sync_function), comm=CommTimer())

    def after_backward(self) -> None:
        if self.comm is not None:
            self.comm.compute_done()  # the sync starts after backward: all of it is exposed
            self.comm.launched()
        self.sync(self.module)
        if self.comm is not None:
            self.comm.finished()

    def trace_comm(self, env, wrap_hook, wrap_sync) -> None:
        self.sync = wrap_sync(self.sync)


class AllReduceEngine(ManualEngine):
    name = "allreduce"
    help = "all-reduce per parameter after backward"
    sync_function = "allreduce_gradients"


class ReduceScatterAllGatherEngine(ManualEngine):
    name = "rs_ag"
    help = "reduce-scatter, all-gather after backward"
    sync_function = "reduce_scatter_all_gather_gradients"
