"""The built-in job's pieces from a `TrainConfig`, for a step loop that is not the Trainer's.

`nanoddp train --on-failure continue` (`nanoddp.train.ft_loop`) and the torchft worker of
`nanoddp bench restarts` (`nanoddp.bench.torchft_ddp`) both train the job `nanoddp train` trains:
the same data, the same initial weights, AdamW and the warmup-cosine schedule (`nanoddp.train.recipe`).
They build it here, once, so that a comparison between the two loops compares loops only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from nanoddp.train.config import TrainConfig, build_model, filled
from nanoddp.train.data.datasets import build_datasets
from nanoddp.train.recipe import WarmupCosine, make_optimizer


@dataclass(frozen=True)
class Job:
    """What a step loop trains: the training data, the model, its optimizer and schedule."""

    train_set: Dataset
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    val_set: Dataset | None = None
    """The validation data (for a loop that evaluates)."""

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample (None for data without tokens): for the records' `tokens_per_s`."""
        return getattr(self.train_set, "tokens_per_sample", None)


def build_job(config: TrainConfig) -> Job:
    """The data, model (seeded with `config.seed`: every process builds the same weights),
    AdamW and warmup-cosine schedule that `nanoddp train` would build from `config`."""
    train_set, val_set, spec = build_datasets(
        config.data, config.seq_len, config.val_fraction, filled(config.text_max_bytes), model=config.model
    )
    torch.manual_seed(config.seed)
    module = build_model(config, spec)
    optimizer = make_optimizer(module, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(filled(config.warmup_steps), config.steps, config.min_lr_ratio)
    )
    return Job(train_set, module, optimizer, scheduler, val_set)
