"""The gradient average of a fault-tolerant step: weighted pieces, summed in rank order.

Why not `all_reduce`: a ring sums each chunk in a different order (starting at a different rank),
so the result depends on the world size and on who holds which rank, and a run that lost a rank
could not be compared bitwise with a replay of its schedule. Here the weighted pieces are summed
by `all_reduce_in_rank_order`: every element `((piece_0 + piece_1) + piece_2)`, in the run and in
a single-process replay alike, for a ring's bytes.

Each rank's loss rides along in a slot of its own (zeros in the others' slots, so the sum leaves
every rank's loss as it was): the global batch's mean loss, added up in rank order here, and
which ranks' losses were not finite, cost a few elements more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
from nanoddp.parallel.tensors import write_grads


def flatten_grads(params: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every parameter's gradient in one flat tensor (zeros for a parameter without one), written
    into `out` when given (a kept buffer: no model-sized allocation and copy per step)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the fault-tolerant average needs parameters of one dtype, got {sorted(map(str, dtypes))}")
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    return torch.cat(grads) if out is None else torch.cat(grads, out=out)


class WeightedPieceSum:
    """sum over ranks of (weight_r * gradient_r), added in rank order on every rank, for `params`.

    The flat piece lives in a buffer kept from step to step (a fresh model-sized buffer every
    step is paid in page faults on CPU)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.grads_numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(0, dtype=self.params[0].dtype)
        self.nonfinite_ranks: tuple[int, ...] = ()  # of the last call: ranks whose loss was NaN or inf

    @torch.no_grad()
    def __call__(self, weight: float, loss: torch.Tensor, world_size: int) -> float:
        """Replace every gradient by the weighted sum; return the same sum of the ranks' weighted
        losses (the global batch's mean loss).

        Call on every rank of the current group, after backward. A peer lost meanwhile raises here
        (gloo's error, or its timeout for a peer that hangs); the step must then not be committed."""
        numel = self.grads_numel + world_size  # the gradients, then one loss slot per rank
        if self.flat.numel() != numel:
            self.flat = torch.empty(numel, dtype=self.flat.dtype)
        losses = self.flat[self.grads_numel :]
        flatten_grads(self.params, out=self.flat[: self.grads_numel])
        losses.zero_()
        losses[dist.get_rank()] = loss.detach().to(self.flat.dtype)
        self.flat.mul_(weight)
        all_reduce_in_rank_order(self.flat)
        self.nonfinite_ranks = tuple(int(r) for r in (~losses.isfinite()).nonzero().flatten())
        total = torch.empty(1, dtype=self.flat.dtype)
        reduce_in_rank_order("SUM", list(losses.split(1)), total)
        write_grads(self.flat[: self.grads_numel], self.params)
        return float(total)
