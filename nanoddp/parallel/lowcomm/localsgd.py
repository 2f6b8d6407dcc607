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

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND
from nanoddp.parallel.lowcomm.flat_average import average_
from nanoddp.parallel.lowcomm.periodic import PeriodicSync


class LocalSGD(PeriodicSync):
    """Wrap `optimizer` so that its parameters are averaged over ranks every `sync_every` steps.

    `state_dict()` holds the inner optimizer's and the local step count, so a resume syncs at
    the same steps as an uninterrupted run (see `PeriodicSync` for when to build and save it).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, sync_every: int, *, group=None, comm_backend: str = DEFAULT_COMM_BACKEND
    ) -> None:
        super().__init__(optimizer, sync_every, group, comm_backend)

    def _sync(self) -> int:
        return average_(self._params(), self.collectives, self.group)

    def sync_contribution(self, fragment: int = 0) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self._params()])

    @torch.no_grad()
    def take_mean(self, mean: torch.Tensor | None, fragment: int = 0, keep_local: bool = True) -> None:
        if mean is None:  # nobody trained since the last sync: the replicas hold its weights still
            return
        offset = 0
        for p in self._params():
            p.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "local_step": self.local_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.local_step = int(state_dict["local_step"])

    def __repr__(self) -> str:
        return f"LocalSGD(sync_every={self.sync_every}, {self.optimizer!r})"
