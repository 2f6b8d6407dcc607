"""`all_reduce_in_rank_order` against a sequential sum in one process, on groups of 1-4 gloo ranks.

One launch of 4 ranks runs every group size (the groups of ranks [0], [0, 1], [0, 1, 2] and the
world): every rank's result must equal, bitwise, `((x0 + x1) + x2) + ...` that each rank computes
itself from every member's inputs (bf16/fp16 accumulated in fp32, rounded once), whatever the
chunking the group size gives, for empty, one-element, odd and multi-piece tensors. And the bytes:
summed over the group's ranks, what it sends is a ring all-reduce's 2 (n-1) x the tensor, plus
the padding of the last chunks, plus the two calls' headers (measured on an empty tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp.comm.api.rank_order import all_reduce_in_rank_order, chunk_numel
from nanoddp.comm.transport.transport import sent_bytes
from nanoddp.groups import new_group

WORLD = 4
SIZES = (0, 1, 7, 1001, 120_007)  # empty; fewer elements than ranks; odd; pieces of the bulk path
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(dtype)


def _sequential_sum(n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = _inputs(0, numel, dtype).to(acc_dtype)
    for rank in range(1, n):
        acc = acc + _inputs(rank, numel, dtype).to(acc_dtype)
    return acc.to(dtype)


def _worker(env) -> dict:
    groups = {n: new_group(range(n)) for n in range(1, WORLD)}  # every rank makes every group
    groups[WORLD] = dist.group.WORLD
    sent = {}
    for n, group in groups.items():
        if group is None:
            continue
        for dtype in DTYPES:
            for numel in SIZES:
                x = _inputs(env.rank, numel, dtype)
                before = sent_bytes()
                all_reduce_in_rank_order(x, group)
                sent[(n, dtype, numel)] = sent_bytes() - before
                expected = _sequential_sum(n, numel, dtype)
                assert torch.equal(x, expected), f"{n} ranks, {numel} {dtype}: not the sequential sum"
                everyone = [torch.empty_like(x) for _ in range(n)]
                dist.all_gather(everyone, x, group=group)
                assert all(torch.equal(y, x) for y in everyone), f"{n} ranks, {numel} {dtype}: ranks differ"
    return sent


def test_rank_order_sum_is_the_sequential_sum_at_a_rings_bytes():
    per_rank = run_on_ranks(_worker, WORLD, timeout=240)
    for n in range(1, WORLD + 1):
        for dtype in DTYPES:
            headers = sum(per_rank[r][(n, dtype, 0)] for r in range(n))
            for numel in SIZES:
                total = sum(per_rank[r][(n, dtype, numel)] for r in range(n)) - headers
                ring = 2 * (n - 1) * numel  # elements a ring all-reduce sends, over all ranks
                padding = (n - 1) * (n * chunk_numel(numel, n) - numel)  # the last chunks, gathered whole
                assert padding < n * n
                assert total == (ring + padding) * dtype.itemsize, (n, dtype, numel, total, ring, padding)
    assert all(per_rank[0][(1, dtype, numel)] == 0 for dtype in DTYPES for numel in SIZES), "one rank sends nothing"
