"""Random init of a sharded DTensor on a CPU mesh: every rank keeps its part of ONE full draw.

Why: the FSDP recipe builds the model on the meta device, shards it, then `to_empty` and
`reset_parameters()` (or `nn.init.*_` on the DTensor parameters). On CUDA, torch's DTensor
gives each shard its own offset in one random stream. On a CPU mesh it has no such tracker
(`torch.distributed.tensor._random.is_rng_supported_mesh` is False): the in-place random op runs
on each rank's local shard from the same generator state, so every rank draws the same rows and
the full weight is one shard repeated (at 2 ranks, one half twice).

Here, for those ops on a CPU mesh, every rank draws the whole tensor with the generator (seeded
the same everywhere, as `fully_shard` asks) and copies out its own rows: `full_tensor()` is then
bitwise what the unsharded model's init gives, and the generator has advanced by the same amount
on every rank, so the next parameter's draw matches too. It costs one full-size temporary per
parameter while it is initialised, no communication.

The seam is DTensor's own op dispatcher: a handler per random in-place aten op
(`DTensor._op_dispatcher._custom_op_handlers`, the table torch fills for its own special ops).
It applies to every DTensor on a CPU mesh (torch's FSDP2 in this process included, which then
agrees with ours); other meshes and placements take torch's path unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from nanoddp.parallel.fsdp.state_dict import local_block, rows_of_whole

aten = torch.ops.aten

RANDOM_FILLS = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.random_.default,
    getattr(aten.random_, "from"),  # `from` is a Python keyword
    aten.random_.to,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
)
_TORCH_PATH = threading.Lock()  # held while the handler is out of the table for torch's own path


def _whole_draw_applies(target: Any) -> bool:
    """A DTensor with real storage on a CPU mesh, placed by Shard and Replicate only."""
    if not isinstance(target, DTensor):
        return False
    if target.device_mesh.device_type != "cpu" or target._local_tensor.device.type == "meta":
        return False
    return all(type(p) in (Shard, Replicate) for p in target.placements)


def fill_whole_then_keep_rows(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> Any:
    """DTensor handler of a random in-place `op_call`: draw the full tensor, keep this rank's part."""
    target: Any = args[0]
    if not _whole_draw_applies(target):
        return _torch_path(op_call, args, kwargs)
    local = target._local_tensor
    mesh, placements = target.device_mesh, target.placements
    size, _ = local_block(target.shape, mesh, placements)
    if size != tuple(local.shape):  # a layout torch's chunking does not describe
        return _torch_path(op_call, args, kwargs)
    full = torch.empty(target.shape, dtype=local.dtype, device=local.device)  # (*global shape)
    op_call(full, *args[1:], **kwargs)  # the same generator state on every rank: the same full tensor
    local.copy_(rows_of_whole(full, mesh, placements))  # (*local shape)
    return target


def _torch_path(op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    """torch's own dispatch for a call this handler does not take (a CUDA mesh: torch's RNG
    tracker; a meta shard; another placement): the handler steps out of the table meanwhile."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _TORCH_PATH:
        handlers.pop(op_call, None)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = fill_whole_then_keep_rows


def install() -> None:
    """Register the handler for every random in-place op (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in RANDOM_FILLS:
        handlers.setdefault(op, fill_whole_then_keep_rows)


install()
