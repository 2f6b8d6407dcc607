"""Gradient clipping for flat-sharded gradients (ZeRO-2): the norm is summed over ranks.

Why our own: ZeRO-2's gradients are plain 1-D shard pieces, one piece per rank, so torch's
`clip_grad_norm_` would clip each rank by the norm of its own piece only, a different factor on
every rank. (FSDP's parameters are DTensors: torch's `clip_grad_norm_` already reduces their
norm over the mesh, so FSDP needs nothing from here.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, collectives_for


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, comm_backend: str = DEFAULT_COMM_BACKEND) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for sharded gradients: the norm is summed over ranks."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    local = torch.zeros((), dtype=torch.float32)
    for g in grads:
        local += g.detach().float().pow(2).sum().cpu()
    if dist.is_initialized():
        collectives_for(comm_backend).all_reduce(local)
    total = local.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.device))
    return total
