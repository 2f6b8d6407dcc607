"""`sent_bytes()` (the trainer's `comm_bytes`) counts bytes of the tensors the bulk paths send.

The bulk paths send the caller's dtype, not byte frames, so a count of elements would read 4x
low for float32. Reference: torch's own byte count of the tensor (`Tensor.nbytes`) times the
volume each algorithm moves per rank, 2 (ws - 1) / ws of the message for an all-reduce by ring
or halving/doubling, ws - 1 times it for an all-gather. Each call runs at two sizes, n and 2n:
the difference is the data alone (the header round's frame is the same for both). ws 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_on_ranks

import nanoddp.comm as ndc
from nanoddp.comm import plan
from nanoddp.comm.plan import Path
from nanoddp.comm.transport import sent_bytes

NUMEL = 4096
CALLS = [
    ("all_reduce", Path.RING, torch.float32),
    ("all_reduce", Path.HALVING_DOUBLING, torch.float32),
    ("all_reduce", Path.RING, torch.bfloat16),
    ("all_gather", Path.RING, torch.float32),
]


def _sent_by(op: str, x: torch.Tensor, world_size: int) -> int:
    before = sent_bytes()
    if op == "all_reduce":
        ndc.all_reduce(x)
    else:
        ndc.all_gather_into_tensor(torch.empty(world_size * x.numel(), dtype=x.dtype), x)
    return sent_bytes() - before


def _worker(env) -> list[int]:
    """Per call of CALLS, on its path: the bytes n more elements add to this rank's sends."""
    extra = []
    for op, path, dtype in CALLS:
        plan.FORCED[op] = path
        try:
            small, large = (_sent_by(op, torch.ones(n, dtype=dtype), env.world_size) for n in (NUMEL, 2 * NUMEL))
        finally:
            plan.FORCED.pop(op)
        extra.append(large - small)
    return extra


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sent_bytes_are_torchs_byte_count_of_what_is_sent(world_size):
    per_rank = run_on_ranks(_worker, world_size, timeout=180)
    for rank, extra in enumerate(per_rank):
        for (op, path, dtype), got in zip(CALLS, extra, strict=True):
            nbytes = torch.ones(NUMEL, dtype=dtype).nbytes
            want = 2 * (world_size - 1) * nbytes // world_size if op == "all_reduce" else (world_size - 1) * nbytes
            assert got == want, f"rank {rank}: {op} by {path.name} in {dtype}: {got} bytes counted, {want} sent"
