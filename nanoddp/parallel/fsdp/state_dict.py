"""Whole tensors in and out of DTensor-sharded models and their optimizers (FSDP, ours or torch's).

Why: the Trainer's snapshots and model.pt hold whole tensors, so that any world size (or a
plain model) can load them, while an FSDP model's parameters and its optimizer's state are
DTensors holding this rank's rows (Shard(0), cut as `torch.chunk` cuts). Three moves:

- `full_state(module)`: every DTensor whole (collective);
- `load_full_state(module, state)`: whole tensors in, each rank keeps its rows (no comm);
- `shard_optimizer_state(optimizer)`: after loading whole optimizer state (saved at any world
  size) into an optimizer over DTensor parameters, every state tensor shaped like its whole
  parameter becomes a DTensor of this rank's rows; `rebind_optimizer` first moves an optimizer
  built before `fully_shard` (over the plain parameters it replaced) onto the new parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every DTensor whole, as CPU copies. Collective."""
    return {k: _whole(v).detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def rows_of(value: torch.Tensor, like: DTensor) -> DTensor:
    """`value` (whole, `like`'s global shape) cut to this rank's part, as a DTensor like `like`."""
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"whole tensor {tuple(value.shape)} does not match the sharded one {tuple(like.shape)}")
    local_shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    local = value.to(like.device)[offset[0] : offset[0] + local_shape[0]].to(like.dtype).clone()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


@torch.no_grad()
def load_full_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (saved at any world size, or by a plain model): each rank copies its rows."""
    own = module.state_dict(keep_vars=True)
    if set(state) != set(own):
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"state dict keys differ from the module's: missing {missing}, unexpected {unexpected}")
    for name, target in own.items():
        value = state[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name}: state dict has shape {tuple(value.shape)}, the model {tuple(target.shape)}")
        if isinstance(target, DTensor):
            target.to_local().copy_(rows_of(value, target).to_local())
        else:
            target.copy_(value)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every plain state tensor shaped like its DTensor parameter becomes this rank's rows of it
    (scalars such as Adam's `step` stay as they are)."""
    for p in _params(optimizer):
        if not isinstance(p, DTensor) or p not in optimizer.state:
            continue
        state = optimizer.state[p]
        for key, value in state.items():
            if torch.is_tensor(value) and not isinstance(value, DTensor) and value.dim() > 0:
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
