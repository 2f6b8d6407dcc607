"""The `single` engine: one process, the model as it is, no communication."""

from __future__ import annotations

import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine


class SingleEngine(Engine):
    """One process: nothing to sync (the baseline every other engine is compared with)."""

    name = "single"
    help = "one process, no communication"

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        if env.world_size != 1:
            raise ValueError(
                f"engine 'single' runs one process, but the world size is {env.world_size}; "
                "use --nproc 1 or another engine"
            )
        return cls(cls.name, module, module)
