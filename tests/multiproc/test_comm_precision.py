"""fp16/bf16 all-reduce accumulates in fp32, as documented, checked bit for bit.

Tolerances sized for gloo's per-step rounding (test_comm) also pass a sum done in the tensor's
own dtype. Here the one-round path (small tensors: every rank receives every part) must equal
the fp32 sum of the parts in rank order, rounded once: bitwise, because that is exactly how
it is documented to compute. The inputs are chosen so that summing in fp16/bf16 itself gives a
different answer (checked on the data), so own-dtype accumulation cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_on_ranks

from nanoddp import comm
from nanoddp.comm import ReduceOp

WORLD_SIZE = 3  # odd, and 3 parts: two additions, so per-addition rounding shows
NUMEL = 2048  # 4 KB in fp16: well inside the one-round (inline) limit at every world size


def _parts(dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's input: magnitudes 1, 100 and 0.01 so that low-precision partial sums round."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(NUMEL, generator=g) * 10 ** (2 - 2 * ((r + 1) % 3))).to(dtype) for r in range(WORLD_SIZE)]


def _reference(parts: list[torch.Tensor], op: str, accumulate: torch.dtype) -> torch.Tensor:
    acc = parts[0].to(accumulate)
    for part in parts[1:]:
        acc = acc + part.to(accumulate)
    if op == "avg":
        acc = acc / len(parts)
    return acc.to(parts[0].dtype)


def _all_reduce(env, dtype: torch.dtype, op: str) -> torch.Tensor:
    tensor = _parts(dtype)[env.rank].clone()
    comm.all_reduce(tensor, op=ReduceOp.AVG if op == "avg" else ReduceOp.SUM)
    return tensor


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_all_reduce_equals_the_fp32_sum_rounded_once(dtype, op):
    parts = _parts(dtype)
    expected = _reference(parts, op, torch.float32)
    own_dtype = _reference(parts, op, dtype)
    assert not torch.equal(own_dtype, expected), "inputs must tell fp32 from own-dtype accumulation"
    for result in run_on_ranks(_all_reduce, WORLD_SIZE, dtype, op, timeout=120):
        # bitwise: fp32 partial sums of these fp16/bf16 inputs are exact, and the one rounding is the same
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


RING_NUMEL = 1 << 20  # 4 MB of fp32: above the one-round limit at every world size, so the ring runs


def _ring_all_reduce(env) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(env.rank)
    ours = torch.randn(RING_NUMEL, generator=g)
    reference = ours.clone()
    comm.all_reduce(ours)
    dist.all_reduce(reference)  # torch's gloo all-reduce of the same inputs
    return ours, reference


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_all_reduce_sums_every_piece_like_torch(world_size):
    for ours, reference in run_on_ranks(_ring_all_reduce, world_size, timeout=120):
        # fp32 sums of 2-3 terms in another order: a few ulps; a dropped or doubled piece is O(1)
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
