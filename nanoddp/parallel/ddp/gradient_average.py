"""How DDP averages a gradient: divide by the number of ranks *before* the sum.

Every DDP path (the reducer's buckets, sparse gradients, the delayed all-reduce, the comm
hooks) reduces with an all-reduce SUM of gradients already divided, as torch's DDP does, so the
sum cannot overflow a 16-bit dtype and the result equals torch's bit for bit.
"""

from __future__ import annotations

import torch


def divide_for_average(tensor: torch.Tensor, divisor: int, *, by_reciprocal: bool = False) -> torch.Tensor:
    """Divide `tensor` in place by `divisor` (the ranks averaged over) and return it; the
    all-reduce SUM that follows then yields the average.

    [Note: torch's rounding] torch's reducer multiplies by 1/n when it copies a gradient into
    its bucket (`by_reciprocal=True`) and divides in place everywhere else (a bucket-view
    gradient, a sparse gradient, its comm hooks). When n is not a power of two, x * (1/n) and
    x / n round differently, so each caller picks the op torch uses there, for bitwise parity."""
    if by_reciprocal:
        return tensor.mul_(1.0 / divisor)
    return tensor.div_(divisor)
