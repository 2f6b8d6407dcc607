"""Sparse gradients in DDP: which parameters produce them, and how they are averaged over ranks.

`nn.Embedding(sparse=True)` / `nn.EmbeddingBag(sparse=True)` give their weight a sparse COO
gradient holding only the rows a batch touched. It cannot live in a flat bucket (its size
changes every step, and a dense copy would defeat the point), so, as torch's DDP does, each such
parameter gets a bucket of its own and is reduced as a sparse tensor: every rank's rows are
gathered and added up in rank order, then coalesced, which sums the rows several ranks touched.
The result, and the parameter's `.grad`, stay sparse.

Why a gather and not an all-reduce: ranks touch different rows, so their index sets differ in
content and size. Each rank first learns every rank's row count, pads its own indices and values
to the largest, and all-gathers them; no rank can then be left waiting on a differently sized
message. The order of the sums is the one torch's gloo backend uses (each rank coalesces its own
duplicate rows, then ((rank 0 + rank 1) + rank 2) + ... as sparse additions, then a final
coalesce), so the averages agree bit for bit. A single concatenation of every rank's rows
followed by one coalesce sums the same numbers in another order: with three or more ranks a
row touched by all of them then differs in the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp.comm.api.backend import Collectives


def expects_sparse_grad(module: nn.Module, params: Sequence[torch.Tensor]) -> list[bool]:
    """For each of `params`, whether it belongs to an Embedding/EmbeddingBag built with sparse=True.

    The first module that registers a shared parameter decides, as in torch's
    `_build_params_for_reducer` (which walks `named_modules()` in the same order)."""
    sparse_ids: dict[int, bool] = {}
    for sub in module.modules():
        produces_sparse = isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and bool(sub.sparse)
        for param in sub.parameters(recurse=False):
            sparse_ids.setdefault(id(param), produces_sparse)
    return [sparse_ids.get(id(p), False) for p in params]


def empty_sparse_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no rows: what a rank that did not use the parameter contributes."""
    return torch.sparse_coo_tensor(
        torch.zeros(1, 0, dtype=torch.int64, device=param.device),  # (sparse_dim=1, nnz=0)
        torch.zeros(0, *param.shape[1:], dtype=param.dtype, device=param.device),  # (0, *dense dims)
        param.shape,
    )


def _gather_padded(tensor: torch.Tensor, rows_dim: int, counts: list[int], collectives: Collectives, group: Any):
    """Every rank's `tensor`, whose size along `rows_dim` is that rank's entry in `counts`."""
    longest = max(counts)
    shape = list(tensor.shape)
    shape[rows_dim] = longest
    padded = tensor.new_zeros(shape)
    padded.narrow(rows_dim, 0, tensor.shape[rows_dim]).copy_(tensor)
    gathered = [torch.empty_like(padded) for _ in counts]
    collectives.all_gather(gathered, padded, group=group)
    return [t.narrow(rows_dim, 0, n) for t, n in zip(gathered, counts, strict=True)]


def sparse_all_reduce(tensor: torch.Tensor, collectives: Collectives, group: Any = None) -> torch.futures.Future:
    """Sum a sparse COO tensor over the ranks of `group`; a completed Future holding the coalesced sum.

    Runs to completion before returning (three gathers); the Future is only there so a sparse
    bucket is waited for like a dense one, or returned from a comm hook.
    """
    local = tensor.coalesce()  # this rank's duplicate rows summed first, as torch's gloo does
    indices, values = local.indices(), local.values()  # (sparse_dim, nnz), (nnz, *dense dims)
    nnz = torch.tensor([indices.shape[1]], dtype=torch.int64, device=tensor.device)  # (1,)
    counts = [torch.zeros_like(nnz) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(counts, nnz, group=group)
    counts_list = [int(c.item()) for c in counts]
    if max(counts_list) == 0:
        result = local  # no rank touched a row: nothing to move (every rank sees the same counts)
    else:
        all_indices = _gather_padded(indices, 1, counts_list, collectives, group)
        all_values = _gather_padded(values, 0, counts_list, collectives, group)
        pieces = [torch.sparse_coo_tensor(i, v, tensor.shape) for i, v in zip(all_indices, all_values, strict=True)]
        result = pieces[0]
        for piece in pieces[1:]:
            result = result + piece  # in rank order, as gloo's sparse all-reduce
        result = result.coalesce()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return future
