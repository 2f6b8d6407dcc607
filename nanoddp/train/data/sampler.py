"""Samplers that split a dataset across ranks, and resume exactly where a run stopped.

`ResumableDistributedSampler` plays the role of `torch.utils.data.DistributedSampler` with one
difference that matters for fault tolerance: its state is a *global sample position*, the
number of samples of the current epoch that the whole job has consumed. Every epoch is one
permutation of the dataset (seeded by `seed + epoch`), dealt out round-robin::

    remaining = permutation[position:]          # what the job has not seen this epoch
    rank r gets remaining[r], remaining[r + W], remaining[r + 2W], ...

After every rank has taken k samples, the job has consumed exactly `remaining[:k * W]`, so the
position advances by `k * W` whatever W is. Resuming with a *different* world size therefore
continues with exactly the samples not yet seen, each once.

Uneven tails: with `drop_last=False` (the default) the remaining samples are padded up to a
multiple of the world size by repeating samples from the start of the epoch's permutation
(as torch does); with `drop_last=True` the last `len % W` samples are skipped. Either way every
rank yields the same number of indices, so every rank runs the same number of steps and no
rank waits forever in a collective that the others never reach.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, Sampler, Subset

logger = logging.getLogger(__name__)


def _check_world(num_samples: int, num_replicas: int, rank: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    if num_samples < num_replicas:
        raise ValueError(
            f"the dataset has {num_samples} samples but the world size is {num_replicas}: every rank "
            "needs at least one sample; use a larger dataset or fewer processes"
        )


def _default_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Read the world from the initialised process group when not given explicitly."""
    import torch.distributed as dist

    if num_replicas is None or rank is None:
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
    return num_replicas, rank


class ResumableDistributedSampler(Sampler[int]):
    """Shard a dataset over `num_replicas` ranks; resumable from a global sample position.

    Use it like torch's `DistributedSampler` (pass it to a `DataLoader`, call `set_epoch` at
    the start of each epoch), and additionally call `advance(n)` after consuming `n` samples on
    this rank so that `state_dict()` records how far the job got. `set_epoch` with the current
    epoch keeps the position (that is what a resumed run does); a new epoch starts at 0.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.num_replicas, self.rank = _default_world(num_replicas, rank)
        self.dataset_len = len(dataset)
        _check_world(self.dataset_len, self.num_replicas, self.rank)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # global samples of this epoch consumed by the whole job

    # --- the epoch's order -------------------------------------------------------------

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The whole job's sample order for `epoch` (identical on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    def _global_order(self) -> torch.Tensor:
        """The not-yet-consumed part of the epoch, trimmed or padded to a multiple of W."""
        order = self.permutation()
        remaining = order[min(self.position, self.dataset_len) :]
        extra = len(remaining) % self.num_replicas
        if extra and self.drop_last:
            remaining = remaining[: len(remaining) - extra]
        elif extra:
            pad = self.num_replicas - extra
            repeats = -(-pad // self.dataset_len)  # tiny datasets may need to wrap more than once
            remaining = torch.cat([remaining, order.repeat(repeats)[:pad]])
        return remaining

    def __iter__(self) -> Iterator[int]:
        return iter(self._global_order()[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        remaining = max(self.dataset_len - self.position, 0)
        if self.drop_last:
            return remaining // self.num_replicas
        return -(-remaining // self.num_replicas)

    # --- progress and state ------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; a new epoch restarts at position 0."""
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def advance(self, local_samples: int) -> None:
        """Record that this rank (and so every rank) consumed `local_samples` more samples.

        Takes effect on the next `__iter__`; an iterator already running is not disturbed.
        """
        if local_samples < 0:
            raise ValueError(f"local_samples must be >= 0, got {local_samples}")
        self.position += local_samples * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch and position; the world size may differ from the one that saved it."""
        if state["dataset_len"] != self.dataset_len:
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_len']} samples, but this one has "
                f"{self.dataset_len}; resume with the same data as the saved run"
            )
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            logger.warning(
                "sampler seed/shuffle changed from %s to %s: the rest of the epoch uses a new order",
                (state["seed"], state["shuffle"]),
                (self.seed, self.shuffle),
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def shard(dataset: Sized, rank: int, world_size: int, drop_last: bool = True) -> Subset:
    """The teaching version of a distributed sampler: `dataset[rank::world_size]`.

    No shuffling and no resume, but it shows the idea in one line. With `drop_last=True` every
    shard has `len // world_size` samples, so ranks run the same number of steps; with False the
    first `len % world_size` ranks get one extra sample (and would wait on the others at the
    last collective, so only use it where that cannot happen, e.g. evaluation).
    """
    _check_world(len(dataset), world_size, rank)
    stop = (len(dataset) // world_size) * world_size if drop_last else len(dataset)
    return Subset(cast(Dataset[Any], dataset), range(rank, stop, world_size))  # Subset only indexes it
