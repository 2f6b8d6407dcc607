"""Reductions for `nanoddp.comm`: one op applied in place, and whole contributions in rank order.

Why it exists: every path that reduces (the ring, the chain, the 2-rank exchange, the one-round
path in the header round's frames) must apply the same op the same way, or the paths would give
results that differ by rounding. Two rules live here: AVG sums and divides once at the end
(`finish_avg`), and a reduction of every rank's contribution at once runs in rank order,
accumulating fp16/bf16 in fp32 (`reduce_in_rank_order`), so every rank gets bitwise the same
result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


# op -> the elementwise function that combines two operands (AVG sums; `finish_avg` divides).
_PAIRWISE: dict[str, Callable[..., torch.Tensor]] = {
    "SUM": torch.add,
    "AVG": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
}


def reduce_into(op: str, acc: torch.Tensor, other: torch.Tensor) -> None:
    """acc = op(acc, other), in place (AVG sums here; `finish_avg` divides once at the end)."""
    _PAIRWISE[op](acc, other, out=acc)


def combine_into(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = op(a, b) (AVG sums), one rounding in the tensors' dtype; `out` may be `a` or `b`
    (elementwise: each is read before it is written). `reduce_into(op, a, b)` out of place."""
    _PAIRWISE[op](a, b, out=out)


def finish_avg(op: str, tensor: torch.Tensor, n: int) -> None:
    if op == "AVG":
        tensor.div_(n)  # checks.op_name allows AVG on floating-point tensors, as torch does


def reduce_in_rank_order(op: str, parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] op parts[1] op ... in rank order, accumulating fp16/bf16 in fp32.

    Every rank combines the same parts in the same order, so all ranks get bitwise the same
    result (DDP replicas must not drift apart by rounding).
    """
    later = {p.data_ptr() for p in parts[2:]}
    if out.dtype not in LOW_PRECISION and len(parts) > 1 and out.data_ptr() not in later:
        # Straight into `out` (it may be parts[0] or parts[1]: elementwise, each is read before it
        # is written): the accumulator's additions in the same order, without its two copies.
        combine_into(op, parts[0], parts[1], out)
        for part in parts[2:]:
            reduce_into(op, out, part)
        finish_avg(op, out, len(parts))
        return
    acc_dtype = torch.float32 if out.dtype in LOW_PRECISION else out.dtype
    acc = parts[0].to(acc_dtype, copy=True)
    for part in parts[1:]:
        reduce_into(op, acc, part)
    finish_avg(op, acc, len(parts))
    out.copy_(acc.view_as(out))
