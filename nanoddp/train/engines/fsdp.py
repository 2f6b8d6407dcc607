"""The `fsdp` engine: how a model becomes FSDP units, at which precision, and how the optimizer
built before that follows it.

Unlike the other engines this one replaces the model's parameters (`nanoddp.fsdp.fully_shard`
registers new DTensor parameters), so three things happen before resume and before `build`,
in `FSDPEngine.prepare`: every rank takes rank 0's values, the model is sharded unit by unit
(`parallel.fsdp.auto_wrap` picks the units, `--fsdp-wrap` overrides), and the optimizer (built
over the old parameters) is moved onto the new ones. Mixed precision is FSDP's own: the units
all-gather and compute in bf16/fp16 (`MixedPrecisionPolicy.param_dtype`) and reduce gradients
in float32, so the sharded parameters, gradients and optimizer stay float32.

A model the user sharded already (ours or torch's `fully_shard`) is used as is with
`engine="fsdp"` (and refused by every other engine: `Engine.prepare`).

`HSDPEngine` (`--engine hsdp`) is the same engine on a 2-D mesh: FSDP inside a replica group
of `--group-size` consecutive ranks (default: the ranks of one node, so each host is a group
and the all-gathers stay on the host), plain replicas across groups (gradient shards
all-reduced over the groups after the reduce-scatter). Only the mesh differs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPEngine(Engine):
    """A model sharded per unit, then the root: forward all-gathers each unit's parameters,
    backward reduce-scatters its gradients."""

    name = "fsdp"
    help = "FSDP: parameters sharded too, per block"
    sharded = True

    @classmethod
    def build(cls, module: nn.Module, env: DistEnv) -> Engine:
        """A model sharded already (by `prepare`, or the user's own `fully_shard`) as is; a
        plain one sharded by the default auto-wrap rule, then the root."""
        from nanoddp.parallel.detect import sharded_by

        if sharded_by(module) != "fsdp":
            shard_model(module, env, mesh=cls.mesh_for(env, None))
        return cls(cls.name, module, module)

    @classmethod
    def mesh_for(cls, env: DistEnv, group_size: int | None) -> DeviceMesh | None:
        """The mesh to shard over: None, every rank of the default group (`fully_shard`'s default)."""
        return None

    @classmethod
    def prepare(cls, module: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, config: Any) -> None:
        """Shard a plain model in place and move `optimizer` onto its new parameters."""
        from nanoddp.parallel.detect import sharded_by
        from nanoddp.parallel.fsdp.state_dict import rebind_optimizer

        super().prepare(module, optimizer, env, config)
        if sharded_by(module) is None:
            names = {id(p): name for name, p in module.named_parameters()}
            mesh = cls.mesh_for(env, getattr(config, "group_size", None))
            shard_model(module, env, config.fsdp_wrap, config.amp, mesh)
            new = dict(module.named_parameters())
            rebind_optimizer(optimizer, {i: new[name] for i, name in names.items()})
        own = {id(p) for p in module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds parameters the sharded model does not have: build it over "
                "model.parameters() after fully_shard"
            )

    def cross_replica_grads(self) -> list[torch.Tensor]:
        """Each DTensor gradient's local shard (hsdp: averaged within the replica group only when
        its mesh has one group, the fault-tolerant shape; its replicate all-reduce is the
        cross-group sum)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return [(g.to_local() if isinstance(g, DTensor) else g).view(-1) for g in grads]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every DTensor whole (nanoddp's fully_shard or torch's; collective: call on every rank)."""
        from nanoddp.parallel.fsdp.state_dict import full_state

        return full_state(self.module)


class HSDPEngine(FSDPEngine):
    """FSDP within each replica group of `group_size` consecutive ranks, replicated across groups."""

    name = "hsdp"
    help = "HSDP: fsdp within each replica group (--group-size ranks, default a node), replicas across"

    @classmethod
    def mesh_for(cls, env: DistEnv, group_size: int | None) -> DeviceMesh:
        """The 2-D mesh (replica groups, ranks per group): row g holds ranks g*G .. g*G+G-1, so a
        group is one node's ranks when G is the processes per node (torchrun numbers a node's
        ranks consecutively). Collective: every rank builds every group."""
        from torch.distributed.device_mesh import DeviceMesh

        size = group_size or env.local_world_size
        check_group_size(size, env.world_size)
        rows = torch.arange(env.world_size).reshape(-1, size)  # (replica groups, group_size)
        return DeviceMesh(env.device.type, rows, mesh_dim_names=("replicate", "shard"))


def check_group_size(group_size: int, world_size: int) -> None:
    """`--group-size` must cut the world into equal replica groups."""
    if group_size < 1 or world_size % group_size:
        raise ValueError(
            f"--group-size {group_size} (ranks per replica group) must divide the world size {world_size} "
            f"into equal groups; use a divisor of {world_size}, e.g. the processes per node"
        )


def mp_policy(amp: str):
    """FSDP's mixed precision for `--amp`: compute in the half dtype, reduce in float32."""
    from nanoddp.parallel.fsdp.policies import MixedPrecisionPolicy

    if amp == "off":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=AMP_DTYPES[amp], reduce_dtype=torch.float32)


def shard_model(
    module: nn.Module, env: DistEnv, wrap: str = "", amp: str = "off", mesh: DeviceMesh | None = None
) -> nn.Module:
    """Rank 0's values everywhere, then `fully_shard` on each unit `auto_wrap` picks, then the
    root, over `mesh` (default: every rank, 1-D; a 2-D mesh is HSDP)."""
    from nanoddp.parallel.fsdp.auto_wrap import modules_to_shard
    from nanoddp.parallel.fsdp.fully_shard import fully_shard
    from nanoddp.parallel.replicas import broadcast_rank0_weights

    broadcast_rank0_weights(module)
    units = modules_to_shard(module, wrap)
    policy = mp_policy(amp)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    if env.is_master:
        logger.debug("fsdp: %d units (%s) and the root", len(units), sorted({type(u).__name__ for u in units}))
    return module


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole model's state into `module`, sharded (each rank keeps its rows) or not."""
    from nanoddp.parallel.detect import sharded_by

    if sharded_by(module) == "fsdp":
        from nanoddp.parallel.fsdp.state_dict import load_full_state

        load_full_state(module, state)
    else:
        module.load_state_dict(state)
