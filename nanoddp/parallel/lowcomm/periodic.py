"""What LocalSGD and DiLoCo share: an optimizer wrapper that syncs every `sync_every` steps.

Each rank steps the inner optimizer on its own gradients; every `sync_every`-th step also runs
the subclass's `_sync()` (all ranks together: a collective). The wrapper is a
`torch.optim.Optimizer` so that LR schedulers and `save_state` take it, but it has no parameters
of its own: it shares `param_groups` and `state` with the inner optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, collectives_for
from nanoddp.parallel.replicas import broadcast_rank0_weights, group_size_rank_src


class PeriodicSync(torch.optim.Optimizer):
    """The inner optimizer's step on this rank, then every `sync_every` steps `_sync()`.

    Build it before loading a checkpoint into the model: construction broadcasts rank 0's
    weights, and between syncs each rank's weights are its own. `state_dict()` is this rank's
    (the inner optimizer's state differs per rank): save it per rank for an exact resume.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, sync_every: int, group=None, comm_backend: str = DEFAULT_COMM_BACKEND
    ):
        self.check_wrapped(optimizer, sync_every)
        self.optimizer = optimizer
        self.sync_every = int(sync_every)
        self.group = group
        self.collectives = collectives_for(comm_backend)
        self.local_step = 0
        # Set by `--on-failure continue` (`nanoddp.ft.rounds`): `step()` is the inner step alone, and the
        # caller averages `sync_contribution()` over the replicas present and hands it to `take_mean`.
        self.held = False
        self.last_sync_bytes = 0  # what the last step() sent (0 between syncs): for metrics
        # [Note: no super().__init__] The wrapper has no parameters of its own: it reads and
        # writes the inner optimizer's groups and state, as torch's PostLocalSGDOptimizer does.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        if group_size_rank_src(group)[0] > 1:  # one rank alone has nothing to sync
            broadcast_rank0_weights(self._params(), self.collectives, group)

    @classmethod
    def check_wrapped(cls, optimizer: Any, sync_every: int) -> None:
        """The one error for what every wrapper takes (a subclass checks these before its own)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{cls.__name__} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if int(sync_every) < 1:
            raise ValueError(f"sync_every must be >= 1 (steps between syncs), got {sync_every}")

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _sync(self) -> int:
        """Bring the replicas together (collective); returns the bytes this rank sent."""
        raise NotImplementedError

    # -- held (`--on-failure continue`): the caller runs the syncs, one fragment at a time --
    sync_delay = 0  # inner steps a sync runs behind them (DiLoCo's `sync_delay`)

    def fragment_count(self) -> int:
        """The parts of the model that sync separately (DiLoCo's `fragments`; here the whole model)."""
        return 1

    def sync_contribution(self, fragment: int = 0) -> torch.Tensor:
        """What this rank brings to `fragment`'s sync, as one new flat fp32 tensor (nothing is changed)."""
        raise NotImplementedError

    def take_mean(self, mean: torch.Tensor | None, fragment: int = 0, keep_local: bool = True) -> None:
        """Finish `fragment`'s sync with `mean`, the replicas' mean of `sync_contribution(fragment)`
        (None: no replica trained since its last sync). `keep_local=False`: the replicas end equal
        (DiLoCo's `mix` not applied)."""
        raise NotImplementedError

    def forget_local_progress(self) -> None:
        """A joiner that took a peer's state: drop the progress not synced yet (DiLoCo: back to the
        last-synced weights), so that its next contributions are its own steps alone. LocalSGD's
        contribution is the weights themselves, which the next sync replaces: nothing to drop."""

    def _after_step(self) -> int:
        """Run after each inner step (all ranks together); returns the bytes this rank sent.
        Here: every `sync_every`-th step `_sync()`. DiLoCo's fragments sync on a finer schedule."""
        return self._sync() if self.local_step % self.sync_every == 0 else 0

    def replicas_equal(self) -> bool:
        """Whether every rank holds the same weights now (right after a whole-model sync)."""
        return self.local_step % self.sync_every == 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The inner optimizer's step, then `_after_step()` (every `sync_every`-th: a sync)."""
        loss = self.optimizer.step(closure)
        self.local_step += 1
        self.last_sync_bytes = 0 if self.held else self._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
