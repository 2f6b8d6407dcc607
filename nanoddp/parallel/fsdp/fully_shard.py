"""`fully_shard`: FSDP2's entry point, on DTensor parameters and our collectives.

Why the same signature as torch's: sharding you can drop in, FSDP2 code with
only its import changed must run, so every argument name, kind and default matches
`torch.distributed.fsdp.fully_shard`. nanoddp's own knobs (which collectives, learned
prefetch) are not arguments but `settings`, read when `fully_shard` is called.

One call takes the module's (or the list of modules') parameters not already taken by a
sharded submodule (nor in `ignored_params`), cuts each along dim 0 (or the dim
`shard_placement_fn` names) over the mesh's shard dimension (`ShardedParam`), groups them into
one unit for the collectives (`ShardedUnit`), and registers the hooks that gather, free and
reduce (`state`). Call it bottom-up: each block, then the root. What torch's FSDP2
refuses is refused here before anything changes, with torch's error type and message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from nanoddp.comm.api.backend import DEFAULT_COMM_BACKEND, check_comm_backend, collectives_for
from nanoddp.parallel.fsdp.mesh import MeshInfo, default_mesh
from nanoddp.parallel.fsdp.meta_init import install as _one_full_draw_per_random_init  # noqa: F401
from nanoddp.parallel.fsdp.module import FSDPModule, no_deepcopy
from nanoddp.parallel.fsdp.param import ShardedParam, check_shardable
from nanoddp.parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from nanoddp.parallel.fsdp.state import ModuleState, post_forward, pre_forward
from nanoddp.parallel.fsdp.unit import ShardedUnit

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
    returns `module`, now an `FSDP<Cls>` and an `FSDPModule` (ours, and torch's by `isinstance`).

    `module` may be a list of modules: one unit over all of their parameters, gathered at the
    first of them to run forward and resharded after the last (or at the root's post-forward
    when only some ran); the list comes back, each module sharing one state. Needs an outer
    `fully_shard` (the root); put tied parameters in one unit this way.

    Every rank must start from the same values (seed the init; or build on the meta device,
    shard, then `to_empty` and initialise). Build the optimizer afterwards: the registered
    parameters become new DTensor parameters. `reshard_after_forward`: None is True except for
    the root (the outermost call); False keeps the whole (plain tensor) parameters registered
    from forward until they are resharded; an int g must divide the shard size: 1 is False, the
    shard size is True, another g keeps the parameters spread over rows of g consecutive ranks
    after forward (1/g of them on each) and backward gathers within the row (torch's reshard
    to a smaller group, e.g. the ranks of a node); the shards stay the registered parameters.
    `shard_placement_fn` may return `Shard(d)` for any tensor dim (d > 0 must divide evenly).
    `offload_policy=CPUOffloadPolicy()` on a CPU mesh is the identity (everything is in CPU
    memory already). Refused as torch refuses them (its error types): a container without a
    forward, a module sharded twice, a 0-dim or non-contiguous parameter, a 2-D mesh without
    `mesh_dim_names`, a 3-D mesh; and, at the root's first forward (torch's lazy init), a
    parameter two `fully_shard` calls took (a tie across units). Not supported, a ValueError:
    `dp_mesh_dims`. `fully_shard.state(m)` is the state a call attached to `m` (None if none).
    """
    modules = _check_modules(module)
    if dp_mesh_dims is not None:
        raise ValueError("dp_mesh_dims (an SPMD mesh) is not supported: pass the data-parallel mesh")
    check_comm_backend(settings.comm_backend)
    mesh = mesh if mesh is not None else default_mesh()
    info = MeshInfo.of(mesh)
    reshard = _reshard_after_forward(reshard_after_forward, info.shard_size)
    if getattr(offload_policy, "pin_memory", None) is not None and mesh.device_type != "cpu":
        raise ValueError("CPUOffloadPolicy is only the identity on a CPU mesh; offloading is not implemented")
    params = _own_params(modules, {id(p) for p in ignored_params or ()})
    shards = [
        check_shardable(name, p, _placement(shard_placement_fn, p), info.shard_size) for name, p in params
    ]  # every refusal before anything changes
    sharded = [ShardedParam(p, info, _locations(modules, p), sh) for (_, p), sh in zip(params, shards, strict=True)]
    unit = ShardedUnit(sharded, info, collectives_for(settings.comm_backend), mp_policy) if sharded else None
    for sp in sharded:
        sp.register(unsharded=False)
    inner_roots = {  # by id: a unit over several modules is found once per module
        id(sub._fsdp_state.tree): sub._fsdp_state.tree
        for m in modules
        for sub in m.modules()
        if isinstance(sub, FSDPModule) and sub._fsdp_state.is_root()
    }.values()
    if unit is not None and not isinstance(reshard, bool) and isinstance(reshard, int):
        unit.post_forward_mesh = info.post_forward(reshard)
    state = ModuleState(modules, unit, mp_policy, None if reshard is None else bool(reshard))
    state.tree.learned_prefetch = settings.learned_prefetch
    for tree in inner_roots:
        state.tree.adopt(tree)
    for m in modules:
        _hook(m, state)
    logger.debug("fully_shard %s: %d params over %d ranks", modules, len(sharded), info.shard_size)
    return module


