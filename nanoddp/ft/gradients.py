"""The gradient average of a fault-tolerant step: weighted pieces, summed in rank order.

Why not `all_reduce`: a ring sums each chunk in a different order (starting at a different rank),
so the result depends on the world size and on who holds which rank, and a run that lost a rank
could not be compared bitwise with a replay of its schedule. Here every rank all-gathers the
weighted pieces and adds them up itself in rank order (`reduce_in_rank_order`, the same rule
nanoddp's collectives use when they reduce whole contributions): `((piece_0 + piece_1) + piece_2)`
on every rank, in the run and in a single-process replay alike. It sends world_size times the
bytes a ring would (each rank receives every piece); for the models a step loop like this one
serves on CPU, the determinism is worth it, and docs/ft.md says where it stops being so.

The step's loss rides along as one more element, so the global batch's mean loss costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import nanoddp.comm as comm
from nanoddp.comm.reduce import reduce_in_rank_order


def flatten_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every parameter's gradient in one flat tensor (zeros for a parameter without one)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the fault-tolerant average needs parameters of one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflatten_into_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Write `flat` back as every parameter's gradient."""
    at = 0
    for p in params:
        piece = flat[at : at + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)
        at += p.numel()


@torch.no_grad()
def sum_weighted_pieces(params: Sequence[torch.Tensor], weight: float, loss: torch.Tensor, world_size: int) -> float:
    """Replace every gradient by sum over ranks of (weight_r * gradient_r), added in rank order on
    every rank; return the same sum of the ranks' weighted losses (the global batch's mean loss).

    Call on every rank of the current group, after backward. A peer lost meanwhile raises here
    (gloo's error, or its timeout for a peer that hangs); the step must then not be committed."""
    flat = torch.cat([flatten_grads(params), loss.detach().reshape(1).to(params[0].dtype)])
    flat.mul_(weight)
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype)
    comm.all_gather_into_tensor(gathered, flat)
    total = torch.empty_like(flat)
    reduce_in_rank_order("SUM", list(gathered.view(world_size, -1).unbind(0)), total)
    unflatten_into_grads(total[:-1], params)
    return float(total[-1])
