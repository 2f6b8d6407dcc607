"""LocalSGD: every rank steps its own optimizer H times, then the parameters are averaged.

Why: a DDP step all-reduces every gradient, so over a slow link (two sites, 1 Gbit/s) the step
waits on the network. Here the ranks train apart for `sync_every` steps on their own batches
and meet only to average their weights: 1/H of the traffic, at the price of replicas that drift
apart between syncs. torch ships the same idea as post-local SGD
(`PostLocalSGDOptimizer` over a `PeriodicModelAverager`); this wrapper has its surface.

Use it in place of DDP, around your optimizer, with the model NOT wrapped in DDP (gradients stay
local):

    optimizer = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8)
    for x, y in batches:            # each rank its own shard of the data
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

The replicas start equal (rank 0's weights are broadcast at construction) and are equal again
after every sync step. torch's `PeriodicModelAverager(period=H, warmup_steps=H - 1)` averages at
the same steps (after the H-th, 2H-th, ...), which is how the tests compare the two.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.lowcomm.average import average_
from nanoddp.parallel.replicas import broadcast_rank0_weights


class LocalSGD(torch.optim.Optimizer):
    """Wrap `optimizer` so that its parameters are averaged over ranks every `sync_every` steps.

    An `Optimizer` for LR schedulers and `save_state`: it shares `param_groups` and `state` with
    the optimizer it wraps. `state_dict()` holds the inner optimizer's and the local step count,
    so a resume syncs at the same steps as an uninterrupted run.

    Build it before loading a checkpoint into the model: construction broadcasts rank 0's
    weights, and between syncs each rank's weights are its own. `state_dict()` is this rank's
    (the inner optimizer's state differs per rank): save it per rank for an exact resume.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        group=None,
        comm_backend: str = DEFAULT_COMM_BACKEND,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LocalSGD wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if int(sync_every) < 1:
            raise ValueError(f"sync_every must be >= 1 (steps between parameter averages), got {sync_every}")
        self.optimizer = optimizer
        self.sync_every = int(sync_every)
        self.group = group
        self.collectives = collectives_for(comm_backend)
        self.local_step = 0
        self.last_sync_bytes = 0  # what the last step() sent (0 between syncs): for metrics
        # [Note: no super().__init__] The wrapper has no parameters of its own: it reads and
        # writes the inner optimizer's groups and state, as torch's PostLocalSGDOptimizer does.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        broadcast_rank0_weights(self._params(), self.collectives, group)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The inner optimizer's step on this rank's gradients, then, on a sync step, the average."""
        loss = self.optimizer.step(closure)
        self.local_step += 1
        self.last_sync_bytes = 0
        if self.local_step % self.sync_every == 0:
            self.last_sync_bytes = average_(self._params(), self.collectives, self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "local_step": self.local_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.local_step = int(state_dict["local_step"])

    def __repr__(self) -> str:
        return f"LocalSGD(sync_every={self.sync_every}, {self.optimizer!r})"
