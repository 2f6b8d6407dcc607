"""`gather_for_metrics`: every rank's eval outputs in dataset order, without the sampler's padding.

A distributed sampler (torch's `DistributedSampler`, our `ResumableDistributedSampler`) deals
the epoch's order round-robin and, when the dataset does not divide by the world size W, pads
the order by repeating its first samples so that every rank runs the same number of batches::

    order  = [s0, s1, ..., s(N-1), s0, s1]        # padded to a multiple of W
    rank r = order[r], order[r + W], order[r + 2W], ...

Rank r's j-th output is therefore the sample at position j·W + r. Interleaving the ranks'
outputs (position by position) rebuilds `order`, and keeping its first N entries keeps every
sample exactly once. A plain all_gather + concatenate instead yields rank-major order, where
the duplicates are scattered and cannot be dropped, so the metric counts some samples twice
(huggingface/accelerate#575).

Called once on an epoch's outputs, pass `dataset_len=len(dataset)`. Called per batch, each
call returns the next contiguous block of `order`: concatenate the blocks and keep the first
`len(dataset)` rows (or pass `dataset_len` on the last call only with the number still due).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from nanoddp.comm.transport.watchdog import TORCH_COLLECTIVES


def _interleave_positions(counts: list[int]) -> list[tuple[int, int]]:
    """(rank, local index) in global order: position j·W + r, skipping ranks that ran out."""
    world_size = len(counts)
    return [(r, j) for j in range(max(counts, default=0)) for r in range(world_size) if j < counts[r]]


def _check_len(dataset_len: int | None, total: int) -> None:
    if dataset_len is None:
        return
    if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or not 0 <= dataset_len <= total:
        raise ValueError(
            f"dataset_len must be an int in [0, {total}] (the samples gathered from all ranks), got "
            f"{dataset_len!r}; pass len(eval_dataset), or None to keep the padding"
        )


def _gather_tensor(tensor: torch.Tensor, dataset_len: int | None) -> torch.Tensor:
    """(n_r, *S) on each rank -> (sum n_r or dataset_len, *S), in the sampler's global order."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)  # a per-rank scalar is one "sample"
    world_size = dist.get_world_size()
    meta: list[Any] = [None] * world_size  # filled by all_gather_object: (n, row shape, dtype) per rank
    dist.all_gather_object(meta, (tensor.shape[0], tuple(tensor.shape[1:]), str(tensor.dtype)))
    counts = [m[0] for m in meta]
    if len({m[1:] for m in meta}) != 1:  # every rank sees the same meta, so raises the same error
        shapes = {rank: f"(n, {', '.join(map(str, m[1]))}) {m[2]}" for rank, m in enumerate(meta)}
        raise ValueError(
            f"gather_for_metrics needs the same trailing shape and dtype on every rank, got {shapes}; "
            "gather per-sample outputs of one kind (e.g. predictions, or labels) per call"
        )
    _check_len(dataset_len, sum(counts))
    longest = max(counts)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))  # (L, *S)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    TORCH_COLLECTIVES.all_gather(parts, padded)
    stacked = torch.stack(parts, dim=1).flatten(0, 1)  # (L·W, *S), row j·W + r = rank r's j-th
    if min(counts) != longest:  # ragged (e.g. an unpadded shard): keep only real rows
        keep = torch.tensor([j * world_size + r for r, j in _interleave_positions(counts)], device=stacked.device)
        stacked = stacked.index_select(0, keep)
    return stacked if dataset_len is None else stacked[:dataset_len]


def _gather_objects(items: list, dataset_len: int | None) -> list:
    """Per-sample python objects, gathered into the same global order as tensors."""
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, list(items))
    ordered = [per_rank[r][j] for r, j in _interleave_positions([len(p) for p in per_rank])]
    _check_len(dataset_len, len(ordered))
    return ordered if dataset_len is None else ordered[:dataset_len]


def gather_for_metrics(value: Any, dataset_len: int | None = None) -> Any:
    """Gather eval outputs from every rank in dataset order, dropping the sampler's padding.

    `value` is a tensor whose first dimension runs over this rank's samples, a list of
    per-sample python objects, or a tuple/dict of those (gathered element by element, so
    `(preds, labels)` works). With `dataset_len=len(dataset)` the result has exactly one entry
    per sample, and a metric over it equals the single-process one. Collective: call it on every
    rank. Without a process group (one process) it only trims to `dataset_len`.
    """
    if isinstance(value, Mapping):
        mapping_type: Any = type(value)  # a Mapping subclass built from a dict, as dict is
        return mapping_type({k: gather_for_metrics(v, dataset_len) for k, v in value.items()})
    if isinstance(value, tuple):
        gathered = [gather_for_metrics(v, dataset_len) for v in value]
        return type(value)(*gathered) if hasattr(value, "_fields") else tuple(gathered)
    if not isinstance(value, (torch.Tensor, list)):
        raise TypeError(
            f"gather_for_metrics takes a tensor, a list of per-sample objects, or a tuple/dict of them, "
            f"got {type(value).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.reshape(1)
        _check_len(dataset_len, len(value))
        return value if dataset_len is None else value[:dataset_len]
    if isinstance(value, torch.Tensor):
        return _gather_tensor(value, dataset_len)
    return _gather_objects(value, dataset_len)
