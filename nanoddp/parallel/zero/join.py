"""Uneven inputs for nanoddp's ZeroRedundancyOptimizer: torch's `Join` protocol.

Every `step()` ends with collectives (the shards' all-gather or broadcasts), so a rank that has
run out of batches would leave the others' next step waiting. Under
`with Join([ddp_model, zero_optimizer]):` a joined rank instead runs, for every iteration the
others still run, its DDP join hook (shadowing the gradient all-reduces) and then this one,
which shadows the optimizer step by *taking* one, exactly as torch's `_ZeROJoinHook` does: its
own shard is updated from whatever `.grad` it still holds (torch DDP's join hook, and nanoddp's,
leave a joined rank's `.grad` as its last backward left it), and it sends that shard to the
others as every step does. `Join.notify_join_context` in `step()` is a no-op unless the
optimizer is the first joinable of the context (then it announces this rank still trains).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Joinable, JoinHook


class ZeroJoinHook(JoinHook):
    """A joined rank's share of one iteration: the same step(), hence the same collectives."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()


class JoinableZero(Joinable):
    """The Joinable half of ZeroRedundancyOptimizer (which owns `param_groups` and `_group`)."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> Any:
        return self._group if self._group is not None else dist.group.WORLD
