"""`fully_shard`: FSDP2's entry point, on DTensor parameters and our collectives.

Why the same signature as torch's: the issue is "sharding you can drop in": FSDP2 code with
only its import changed must run, so every argument name, kind and default matches
`torch.distributed.fsdp.fully_shard`. nanoddp's own knobs (which collectives, learned
prefetch) are not arguments but `settings`, read when `fully_shard` is called.

One call takes the module's parameters not already taken by a sharded submodule (nor in
`ignored_params`), cuts each along dim 0 over the mesh's shard dimension (`ShardedParam`),
groups them into one unit for the collectives (`ShardedUnit`), and registers the hooks that
gather, free and reduce (`fsdp_state`). Call it bottom-up: each block, then the root.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from nanoddp.comm.backend import DEFAULT_COMM_BACKEND, check_comm_backend, collectives_for
from nanoddp.parallel.sharded.fsdp_module import FSDPModule
from nanoddp.parallel.sharded.fsdp_param import ShardedParam
from nanoddp.parallel.sharded.fsdp_state import ModuleState, post_forward, pre_forward
from nanoddp.parallel.sharded.fsdp_unit import ShardedUnit
from nanoddp.parallel.sharded.mesh import MeshInfo, default_mesh
from nanoddp.parallel.sharded.meta_init import install as _one_full_draw_per_random_init  # noqa: F401
from nanoddp.parallel.sharded.policies import MixedPrecisionPolicy, OffloadPolicy

if TYPE_CHECKING:
    from torch.distributed.fsdp import DataParallelMeshDims

logger = logging.getLogger(__name__)
ShardPlacementFnResult = Shard | None  # what a shard_placement_fn may return here


@dataclass
class FSDPSettings:
    """nanoddp's knobs for the `fully_shard` calls that follow (the signature stays torch's).

    `comm_backend`: "nanoddp" (our collectives over point-to-point) or "torch".
    `learned_prefetch`: from the second step, launch the next unit's all-gather before this one
    computes, in the order the first step ran (explicit `set_modules_to_*_prefetch` wins).
    """

    comm_backend: str = DEFAULT_COMM_BACKEND
    learned_prefetch: bool = True


settings = FSDPSettings()
_DEFAULT_MP = MixedPrecisionPolicy()  # torch's defaults, built once (the signature shows them)
_DEFAULT_OFFLOAD = OffloadPolicy()
_fsdp_classes: dict[type, type] = {}


def fully_shard(
    module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacementFnResult] | None = None,
    mp_policy: MixedPrecisionPolicy = _DEFAULT_MP,
    offload_policy: OffloadPolicy = _DEFAULT_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
    """Shard `module`'s own parameters over `mesh` (default: every rank, 1-D). In place;
    returns `module`, now an `FSDP<Cls>` and an `FSDPModule`.

    Every rank must start from the same values (seed the init; or build on the meta device,
    shard, then `to_empty` and initialise). Build the optimizer afterwards: the registered
    parameters become new DTensor parameters. `reshard_after_forward`: None is True except for
    the root (the outermost call). `offload_policy=CPUOffloadPolicy()` on a CPU mesh is the
    identity (everything is in CPU memory already). Not supported, refused with a ValueError:
    a list of modules, an int `reshard_after_forward`, placements other than Shard(0),
    `dp_mesh_dims`.
    """
    if isinstance(module, (list, tuple)):
        raise ValueError("fully_shard of a list of modules is not supported: shard each module")
    if isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is already sharded: call fully_shard once per module")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be a bool or None, got {reshard_after_forward!r}")
    if dp_mesh_dims is not None:
        raise ValueError("dp_mesh_dims (an SPMD mesh) is not supported: pass the data-parallel mesh")
    check_comm_backend(settings.comm_backend)
    mesh = mesh if mesh is not None else default_mesh()
    if getattr(offload_policy, "pin_memory", None) is not None and mesh.device_type != "cpu":
        raise ValueError("CPUOffloadPolicy is only the identity on a CPU mesh; offloading is not implemented")
    info = MeshInfo.of(mesh)
    ignored = {id(p) for p in ignored_params or ()}
    taken = {
        id(sp.sharded)
        for sub in module.modules()
        if isinstance(sub, FSDPModule) and sub._fsdp_state.unit is not None
        for sp in sub._fsdp_state.unit.params
    }
    params = [p for p in module.parameters() if id(p) not in taken and id(p) not in ignored]
    for p in params:
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and placement != Shard(0):
            raise ValueError(f"only Shard(0) placements are supported, shard_placement_fn gave {placement}")
    sharded = [ShardedParam(p, info, _locations(module, p)) for p in params]
    unit = ShardedUnit(sharded, info, collectives_for(settings.comm_backend), mp_policy) if sharded else None
    for sp in sharded:
        sp.register(unsharded=False)
    inner_roots = [
        sub._fsdp_state.tree for sub in module.modules() if isinstance(sub, FSDPModule) and sub._fsdp_state.is_root()
    ]
    cls = module.__class__
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _fsdp_classes[cls]
    state = ModuleState(module, unit, mp_policy, reshard_after_forward)
    state.tree.learned_prefetch = settings.learned_prefetch
    for tree in inner_roots:
        state.tree.adopt(tree)
    module._fsdp_state = state
    module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    module.register_forward_hook(post_forward, with_kwargs=True)
    if unit is not None:  # load_state_dict(assign=True) replaces the registered shards
        module.register_load_state_dict_post_hook(unit.adopt_registered)
    logger.debug("fully_shard %s: %d params over %d ranks", cls.__name__, len(sharded), info.shard_size)
    return module


def _locations(module: nn.Module, param: nn.Parameter) -> list[tuple[nn.Module, str]]:
    """Every (submodule, name) `param` is registered under (a tied one sits in several)."""
    return [(sub, name) for sub in module.modules() for name, p in sub._parameters.items() if p is param]
