"""`nanoddp train`'s own recipe: AdamW with decoupled weight decay on matrices, and a linear
warmup into a cosine decay. A `nanoddp.Trainer` user brings their own optimizer and schedule."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from nanoddp.train.config import TrainConfig, build_model, filled, uses_zero_optimizer
from nanoddp.train.data.datasets import build_datasets


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
    kwargs: dict[str, Any] = {"lr": config.lr, "betas": (0.9, 0.95)}
    if uses_zero_optimizer(config):
        from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def follow_steps_on_resume(scheduler: Any, saved_steps: int, steps: int, step: int) -> str | None:
    """After a snapshot's scheduler state is loaded, when `steps` differs from the snapshot's:
    the line to log, None when nothing changed (or there is no scheduler).

    `steps` is the run's length, and the built-in warmup-cosine schedule is a function of it (as
    nanoGPT's get_lr, or a Hugging Face Trainer's scheduler, follow the current max steps): it is
    re-stretched over `steps` from where the run stands, which a fresh `steps`-long run would also
    use from here on. LambdaLR's load_state_dict had restored the snapshot's length into it. A
    user's scheduler is theirs: it keeps its saved state, and the line says so.
    """
    if scheduler is None or saved_steps == steps:
        return None
    lambdas = getattr(scheduler, "lr_lambdas", None)
    changed = f"steps changed from {saved_steps} to {steps} on resume"
    if not lambdas or not all(isinstance(f, WarmupCosine) for f in lambdas):
        return (
            f"{changed}: the lr_scheduler continues from its saved state at step {step}, lengths it saved "
            f"(such as T_max) included; to follow {steps} steps, set them on trainer.scheduler before fit()"
        )
    before = scheduler.get_last_lr()[0]
    for schedule in lambdas:
        schedule.total = steps
    lrs = [base * schedule(scheduler.last_epoch) for base, schedule in zip(scheduler.base_lrs, lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
    return (
        f"{changed}: the warmup-cosine schedule is re-stretched over {steps} steps from step {step} "
        f"(lr {before:.3g} -> {lrs[0]:.3g})"
    )


class Job(NamedTuple):
    """`nanoddp train`'s built-in job (`build_job`): data, model, optimizer and schedule."""

    train_set: Dataset
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    val_set: Dataset | None


def build_job(config: TrainConfig, device: torch.device | None = None) -> Job:
    """The data, model (seeded with `config.seed`: every process builds the same weights, on
    `device`, default the CPU), AdamW and warmup-cosine schedule that `config` describes: what
    `Trainer.from_config` trains in either `--on-failure` mode, and the torchft benchmark's job."""
    train_set, val_set, spec = build_datasets(
        config.data, config.seq_len, config.val_fraction, filled(config.text_max_bytes), model=config.model
    )
    torch.manual_seed(config.seed)
    module = build_model(config, spec).to(device)  # before the optimizer, which may shard by device
    optimizer = make_optimizer(module, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(filled(config.warmup_steps), config.steps, config.min_lr_ratio)
    )
    return Job(train_set, module, optimizer, scheduler, val_set)
