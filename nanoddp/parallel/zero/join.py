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

The shadow step does not announce anything (`optimizer.shadowing`): it is the joined rank's,
and the context's loop has already all-reduced its "joined" for this iteration. torch's hook
lets its step announce, so with ZeRO the first joinable (`Join([optimizer])`, a model without
DDP) a joined rank adds an all-reduce the others never issue and torch's job hangs (checked,
torch 2.13); here that order works too.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms import JoinHook


class ZeroJoinHook(JoinHook):
    """A joined rank's share of one iteration: the same step(), hence the same collectives."""

    def __init__(self, optimizer: Any):  # a ZeroRedundancyOptimizer (which builds this hook)
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.shadowing = True  # step() then leaves the Join context alone
        try:
            self.optimizer.step()
        finally:
            self.optimizer.shadowing = False
