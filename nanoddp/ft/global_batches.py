"""The data of a step, whatever the world size: a fixed global batch, split over who is present.

Why fixed: if a rank is lost at step s, step s is redone by the survivors; a sampler that gave
each rank its own stream would then lose the dead rank's samples or see the survivors' twice.
Here the global batch of step s is a pure function of (seed, s): the samples of one permutation
of the dataset per epoch, `batch_size` at a time, so any process that knows the step knows the
batch, and "sampler position" is just the step number a joiner receives with the weights.
The ranks present at that step take contiguous pieces of it (`share`); when the batch does not
split evenly, each piece's gradient is weighted by its size (`piece_weight`), so the sum over
ranks is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import torch


class GlobalBatches:
    """Step -> the dataset indices of its global batch (an epoch is one seeded permutation;
    its last incomplete batch is dropped, so every step's batch has `batch_size` samples)."""

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset_len < batch_size:
            raise ValueError(f"the dataset ({dataset_len} samples) must hold one batch of {batch_size}")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = dataset_len // batch_size
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def indices(self, step: int) -> torch.Tensor:
        """The indices of step `step`'s global batch, in order."""
        epoch, at = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._epoch = torch.randperm(self.dataset_len, generator=generator), epoch
        return self._order[at * self.batch_size : (at + 1) * self.batch_size]


def share(batch_size: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous piece of a batch of `batch_size` split over `world_size` ranks
    (sizes differ by at most one; the first `batch_size % world_size` ranks take one more)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if batch_size < world_size:
        raise ValueError(
            f"a global batch of {batch_size} cannot be split over {world_size} ranks: "
            f"use a batch of at least the largest world size"
        )
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def piece_weight(batch_size: int, rank: int, world_size: int) -> float:
    """What this rank's mean-loss gradient is scaled by before the sum over ranks: its share of
    the global batch, so that the sum is the gradient of the global batch's mean loss."""
    piece = share(batch_size, rank, world_size)
    return (piece.stop - piece.start) / batch_size