def _hook(module: Any, state: ModuleState) -> None:
    """Make `module` an `FSDP<Cls>` run by `state`: the class, the forward hooks, and the
    state_dict hooks that put the shards back first (as torch's do; after a forward with
    `reshard_after_forward=False` the whole tensors are registered)."""
    cls = module.__class__
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": no_deepcopy})
    module.__class__ = _fsdp_classes[cls]
    module._fsdp_state = state
    module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    module.register_forward_hook(post_forward, with_kwargs=True)
    unit = state.unit
    if unit is not None:  # load_state_dict(assign=True) replaces the registered shards
        module.register_state_dict_pre_hook(lambda *_: unit.reshard())
        module._register_load_state_dict_pre_hook(lambda *_: unit.reshard())
        module.register_load_state_dict_post_hook(unit.adopt_registered)


class AlreadyShardedError(AssertionError, ValueError):
    """`fully_shard` on a module it already sharded: torch's type (its composable-API check
    raises an AssertionError), and a ValueError as every other refused argument here is."""


def _check_modules(module) -> tuple[nn.Module, ...]:
    """The modules of one call, refused as torch refuses them."""
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # its hooks would never run: nothing calls a container's forward
            raise ValueError(f"fully_shard does not support containers that do not implement forward: {m}")
        if isinstance(m, FSDPModule):
            raise AlreadyShardedError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard has already been applied to the following module:\n{m}\n"
                f"{type(m).__name__} is already sharded: call fully_shard once per module"
            )
    return modules


def _reshard_after_forward(value: bool | int | None, shard_size: int) -> bool | int | None:
    """torch's rules for an int: a factor of the shard size; 1 means False, the size True, and
    another factor the size of the rows of ranks that hold the parameters after forward."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, not {value}"
        )
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            f"If passing reshard_after_forward as an int, it should be a factor of {shard_size}, not {value}"
        )
    if value == 1:
        logger.warning("reshard_after_forward=1 (int) means resharding parameters to world size 1, that is False")
        return False
    if value == shard_size:
        return True
    return value


def _state(module: nn.Module) -> ModuleState | None:
    """`fully_shard.state(module)`, torch's (its `contract` gives `fully_shard` this attribute):
    the state `fully_shard` attached to `module` (one for every module of a list), else None."""
    return module.__dict__.get("_fsdp_state")


fully_shard.state = _state  # type: ignore[attr-defined]


def _own_params(modules: tuple[nn.Module, ...], ignored: set[int]) -> list[tuple[str, nn.Parameter]]:
    """The parameters this call takes, by a name of each: those of `modules` not in a sharded
    submodule's unit nor ignored. A tied parameter another call took (registered outside its
    modules, so still the plain one) is taken again, and refused at the root's first forward,
    as torch does (`TreeState.lazy_init`)."""
    taken = {
        id(sp.sharded)
        for m in modules
        for sub in m.modules()
        if isinstance(sub, FSDPModule) and sub._fsdp_state.unit is not None
        for sp in sub._fsdp_state.unit.params
    }
    params: list[tuple[str, nn.Parameter]] = []  # names within their module: a list's may repeat
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) in taken or id(p) in ignored:
                continue
            taken.add(id(p))  # a parameter shared by two modules of the list is taken once
            params.append((name, p))
    return params


def _placement(shard_placement_fn: Callable[[nn.Parameter], ShardPlacementFnResult] | None, p: nn.Parameter) -> Shard:
    placement = shard_placement_fn(p) if shard_placement_fn is not None else None
    if placement is None:
        return Shard(0)
    if not isinstance(placement, Shard):
        raise ValueError(f"shard_placement_fn must return a Shard or None, got {placement!r}")
    return placement


def _locations(modules: tuple[nn.Module, ...], param: nn.Parameter) -> list[tuple[nn.Module, str]]:
    """Every (submodule, name) `param` is registered under (a tied one sits in several)."""
    subs = {id(sub): sub for m in modules for sub in m.modules()}.values()
    return [(sub, name) for sub in subs for name, p in sub._parameters.items() if p is param]
