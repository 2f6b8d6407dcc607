"""`nanoddp.clip_grad_norm_`: clip by the norm of the whole gradient, however it is held.

Why our own: torch's `clip_grad_norm_` computes the norm of the tensors it is given. That is the
global norm for replicated gradients (plain modules, DDP: every rank holds the whole averaged
gradient) and for DTensor gradients (FSDP: DTensor reduces the norm over the mesh), but not for
ZeRO-2's: each rank holds 1-D pieces of the flat gradient as plain tensors, so torch's function
would clip every rank by the norm of its own pieces, a different factor on each. Here each kind
contributes its part of the norm: replicated gradients as they are, DTensors reduced over their
mesh, ZeRO-2 pieces summed over their group; one total is then the same on every rank, and every
gradient is scaled by the same factor.

torch's own `clip_grad_norm_` on a ZeRO-2 model is refused, not wrong: after backward, `zero2`
hands each piece its gradient as a `ShardPieceGrad`, which raises on a norm (it would be the
norm of this rank's piece) and behaves as a plain tensor for every other operation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from nanoddp.comm.api.backend import Collectives
from nanoddp.parallel.tensors import is_dtensor

# ZeRO-2's shard pieces -> (their group, the collectives that reduce over it); filled by `zero2`.
# By identity: a tensor's `==` compares elements.
PIECE_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()

PIECE_NORM_REFUSED = (
    "the gradient of a ZeRO-2 parameter is this rank's piece of it, so its norm is not the "
    "gradient's and torch.nn.utils.clip_grad_norm_ would clip each rank by a different factor: "
    "use nanoddp.clip_grad_norm_(model, max_norm), which takes the norm over every rank's pieces"
)
_NORMS = {
    torch._foreach_norm,
    torch.linalg.vector_norm,
    torch.linalg.norm,
    torch.norm,
    torch.Tensor.norm,
    torch.nn.utils.get_total_norm,
}


class ShardPieceGrad(torch.Tensor):
    """A ZeRO-2 piece's gradient: a plain tensor for every operation but a norm, which raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _NORMS:
            raise RuntimeError(PIECE_NORM_REFUSED)
        with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors
            return func(*args, **(kwargs or {}))


def mark_piece_grads(params: Iterable[torch.Tensor]) -> None:
    """Hand each ZeRO-2 piece's plain gradient over as a `ShardPieceGrad` (same storage)."""
    for p in params:
        if p.grad is not None and type(p.grad) is torch.Tensor:
            p.grad = p.grad.as_subclass(ShardPieceGrad)


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch's `clip_grad_norm_` over the whole gradient: plain, DDP (ours or torch's), ZeRO-2
    and DTensor (FSDP) parameters; returns the total norm (a plain tensor, equal on every rank).

    Collective where gradients are sharded (ZeRO-2, DTensor): call it on every rank."""
    params: list[torch.Tensor]
    if isinstance(model_or_params, nn.Module):
        params = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    with torch._C.DisableTorchFunctionSubclass():  # ShardPieceGrad's refusal is for torch's clip
        total = total_norm(params, float(norm_type), foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's factor, no host sync
        grads = [p.grad for p in params if p.grad is not None]
        plain = [g.to_local() if is_dtensor(g) else g for g in grads]  # scale this rank's part
        for device in {g.device for g in plain}:
            torch._foreach_mul_([g for g in plain if g.device == device], scale.to(device))
    return total


def total_norm(params: list[torch.Tensor], norm_type: float, foreach: bool | None = None) -> torch.Tensor:
    """The norm of the concatenation of every gradient of `params`, over ranks where sharded."""
    replicated: list[torch.Tensor] = []
    dtensors: list[torch.Tensor] = []
    pieces: dict[Any, tuple[Collectives, list[torch.Tensor]]] = {}
    for p in params:
        if p.grad is None:
            continue
        if is_dtensor(p.grad):
            dtensors.append(p.grad)
        elif p in PIECE_GROUPS:
            group, collectives = PIECE_GROUPS[p]
            pieces.setdefault(group, (collectives, []))[1].append(p.grad)
        else:
            replicated.append(p.grad)
    parts = []
    if replicated:  # torch's own arithmetic, so a plain model gets torch's bits
        parts.append(torch.nn.utils.get_total_norm(replicated, norm_type, False, foreach))
    if dtensors:  # DTensor reduces the per-shard norms over the mesh
        norm = torch.nn.utils.get_total_norm(dtensors, norm_type, False, foreach)
        parts.append(norm.full_tensor() if is_dtensor(norm) else norm)
    for group, (collectives, grads) in pieces.items():
        parts.append(_pieces_norm(grads, norm_type, group, collectives))
    if not parts:
        return torch.tensor(0.0)
    if len(parts) == 1:
        return parts[0]
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([part.to(device, torch.float32) for part in parts]), norm_type)


def _pieces_norm(grads: list[torch.Tensor], norm_type: float, group, collectives: Collectives) -> torch.Tensor:
    """The norm of ZeRO-2 gradients from every rank's pieces: |g|^p summed (max for inf) over ranks."""
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        if g.numel() == 0:  # this rank holds none of that parameter
            continue
        if math.isinf(norm_type):
            local = torch.maximum(local, g.detach().float().abs().max())
        else:
            local += g.detach().float().abs().pow(norm_type).sum()
    if dist.is_initialized():
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        collectives.all_reduce(local, op=op, group=group)
    return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
