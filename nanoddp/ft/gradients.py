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
from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.parallel.tensors import write_grads


def flatten_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every parameter's gradient in one flat tensor (zeros for a parameter without one)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the fault-tolerant average needs parameters of one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


class WeightedPieceSum:
    """sum over ranks of (weight_r * gradient_r), added in rank order on every rank, for `params`.

    The flat piece and the gathered pieces live in buffers kept from step to step: a fresh
    buffer of world_size x the model every step is paid in page faults (on CPU, about as much
    as the all-gather itself)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params) + 1  # + the loss
        self.flat = torch.empty(self.numel, dtype=self.params[0].dtype)
        self.gathered = torch.empty(0, dtype=self.flat.dtype)
        self.total = torch.empty_like(self.flat)
        self.nonfinite_ranks: tuple[int, ...] = ()  # of the last call: ranks whose loss was NaN or inf

    @torch.no_grad()
    def __call__(self, weight: float, loss: torch.Tensor, world_size: int) -> float:
        """Replace every gradient by the weighted sum; return the same sum of the ranks' weighted
        losses (the global batch's mean loss).

        Call on every rank of the current group, after backward. A peer lost meanwhile raises here
        (gloo's error, or its timeout for a peer that hangs); the step must then not be committed."""
        torch.cat([flatten_grads(self.params), loss.detach().reshape(1).to(self.flat.dtype)], out=self.flat)
        self.flat.mul_(weight)
        if self.gathered.numel() < world_size * self.numel:
            self.gathered = torch.empty(world_size * self.numel, dtype=self.flat.dtype)
        gathered = self.gathered[: world_size * self.numel]
        comm.all_gather_into_tensor(gathered, self.flat)
        pieces = gathered.view(world_size, -1)  # (world_size, numel): each rank's weighted piece, its loss last
        self.nonfinite_ranks = tuple(int(r) for r in (~pieces[:, -1].isfinite()).nonzero().flatten())
        reduce_in_rank_order("SUM", list(pieces.unbind(0)), self.total)
        write_grads(self.total[:-1], self.params)
        return float(self.total[-1])
