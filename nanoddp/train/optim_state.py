"""The optimizer's part of a snapshot: whole for replicated engines, per rank for sharded ones.

A replicated optimizer (or a consolidated ZeRO-1 one) is the same on every rank, so rank 0's
`state_dict()` is the snapshot. A sharded engine's (zero2, fsdp) optimizer state is about this
rank's shard only, so rank 0 collects every rank's and restores give each rank its own back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanoddp.env import DistEnv
from nanoddp.train.engines import SHARDED_ENGINES


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collect(optimizer: torch.optim.Optimizer, sharded: bool, zero: bool, env: DistEnv) -> dict[str, Any] | None:
    """The optimizer state for the snapshot, on rank 0 (None elsewhere). Collective when
    `zero` (consolidation) or `sharded` (a gather of every rank's state): call on every rank."""
    if zero:
        optimizer.consolidate_state_dict(to=0)
    if sharded and _distributed():
        states = [None] * env.world_size if env.is_master else None
        dist.gather_object(optimizer.state_dict(), states, dst=0)
        return {"per_rank": states} if env.is_master else None
    return optimizer.state_dict() if env.is_master else None


def restore(optimizer: torch.optim.Optimizer, saved: dict[str, Any], engine: str, env: DistEnv) -> None:
    """Load `saved` (from `collect`) into this rank's optimizer, or say why it cannot be."""
    sharded = engine in SHARDED_ENGINES
    per_rank = saved.get("per_rank") if isinstance(saved, dict) else None
    if sharded != (per_rank is not None):
        kind = "a sharded engine (zero2/fsdp)" if per_rank is not None else "an unsharded engine"
        raise ValueError(
            f"the snapshot's optimizer state was saved by {kind}; resume with the engine it was "
            f"saved with, not --engine {engine}"
        )
    if per_rank is None:
        optimizer.load_state_dict(saved)
        return
    if len(per_rank) != env.world_size:
        raise ValueError(
            f"the snapshot holds {len(per_rank)} optimizer shards ({engine}), this run has "
            f"{env.world_size} ranks: resume a sharded run at the world size it was saved with"
        )
    optimizer.load_state_dict(per_rank[env.rank])
