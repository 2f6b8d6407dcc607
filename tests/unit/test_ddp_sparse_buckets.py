"""Bucket assignment with sparse gradients, against torch's own `_compute_bucket_assignment_by_size`
(the C++ function torch's DDP buckets with), and which parameters expect sparse gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.parallel.ddp.buckets import assign_buckets
from nanoddp.parallel.ddp.sparse import expects_sparse_grad


def _params(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.zeros(n) for n in sizes]


def test_sparse_gradients_get_a_bucket_of_their_own_where_torch_puts_them():
    """In arrival order (torch's rebuild: no sorting) and sorted by first member (its first
    layout): same buckets as torch's assignment, for several placements of sparse parameters."""
    params = _params([300, 10, 500, 20, 40, 700, 30])
    limits = [1024, 2048]
    for sparse in ([False] * 7, [True] + [False] * 6, [False, True, False, False, True, False, True]):
        for sort in (False, True):
            indices = [] if sort else list(range(len(params)))  # torch sorts only without indices
            expected, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse, indices)
            assert assign_buckets(params, limits, sparse, sort=sort) == expected, (sparse, sort)


def test_which_parameters_expect_sparse_gradients():
    model = nn.ModuleDict(
        {"bag": nn.EmbeddingBag(5, 2, sparse=True), "dense_emb": nn.Embedding(5, 2), "lin": nn.Linear(2, 2)}
    )
    model["tied"] = nn.Embedding(5, 2, sparse=False)
    model["tied"].weight = model["bag"].weight  # the first module to register it decides
    params = list(model.parameters())
    assert expects_sparse_grad(model, params) == [True, False, False, False]
