"""A sum over a group that is the same bits however many ranks share it: the rank-order all-reduce.

Why it exists: a ring (or halving-doubling) all-reduce adds each chunk starting at a different
rank, so the rounding of the sum depends on the group's size and on who holds which rank. A
fault-tolerant run, whose membership changes, could then never be compared bitwise with a replay
of its schedule. Here every element is added in member-rank order, `((x0 + x1) + x2) + ...`,
exactly as one process adding the ranks' tensors in a loop would (fp16/bf16 accumulated in fp32,
rounded once): the rule `reduce_in_rank_order` keeps for every whole-contribution reduction.

And it costs a ring's bytes: the sum of chunk j is made by rank j alone (an all-to-all hands each
rank every member's copy of its own chunk, a reduce-scatter), then every rank gathers every chunk
(an all-gather): 2 (n-1)/n of the tensor sent per rank, up to n-1 elements of padding.

It composes the public collectives (all_to_all_single, all_gather_into_tensor), so it lives with
them; any group they run on will do, one torch's registry does not know included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanoddp.comm.algorithms.reduce import reduce_in_rank_order
from nanoddp.comm.api.alltoall import all_to_all_single
from nanoddp.comm.api.collectives import all_gather_into_tensor
from nanoddp.comm.transport.runner import runner_for


def chunk_numel(numel: int, size: int) -> int:
    """Elements of each rank's chunk: ceil(numel / size); the last chunks are short or empty."""
    return -(-numel // size)


@torch.no_grad()
def all_reduce_in_rank_order(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Replace the 1-D `flat` on every rank of `group` by the sum over ranks, added in rank order.

    Every rank gets the same bits, equal to `((x0 + x1) + x2) ...` computed in one process, for
    any number of ranks. Call it on every member, with tensors of one numel and dtype."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"all_reduce_in_rank_order needs a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    runner = runner_for(group, "all_reduce_in_rank_order")
    if runner is None:
        return
    size, me = runner.peers.size, runner.peers.rank
    if size == 1:
        return  # a sum of one: itself (fp32 accumulation of one bf16 value rounds back to it)
    chunk = chunk_numel(flat.numel(), size)
    bounds = [(min(r * chunk, flat.numel()), min((r + 1) * chunk, flat.numel())) for r in range(size)]
    mine = bounds[me][1] - bounds[me][0]
    # reduce-scatter: rank r receives every member's copy of chunk r, in member-rank order
    copies = flat.new_empty(size * mine)
    all_to_all_single(copies, flat, [mine] * size, [b - a for a, b in bounds], group=group)
    summed = flat.new_zeros(chunk)  # this rank's chunk, padded to the common size for the gather
    reduce_in_rank_order("SUM", list(copies.view(size, mine).unbind(0)), summed[:mine])
    gathered = flat.new_empty(size * chunk)
    all_gather_into_tensor(gathered, summed, group=group)
    flat.copy_(gathered[: flat.numel()])
