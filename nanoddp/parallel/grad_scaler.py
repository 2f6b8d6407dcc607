"""fp16 loss scaling when each rank holds only a shard of the gradients.

Why: `torch.amp.GradScaler` decides to skip a step when *its* gradients hold an inf or nan. With
sharded gradients (ZeRO-2's flat pieces, FSDP's DTensor rows) an overflow lands on the rank that
owns those elements only: that rank would skip the step and lower its scale while the others
step, and the replicas drift apart for good. Here the found-inf flag is all-reduced (max) right
after unscaling, so every rank skips the same steps and keeps the same scale (the idea of
torch's `ShardedGradScaler`, which assumes one found-inf tensor per device on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose inf/nan verdict is the same on every rank of `group`."""

    def __init__(self, device: str = "cuda", *args, group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(device, *args, **kwargs)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled() or not dist.is_initialized():
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        # One flag per rank (a rank may hold no gradient on some device, or none at all).
        assert self._scale is not None  # made by the enabled scaler's first scale()
        flag = torch.zeros(1, dtype=torch.float32, device=self._scale.device)  # (1,)
        for value in found.values():
            flag = torch.maximum(flag, value.to(flag.device).reshape(1))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        for device in list(found):
            found[device] = flag.to(device).reshape(found[device].shape)
        if not found:
            found[flag.device] = flag.reshape(())
