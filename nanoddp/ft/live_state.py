"""Live state transfer: what a joiner receives from a peer, and how it is taken and put back.

A joiner (a replacement, or a replica that fell behind) gets everything that makes the next step
equal on every replica: the weights, the optimizer's state, the step (which is also the data
position: `GlobalBatches` is a function of the step), the world size each committed step had,
and every RNG the step may draw from. torchft's Manager asks a replica that is up to date for
this dictionary and sends it to the joiner over the rebuilt group itself (its `PGTransport` on
`RebuiltWorld`): no file is written or read. The source packs its tensors into one flat tensor
per dtype at the step boundary (`packed_state`), so the transfer is a few sends, not one per
tensor; the Manager holds the optimizer back (`should_commit`) until the transfer is over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nanoddp.base.rng import capture_rng_state, restore_rng_state
from nanoddp.ft.packed_state import pack, unpack


class LiveState:
    """The state dict functions torchft's Manager calls: `take` on a source, `put` on a joiner."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        history: list[int],
        extra: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        optimizer_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        model_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        # how the optimizer's state is taken and put: whole by default; a sharded optimizer's
        # (`OptimizerShards`) sends no state, its share comes in the re-partition
        self.optimizer_state = optimizer_state or (optimizer.state_dict, optimizer.load_state_dict)
        # and the model's: whole by default; parameters sharded too (stage 3) send the buffers only
        self.model_state = model_state or (model.state_dict, model.load_state_dict)
        self.history = history  # world size of each committed step, shared with the step loop
        self.extra = extra
        # whether this replica holds the run's committed state (False: a joiner before it healed);
        # travels with the state, so a replica healed from a source that held none holds none
        self.holds_state = True

    def take(self) -> dict[str, Any]:
        """This replica's state at the step boundary, its tensors packed (`packed_state.pack`)."""
        state: dict[str, Any] = {
            "model": self.model_state[0](),
            "optimizer": self.optimizer_state[0](),
            "history": list(self.history),
            "holds_state": self.holds_state,
            "rng": capture_rng_state(),  # the same generators a snapshot holds, numpy included
        }
        if self.extra is not None:
            state["extra"] = self.extra[0]()
        return pack(state)

    def put(self, packed: dict[str, Any]) -> None:
        """Become the source replica: load what `take` gave there."""
        state = unpack(packed)
        self.model_state[1](state["model"])
        self.optimizer_state[1](state["optimizer"])
        self.history[:] = state["history"]
        self.holds_state = bool(state["holds_state"])
        restore_rng_state(state["rng"])
        if self.extra is not None:
            self.extra[1](state["extra"])
