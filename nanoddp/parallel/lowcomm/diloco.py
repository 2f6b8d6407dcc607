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

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.lowcomm.average import average_
from nanoddp.parallel.replicas import broadcast_rank0_weights

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class DiLoCo(torch.optim.Optimizer):
    """Wrap the inner `optimizer`; every `sync_every` steps apply the outer step (module doc).

    An `Optimizer` for LR schedulers (they drive the inner learning rate) and `save_state`.

    Build it before loading a checkpoint into the model: construction broadcasts rank 0's
    weights, and between syncs each rank's weights are its own. `state_dict()` is this rank's
    (the inner optimizer's state differs per rank): save it per rank for an exact resume.
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
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if int(sync_every) < 1:
            raise ValueError(f"sync_every must be >= 1 (inner steps between outer steps), got {sync_every}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        self.optimizer = optimizer
        self.sync_every = int(sync_every)
        self.group = group
        self.collectives = collectives_for(comm_backend)
        self.local_step = 0
        self.last_sync_bytes = 0  # what the last step() sent (0 between syncs): for metrics
        # [Note: no super().__init__] as LocalSGD: the inner optimizer's groups and state.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        params = self._params()
        broadcast_rank0_weights(params, self.collectives, group)
        # The outer optimizer steps a copy of the weights as they were at the last sync.
        self.last_sync = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(
            self.last_sync, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One inner step; every `sync_every`-th also the outer step (all ranks together)."""
        loss = self.optimizer.step(closure)
        self.local_step += 1
        self.last_sync_bytes = 0
        if self.local_step % self.sync_every == 0:
            self.last_sync_bytes = self._outer_step()
        return loss

    @torch.no_grad()
    def _outer_step(self) -> int:
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

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
