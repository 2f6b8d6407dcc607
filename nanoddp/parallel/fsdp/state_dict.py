"""Whole <-> sharded: the one conversion between whole tensors and a rank's part of them.

Why one: snapshots, `model.pt` and `full_state_dict()` hold whole tensors, so that any world
size (or a plain model) can load them, while a sharded model holds only this rank's part. Two
cuts exist, and each is computed here and nowhere else:

- rows (FSDP, ours or torch's): a DTensor placed `Shard(d)` (on a 1-D mesh, or the shard dim
  of an HSDP mesh) holds the block torch's `DTensor` layout gives this rank, `torch.chunk`'s cut
  along d: `local_block` says where it is, `rows_of_whole` cuts it out of a whole tensor;
- pieces (ZeRO-2): a flat unit's piece is the element range [start, stop) of the flattened
  parameter (`FlatPiece`, from the unit's layout); `piece_of_whole` cuts it out.

The moves built on them:

- `full_state(module)`: every DTensor whole (collective; the inverse of the cuts for rows;
  ZeRO-2 gathers its flat units itself and passes the whole values in);
- `load_full_state(module, state)`: whole tensors in, each rank keeps its part (no comm);
- `shard_optimizer_state(optimizer)`: after loading whole optimizer state (saved at any world
  size) into an optimizer over DTensor parameters, every state tensor shaped like its whole
  parameter becomes a DTensor of this rank's rows; `rebind_optimizer` first moves an optimizer
  built before `fully_shard` (over the plain parameters it replaced) onto the new parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn as nn

from nanoddp.parallel.tensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement


class FlatPiece(NamedTuple):
    """A ZeRO-2 piece: elements [start, stop) of the flattened whole tensor of `shape`."""

    shape: torch.Size
    start: int
    stop: int


def local_block(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(size, offset) of this rank's block of a tensor of global `shape` placed on `mesh`.

    [Note: torch's cut] The block is what torch's DTensor gives this rank (`torch.chunk` along
    each sharded dim: ceil(size / n) slices per rank, the last ranks fewer or none), so our
    shards, torch's FSDP2 and `torch.distributed.checkpoint` agree on who holds which rows."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # [Note: DTensor on first use]

    size, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(size), tuple(offset)


def rows_of_whole(whole: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's block of `whole` (the global tensor) as a view: `narrow` along every cut dim."""
    size, offset = local_block(whole.shape, mesh, placements)
    block = whole
    for dim, (length, start) in enumerate(zip(size, offset, strict=True)):
        if length != whole.shape[dim]:
            block = block.narrow(dim, start, length)
    return block


def piece_of_whole(whole: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
    """This rank's ZeRO-2 piece of `whole`: a view of its elements [start, stop), (piece numel,)."""
    return whole.reshape(-1)[piece.start : piece.stop]


def rows_of(value: torch.Tensor, like: DTensor) -> DTensor:
    """`value` (whole, `like`'s global shape) cut to this rank's part, as a DTensor like `like`."""
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"whole tensor {tuple(value.shape)} does not match the sharded one {tuple(like.shape)}")
    local = rows_of_whole(value.to(like.device), like.device_mesh, like.placements).to(like.dtype).clone()
    from torch.distributed.tensor import DTensor  # [Note: DTensor on first use]

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _whole(value: Any) -> Any:
    return value.full_tensor() if is_dtensor(value) else value


def full_state(module: nn.Module, wholes: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded entry whole, as CPU copies. Collective.

    A DTensor is gathered (`full_tensor()`); a ZeRO-2 piece is looked up in `wholes`
    (id(piece) -> its whole tensor, which the flat units gathered)."""
    wholes = wholes or {}
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        whole = wholes[id(value)] if id(value) in wholes else _whole(value.detach())
        out[name] = whole.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def load_full_state(
    module: nn.Module, state: Mapping[str, torch.Tensor], pieces: Mapping[int, FlatPiece] | None = None
) -> None:
    """Load whole tensors (saved at any world size, or by a plain model): each rank copies its
    part in, no communication. A DTensor takes its rows; a ZeRO-2 piece (id(piece) -> its
    `FlatPiece` in `pieces`) its element range; anything else the whole value."""
    pieces = pieces or {}
    own = module.state_dict(keep_vars=True)
    if set(state) != set(own):
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"state dict keys differ from the module's: missing {missing}, unexpected {unexpected}")
    for name, target in own.items():
        value, piece = state[name], pieces.get(id(target))
        shape = piece.shape if piece is not None else target.shape
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{name}: state dict has shape {tuple(value.shape)}, the model {tuple(shape)}")
        if is_dtensor(target):
            target.to_local().copy_(rows_of_whole(value, target.device_mesh, target.placements))
        elif piece is not None:
            target.copy_(piece_of_whole(value, piece))
        else:
            target.copy_(value)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every plain state tensor shaped like its DTensor parameter becomes this rank's rows of it
    (scalars such as Adam's `step` stay as they are)."""
    for p in _params(optimizer):
        if not is_dtensor(p) or p not in optimizer.state:
            continue
        state = optimizer.state[p]
        for key, value in state.items():
            if torch.is_tensor(value) and not is_dtensor(value) and value.dim() > 0:
                state[key] = rows_of(value, p)


def rebind_optimizer(optimizer: torch.optim.Optimizer, new_params: dict[int, nn.Parameter]) -> None:
    """Point `optimizer` at the parameters that replaced its own (`id(old) -> new`), moving
    their state along and cutting it to this rank's rows. Parameters not in the map stay."""
    for group in optimizer.param_groups:
        for i, old in enumerate(group["params"]):
            new = new_params.get(id(old))
            if new is None or new is old:
                continue
            group["params"][i] = new
            if old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)
    shard_optimizer_state(optimizer)
