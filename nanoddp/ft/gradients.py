"""The gradient average of a fault-tolerant step: weighted pieces, summed in rank order.

Why not `all_reduce`: a ring sums each chunk in a different order (starting at a different rank),
so the result depends on the world size and on who holds which rank, and a run that lost a rank
could not be compared bitwise with a replay of its schedule. Here the weighted pieces are summed
by `all_reduce_in_rank_order` over the group across the replicas: every element
`((piece_0 + piece_1) + piece_2)`, in the run and in a single-process replay alike, for a ring's
bytes.

What is summed are gradient buffers: a plain loop's parameter gradients, or an engine's
`cross_replica_grads()` (already reduced within the replica by the engine itself). Each rank's
loss rides along in a slot of its own (zeros in the others' slots, so the sum leaves every rank's
loss as it was): the global batch's mean loss, added up in rank order here, and which ranks'
losses were not finite, cost a few elements more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.api.rank_order import all_reduce_in_rank_order


def grad_buffers(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's gradient as a 1-D view (a zero gradient made for a parameter without
    one: the others' pieces may not be zero), for `WeightedPieceSum` to sum in place."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
    return [p.grad.view(-1) for p in params if p.grad is not None]


class WeightedPieceSum:
    """sum over ranks of (weight_r * buffers_r), added in rank order on every rank.

    The flat piece lives in a buffer kept from step to step (a fresh model-sized buffer every
    step is paid in page faults on CPU)."""

    def __init__(self) -> None:
        self.flat = torch.empty(0)
        self.nonfinite_ranks: tuple[int, ...] = ()  # of the last call: ranks whose loss was NaN or inf

    @torch.no_grad()
    def __call__(
        self, buffers: Sequence[torch.Tensor], weight: float, loss: torch.Tensor, group: dist.ProcessGroup
    ) -> float:
        """Replace every one of `buffers` (1-D, of one dtype) by the weighted sum over `group`;
        return the same sum of the ranks' weighted losses (the global batch's mean loss).

        Call on every rank of `group`, after backward, with buffers of the same shapes. A peer lost
        meanwhile raises here (gloo's error, or its timeout for a peer that hangs); the step must
        then not be committed."""
        dtypes = {b.dtype for b in buffers}
        if len(dtypes) != 1:
            raise ValueError(f"the fault-tolerant average needs gradients of one dtype, got {sorted(map(str, dtypes))}")
        rank, world_size = group.rank(), group.size()
        grads_numel = sum(b.numel() for b in buffers)
        numel = grads_numel + world_size  # the gradients, then one loss slot per rank
        if self.flat.numel() != numel or self.flat.dtype != buffers[0].dtype or self.flat.device != buffers[0].device:
            self.flat = torch.empty(numel, dtype=buffers[0].dtype, device=buffers[0].device)
        losses = self.flat[grads_numel:]
        torch.cat(list(buffers), out=self.flat[:grads_numel])
        losses.zero_()
        losses[rank] = loss.detach().to(self.flat.dtype)
        self.flat.mul_(weight)
        all_reduce_in_rank_order(self.flat, group)
        self.nonfinite_ranks = tuple(int(r) for r in (~losses.isfinite()).nonzero().flatten())
        total = torch.empty(1, dtype=self.flat.dtype, device=self.flat.device)
        reduce_in_rank_order("SUM", list(losses.split(1)), total)
        at = 0
        for buffer in buffers:
            buffer.copy_(self.flat[at : at + buffer.numel()])
            at += buffer.numel()
        return float(total)
