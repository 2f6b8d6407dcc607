"""The `zero2` engine: ZeRO-2 hooks on the model (`nanoddp.parallel.zero.stage2`).

The parameter objects stay (their data becomes this rank's 1-D piece of one flat buffer), so
an optimizer built before the engine keeps working; gradients are reduce-scattered in buckets
into this rank's shard during backward. Each rank then holds a shard of the gradients and of
the optimizer state: clipping, saving and evaluation involve every rank (`sharded`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine


class Zero2Engine(Engine):
    """ZeRO-2 installed on the bare model; a model the user gave it to already is used as is."""

    name = "zero2"
    help = "ZeRO-2: grads, optimizer state sharded"
    sharded = True

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        from nanoddp.parallel.replicas import broadcast_rank0_weights
        from nanoddp.parallel.zero.stage2 import Zero2Module, zero2

        if isinstance(module, Zero2Module):  # installed by the user: used as is
            return cls(cls.name, module, module)
        broadcast_rank0_weights(module)
        return cls(cls.name, zero2(module), module)

    def weights_replaced(self) -> None:
        """The whole parameters each rank gathered may no longer be its pieces' (a heal put new
        pieces on some ranks only, or the same values, which still mark them changed): every rank
        gathers again at its next forward, so that all of them do."""
        from nanoddp.parallel.zero.stage2 import Zero2Module

        assert isinstance(self.module, Zero2Module)
        for unit in self.module._zero2_units:
            unit.wait_gather()
            unit.gathered = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors gathered from every rank's pieces (collective: call on every rank)."""
        from nanoddp.parallel.zero.sharded_module import ShardedModule

        assert isinstance(self.module, ShardedModule)  # zero2 gave the module its methods
        return self.module.full_state_dict()
