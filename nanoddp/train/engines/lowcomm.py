"""The low-communication engines, `localsgd` and `diloco`: no gradient sync at all; the optimizer
syncs the replicas every `sync_every` steps.

The model is not wrapped: backward leaves each rank its own gradient, and the trainer's optimizer
is wrapped by `nanoddp.LocalSGD` or `nanoddp.DiLoCo` (`wrap_optimizer`), whose `step()` runs the
inner optimizer on this rank and, every `sync_every`-th step, brings the replicas together (an
average of the weights, or DiLoCo's outer step on the averaged pseudo-gradients). So between
syncs the ranks hold different weights and different inner optimizer states: snapshots save
both per rank (`checkpoint.user_state` recognises the wrapper and the model it steps), and
`model.pt` is the mean of the replicas (`state_dict`). What each rank does with its own
gradient before the step (clipping, fp16 overflow checks) sees this rank's gradient alone:
clipping is per rank, the overflow verdict is agreed over ranks (`local_gradients`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.parallel.lowcomm.diloco import OUTER_LR, OUTER_MOMENTUM, DiLoCo
from nanoddp.parallel.lowcomm.localsgd import LocalSGD
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.train.engines.base import Engine

SYNC_EVERY = 50  # steps between syncs unless --sync-every says otherwise


class PeriodicSyncEngine(Engine):
    """The bare model; the optimizer the trainer steps is a `PeriodicSync` around its own."""

    local_gradients = True
    wrapper_class: type[PeriodicSync] = PeriodicSync  # the wrapper this engine builds

    def __init__(self, name: str, model: nn.Module, module: nn.Module):
        super().__init__(name, model, module)
        self.wrapper: PeriodicSync | None = None  # set by wrap_optimizer

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        """The model as it is: the wrapper broadcasts rank 0's weights when it is built."""
        return cls(cls.name, module, module)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, config: Any) -> torch.optim.Optimizer:
        """`optimizer` inside this engine's wrapper (collective: the wrapper broadcasts rank 0's
        weights). A wrapper the user built is used as is when it is the one the run's options
        describe (config.json and every snapshot's fingerprint record those), else refused."""
        if isinstance(optimizer, PeriodicSync):
            self._check_given(optimizer, config)
            self.wrapper = optimizer
        else:
            self.wrapper = self._wrap(optimizer, config)
        return self.wrapper

    def use_cross_replica(self) -> None:
        """`--on-failure continue`: the wrapper's step is the inner step alone; the syncs are the
        fault-tolerant loop's (`nanoddp.ft.rounds`), over the replicas present at each."""
        assert self.wrapper is not None, "wrap_optimizer first"
        self.wrapper.held = True

    def _check_given(self, wrapper: PeriodicSync, config: Any) -> None:
        wanted = {name: getattr(config, name) for name in self.option_defaults}
        kind = self.wrapper_class.__name__
        given = self._settings(wrapper) if isinstance(wrapper, self.wrapper_class) else None
        if given != wanted:
            raise ValueError(
                f"engine {self.name!r} steps a {kind} with the run's options {wanted}, got {wrapper!r}: "
                f"pass a {kind} built with those, or set the options to the wrapper's"
            )

    def _wrap(self, optimizer: torch.optim.Optimizer, config: Any) -> PeriodicSync:
        raise NotImplementedError

    def _settings(self, wrapper: Any) -> dict[str, Any]:
        """The options `wrapper` was built with, by their TrainConfig names."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas' mean (collective): right after a whole-model sync that keeps nothing
        local they are equal and this is the model as it is; otherwise each floating-point
        tensor is averaged over ranks, the weights a LocalSGD sync at this step would give."""
        from nanoddp.parallel.lowcomm.flat_average import average_

        state = self.module.state_dict()
        wrapper = self.wrapper
        if wrapper is None or wrapper.replicas_equal():
            return state
        state = {key: value.detach().clone() for key, value in state.items()}
        average_([v for v in state.values() if v.is_floating_point()], wrapper.collectives, wrapper.group)
        return state


class LocalSGDEngine(PeriodicSyncEngine):
    name = "localsgd"
    help = "LocalSGD: weights averaged every --sync-every steps"
    option_defaults = {"sync_every": SYNC_EVERY}
    wrapper_class = LocalSGD

    def _wrap(self, optimizer: torch.optim.Optimizer, config: Any) -> PeriodicSync:
        return LocalSGD(optimizer, sync_every=config.sync_every)

    def _settings(self, wrapper: Any) -> dict[str, Any]:
        return {"sync_every": wrapper.sync_every}


class DiLoCoEngine(PeriodicSyncEngine):
    name = "diloco"
    help = "DiLoCo: outer Nesterov step every --sync-every steps (Streaming: --fragments, --sync-delay)"
    option_defaults = {
        "sync_every": SYNC_EVERY,
        "outer_lr": OUTER_LR,
        "outer_momentum": OUTER_MOMENTUM,
        "fragments": 1,
        "sync_delay": 0,
        "mix": 0.0,
        "pseudo_grad_dtype": "fp32",
    }
    wrapper_class = DiLoCo

    def _wrap(self, optimizer: torch.optim.Optimizer, config: Any) -> PeriodicSync:
        return DiLoCo(
            optimizer,
            sync_every=config.sync_every,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            fragments=config.fragments,
            sync_delay=config.sync_delay,
            mix=config.mix,
            compress=config.pseudo_grad_dtype,
        )

    def step_comm_bytes(self, counted: int) -> int:
        """With --sync-delay 0 a sync runs inside its step: what the transport counted. With a
        delay a fragment's collective runs in the background, also between steps, where the
        step's count misses it: its own measured bytes instead, in the record of the step that
        used the mean (`pseudo_grad_mean`'s Note: wire bytes of a background collective)."""
        wrapper = self.wrapper
        if isinstance(wrapper, DiLoCo) and wrapper.sync_delay > 0:
            return wrapper.last_finished_wire_bytes
        return counted

    def _settings(self, wrapper: Any) -> dict[str, Any]:
        outer = wrapper.outer.defaults
        return {
            "sync_every": wrapper.sync_every,
            "outer_lr": outer.get("lr"),
            "outer_momentum": outer.get("momentum"),
            "fragments": len(wrapper.fragments),
            "sync_delay": wrapper.sync_delay,
            "mix": wrapper.mix,
            "pseudo_grad_dtype": wrapper.compress,
        }
