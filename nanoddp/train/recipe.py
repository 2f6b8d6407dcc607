"""`nanoddp train`'s own recipe: AdamW with decoupled weight decay on matrices, and a linear
warmup into a cosine decay. A `nanoddp.Trainer` user brings their own optimizer and schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from nanoddp.train.config import TrainConfig, uses_zero_optimizer


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_ratio` at `total` steps."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(module: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, norms). ZeRO-1 (`--engine zero1`)
    shards its state."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = {"lr": config.lr, "betas": (0.9, 0.95)}
    if uses_zero_optimizer(config):
        from nanoddp.parallel.zero.optimizer import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)
