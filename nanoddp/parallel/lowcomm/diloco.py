"""DiLoCo: H inner steps apart, then one outer step on the averaged pseudo-gradient.

Why: LocalSGD's plain average throws away what the ranks learned about the direction of travel.
DiLoCo (Douillard et al., 2023, "Distributed Low-Communication Training of Language Models")
treats the distance each rank moved since the last sync as a gradient: every rank runs its inner
optimizer (AdamW) for `sync_every` steps, then

    pseudo_grad = weights at the last sync - weights now        (per rank)
    pseudo_grad = mean over ranks                               (one all-reduce)
    global -= outer SGD step(pseudo_grad)   (Nesterov momentum)  (same on every rank)
    weights = global                                             (replicas equal again)

The paper's outer optimizer, and the defaults here: SGD, lr 0.7, momentum 0.9, Nesterov. With
outer lr 1 and no momentum the outer step is LocalSGD's average; the momentum is what lets it
match synchronous training while communicating hundreds of times less.

Use it around the inner optimizer, on a model NOT wrapped in DDP:

    optimizer = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-4), sync_every=100)

The weights at the last sync (one fp32 copy of the trainable parameters: the memory DiLoCo
costs) and the outer optimizer's momentum are in `state_dict()`, with the inner state and the
step count, so a resume is exact.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND
from nanoddp.parallel.lowcomm.flat_average import average_
from nanoddp.parallel.lowcomm.periodic import PeriodicSync

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class DiLoCo(PeriodicSync):
    """Wrap the inner `optimizer`; every `sync_every` steps apply the outer step (module doc).

    See `PeriodicSync` for when to build it and how to save it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        nesterov: bool = True,
        group=None,
        comm_backend: str = DEFAULT_COMM_BACKEND,
    ) -> None:
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        super().__init__(optimizer, sync_every, group, comm_backend)
        # The outer optimizer steps a copy of the weights as they were at the last sync.
        self.last_sync = [p.detach().clone() for p in self._params()]
        self.outer = torch.optim.SGD(
            self.last_sync, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )

    @torch.no_grad()
    def _sync(self) -> int:
        params = self._params()
        pseudo_grads = [synced - p for p, synced in zip(params, self.last_sync, strict=True)]  # how far each moved
        sent = average_(pseudo_grads, self.collectives, self.group)
        for synced, grad in zip(self.last_sync, pseudo_grads, strict=True):
            synced.grad = grad
        self.outer.step()
        for p, synced in zip(params, self.last_sync, strict=True):
            p.copy_(synced)
            synced.grad = None
        return sent

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "outer": self.outer.state_dict(),
            "last_sync": [s.detach().clone() for s in self.last_sync],
            "local_step": self.local_step,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["last_sync"]
        if len(saved) != len(self.last_sync):
            raise ValueError(
                f"DiLoCo state holds {len(saved)} last-sync tensors, this model has {len(self.last_sync)} "
                "trainable parameters: load it into the model it was saved from"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.outer.load_state_dict(state_dict["outer"])
        for mine, theirs in zip(self.last_sync, saved, strict=True):
            mine.copy_(theirs)
        self.local_step = int(state_dict["local_step"])

    def __repr__(self) -> str:
        return f"DiLoCo(sync_every={self.sync_every}, outer={self.outer!r}, inner={self.optimizer!r})"
