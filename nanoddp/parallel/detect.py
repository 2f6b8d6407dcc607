"""Is a model already sharded, and by what: the check behind "use the engine that matches".

Why: a model sharded by the user (`fully_shard`, nanoddp's or torch's; `zero2`) holds only this
rank's pieces. Wrapping it again in DDP would broadcast rank 0's pieces over every other rank's
(silently wrong weights), and an engine that shards again would shard shards. So the Trainer and
`DistributedDataParallel` ask here first and refuse with the engine to use instead.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from nanoddp.parallel.tensors import is_dtensor


def sharded_by(model: nn.Module) -> str | None:
    """ "fsdp" if any submodule is an FSDPModule (nanoddp's or torch's) or any parameter is a
    DTensor, "zero2" if it has ZeRO-2 installed, else None."""
    from nanoddp.parallel.zero.stage2 import Zero2Module

    if not isinstance(model, nn.Module):  # not a model at all: the caller's own type check says so
        return None
    modules = list(model.modules())
    # Asked of torch's module only if it is loaded: an FSDPModule (ours derives from torch's) cannot
    # exist before it is, and every rank's engine asks here ([Note: DTensor on first use]).
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")
    if torch_fsdp is not None and any(isinstance(m, torch_fsdp.FSDPModule) for m in modules):
        return "fsdp"
    if any(is_dtensor(p) for p in model.parameters()):
        return "fsdp"
    if any(isinstance(m, Zero2Module) for m in modules):
        return "zero2"
    return None


def refuse_sharded(model: nn.Module, wrapper: str) -> None:
    """Raise a ValueError if `model` is already sharded: `wrapper` would break it."""
    kind = sharded_by(model)
    if kind is not None:
        raise ValueError(
            f"{type(model).__name__} is already sharded ({kind}: each rank holds only its pieces); {wrapper} "
            f"would treat the pieces as whole replicas. Pass the unsharded model, or train it with "
            f"engine='{kind}' (nanoddp.Trainer(..., engine='{kind}'), nanoddp train --engine {kind})"
        )
