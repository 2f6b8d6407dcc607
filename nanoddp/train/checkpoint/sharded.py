"""Sharded objects in `save_state`/`load_state`: what each rank saves of them, and what each rank
loads back at any world size.

Why this exists: a sharded model or optimizer differs on every rank, so rank 0's state_dict is
half of it; loaded on every rank it hands one rank the other's half, silently. Here each rank
saves its own pieces (`shard_files`), the manifest says where each piece lies in the whole
tensor (`pieces`), and each loading rank computes its own pieces from that.

The kinds (decided alike on every rank, from the objects alone):
- "sharded_module": a module with DTensor parameters (`fully_shard`, torch's or ours) or flat
  units (`zero2`): sharded entries go to the rank files, the rest
  (buffers, unsharded parameters) whole into the manifest, from rank 0;
- "sharded_optim": a plain torch optimizer over such parameters: its state tensors shaped
  like the parameter's piece are sharded entries; the rest (`step`, hyperparameters) stays in
  each rank's file. Flat pieces are recognised through the modules passed in the same call;
- "zero1": our `ZeroRedundancyOptimizer`: its own `sharded_state_dict()` per rank; at another
  world size every rank glues all shards into the full state and `load_state_dict`s it;
- "replica_optim": a `nanoddp.LocalSGD`/`DiLoCo` wrapper: its `state_dict()` per rank, in the
  same place zero1 keeps its shard. Between syncs each rank's replica is its own, so the model
  it steps is saved per rank too: a "sharded_module" whose every tensor is one whole piece per
  rank (`replica_registry`). Each rank loads back its own replica; at another world size rank r
  takes saved replica r, and ranks the save did not have take rank 0's.

A whole state (a replicated engine's model or optimizer) loads into a sharded object as a
one-rank save would: every rank cuts its own pieces from it (`whole_optimizer_layout`).

Loading is two steps, `prepare` (read and compute, touching nothing) then `apply`, so that
`user_state` can make every rank agree that all were prepared before any object changes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from nanoddp.parallel.fsdp.state_dict import FlatPiece
from nanoddp.parallel.lowcomm.periodic import PeriodicSync
from nanoddp.parallel.tensors import is_dtensor
from nanoddp.parallel.zero.flat import FlatParamUnit
from nanoddp.parallel.zero.partition import assemble_state
from nanoddp.parallel.zero.sharded_module import flat_pieces
from nanoddp.parallel.zero.stage1 import SHARD_KEY, ZeroRedundancyOptimizer
from nanoddp.train.checkpoint import shard_pieces
from nanoddp.train.checkpoint.shard_files import ShardReader

KINDS = ("sharded_module", "sharded_optim", "zero1", "replica_optim")
PER_RANK_STATE = ("zero1", "replica_optim")  # the whole object's own state_dict in each rank's file
# id(parameter) -> (whole shape, start, stop): a flat unit's piece, elements [start, stop) of the parameter
Registry = dict[int, FlatPiece]


def flat_registry(modules: list[nn.Module]) -> Registry:
    """Every flat-unit parameter piece of `modules` (already unwrapped), by identity."""
    found: Registry = {}
    for module in modules:
        units = getattr(module, "_units", None)
        found.update(flat_pieces([u for u in (units() if callable(units) else ()) if isinstance(u, FlatParamUnit)]))
    return found


def replica_registry(objects: list[Any], modules: list[nn.Module]) -> Registry:
    """Every tensor of the `modules` whose parameters a LocalSGD/DiLoCo among `objects` steps,
    as a piece holding all of it: between syncs each rank's replica is its own, so each rank
    saves its whole state as its piece (buffers too: nothing averages them)."""
    stepped = {id(p) for obj in objects if isinstance(obj, PeriodicSync) for p in _params(obj)}
    found: Registry = {}
    for module in modules:
        if stepped.isdisjoint(id(p) for p in module.parameters()):
            continue
        for value in module.state_dict(keep_vars=True).values():
            if torch.is_tensor(value) and not is_dtensor(value):
                found[id(value)] = FlatPiece(value.shape, 0, value.numel())
    return found


def kind_of(obj: Any, module: nn.Module | None, registry: Registry) -> str | None:
    """The sharded kind of `obj` (`module`: it unwrapped, when it is one), None if not sharded."""
    if isinstance(obj, ZeroRedundancyOptimizer):
        return "zero1"
    if isinstance(obj, PeriodicSync):
        return "replica_optim"
    if module is not None:
        values = module.state_dict(keep_vars=True).values()
        return "sharded_module" if any(_is_piece(v, registry) for v in values) else None
    if isinstance(obj, torch.optim.Optimizer):
        params = _params(obj)
        return "sharded_optim" if any(_is_piece(p, registry) for p in params) else None
    return None


def shapes(objects: dict[str, Any], modules: dict[str, nn.Module], kinds: dict[str, str]) -> dict[str, list]:
    """Tensor shapes of the modules and optimizers saved whole, from rank 0: compared across
    ranks, as what differs is sharded by something not recognised here (rank 0's is half of it)."""
    out = {}
    for name, obj in objects.items():
        if kinds[name] == "module":
            out[name] = [tuple(v.shape) for v in modules[name].state_dict().values() if torch.is_tensor(v)]
        elif kinds[name] == "stateful" and isinstance(obj, torch.optim.Optimizer):
            out[name] = [tuple(p.shape) for p in _params(obj)]
    return out


def _is_piece(t: Any, registry: Registry) -> bool:
    return is_dtensor(t) or id(t) in registry


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in `state_dict()` index order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _piece_of(where: str, t: torch.Tensor, registry: Registry) -> tuple[shard_pieces.Piece, tuple[int, ...]]:
    """(this rank's piece, whole shape) of tensor `t`: a DTensor's, a flat piece's, or all of a plain one."""
    if is_dtensor(t):
        return shard_pieces.dtensor_piece(t, where), tuple(t.shape)
    if id(t) in registry:
        shape, start, stop = registry[id(t)]
        return ("range", start, stop), shape
    return shard_pieces.whole_piece(tuple(t.shape)), tuple(t.shape)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if is_dtensor(t) else t
    return local.detach().to("cpu", copy=True)


# --- saving ------------------------------------------------------------------------------------


def capture(name: str, obj: Any, module: nn.Module | None, kind: str, registry: Registry, is_master: bool):
    """(this rank's file part, this rank's pieces {key: piece}, the manifest's layout; None off rank 0)."""
    if kind in PER_RANK_STATE:
        own = obj.sharded_state_dict() if kind == "zero1" else obj.state_dict()
        return {"rest": own}, {}, ({} if is_master else None)
    # keyed by state_dict key (a sharded module) or (parameter index, state key) (an optimizer)
    tensors: dict[str | tuple[int, str], torch.Tensor] = {}
    found: dict[str | tuple[int, str], Any] = {}
    specs: dict[str | tuple[int, str], dict[str, Any]] = {}
    whole: dict[str, torch.Tensor] = {}
    if kind == "sharded_module":
        assert module is not None  # a sharded module's kind comes with its module
        for key, value in module.state_dict(keep_vars=True).items():
            if _is_piece(value, registry):
                found[key], shape = _piece_of(f"{name}: {key}", value, registry)
                tensors[key], specs[key] = _cpu(value), {"shape": shape, "dtype": value.dtype}
            elif is_master:
                whole[key] = _cpu(value)
        return {"tensors": tensors}, found, ({"specs": specs, "whole": whole} if is_master else None)
    state_dict = obj.state_dict()
    params = _params(obj)
    rest = {"state": {}, "param_groups": state_dict["param_groups"]}
    for i, state in state_dict["state"].items():
        p, kept = params[i], {}
        for key, value in state.items():
            if torch.is_tensor(value) and _state_is_piece(value, p, registry):
                of = value if is_dtensor(value) else p
                piece, shape = _piece_of(f"{name}: parameter #{i} {key!r}", of, registry)
                found[(i, key)], tensors[(i, key)] = piece, _cpu(value)
                specs[(i, key)] = {"shape": shape, "dtype": value.dtype}
            else:
                kept[key] = value
        rest["state"][i] = kept
    return {"tensors": tensors, "rest": rest}, found, ({"specs": specs} if is_master else None)


def _state_is_piece(value: torch.Tensor, p: torch.Tensor, registry: Registry) -> bool:
    """A state tensor sharded like its parameter: a DTensor, or one shaped like a flat piece."""
    if is_dtensor(value):
        return True
    return id(p) in registry and not is_dtensor(p) and value.shape == p.shape


def merge(name: str, layout: dict[str, Any], per_rank: list[dict[Any, shard_pieces.Piece]]) -> None:
    """Rank 0: put every rank's pieces into the layout (ValueError if ranks disagree on what is sharded)."""
    if "specs" not in layout:  # zero1: its shards describe themselves
        return
    keys = [set(found) for found in per_rank]
    if any(k != keys[0] for k in keys):
        differ = sorted(map(str, set.union(*keys) - set.intersection(*keys)))[:5]
        raise ValueError(f"save_state: {name} has sharded entries on some ranks only ({differ}): ranks disagree")
    for key, spec in layout["specs"].items():
        spec["pieces"] = [found[key] for found in per_rank]


# --- loading -----------------------------------------------------------------------------------


def prepare(name: str, obj: Any, module: nn.Module | None, kind: str, layout: dict[str, Any], ctx: dict) -> Any:
    """What `apply` will load into `obj` on this rank, read from the shard files; changes nothing.

    `ctx`: reader (ShardReader), registry, rank, world_size, saved_world_size.
    """
    reader: ShardReader = ctx["reader"]
    rank, same_size = ctx["rank"], ctx["world_size"] == ctx["saved_world_size"]
    if kind == "replica_optim":
        if not isinstance(obj, PeriodicSync):
            raise ValueError(f"load_state: {name} was saved by nanoddp.LocalSGD or DiLoCo; pass one to load it")
        return reader.get(rank if rank < ctx["saved_world_size"] else 0)[name]["rest"]
    if kind == "zero1":
        if not isinstance(obj, ZeroRedundancyOptimizer):
            raise ValueError(f"load_state: {name} was saved by a ZeroRedundancyOptimizer; pass one to load it")
        if same_size:
            return ("sharded", reader.get(rank)[name]["rest"])
        return ("full", _glue_zero1(name, obj, [reader.get(r)[name]["rest"] for r in range(ctx["saved_world_size"])]))

    def read(key):
        return lambda r: reader.get(r)[name]["tensors"][key]

    if kind == "sharded_module":
        if module is None:
            raise ValueError(f"load_state: {name} was saved from a sharded module; pass a module to load it")
        own = module.state_dict(keep_vars=True)
        saved_keys = set(layout["specs"]) | set(layout["whole"])
        if saved_keys != set(own):
            missing, unexpected = sorted(set(own) - saved_keys)[:5], sorted(saved_keys - set(own))[:5]
            raise ValueError(f"load_state: {name}: saved keys differ: missing {missing}, unexpected {unexpected}")
        out = {}
        for key, target in own.items():
            spec, reading = layout["specs"].get(key), read(key)
            if spec is None:  # saved whole: one "rank" holding all of it
                value = layout["whole"][key]
                spec = {
                    "shape": tuple(value.shape),
                    "dtype": value.dtype,
                    "pieces": [shard_pieces.whole_piece(value.shape)],
                }
                reading = lambda r, value=value: value  # noqa: E731
            out[key] = _load_piece(f"{name}: {key}", spec, target, reading, ctx)
        return out
    if not isinstance(obj, torch.optim.Optimizer):
        raise ValueError(f"load_state: {name} was saved from a torch optimizer over sharded parameters; pass one")
    params = _params(obj)
    rest = copy.deepcopy(layout["rest"] if "rest" in layout else reader.get(rank if same_size else 0)[name]["rest"])
    for (i, key), spec in layout["specs"].items():
        if i >= len(params):
            raise ValueError(f"load_state: {name} was saved with more parameters than it has ({len(params)})")
        where = f"{name}: parameter #{i} {key!r}"
        reading = (lambda r, v=layout["whole"][(i, key)]: v) if "rest" in layout else read((i, key))
        rest["state"].setdefault(i, {})[key] = _load_piece(where, spec, params[i], reading, ctx)
    return rest


def whole_optimizer_layout(state_dict: dict[str, Any], obj: torch.optim.Optimizer, registry: Registry) -> dict:
    """A whole optimizer state_dict (saved from a replicated model) as the layout of a sharded
    optimizer: each state tensor shaped like its whole parameter is one piece holding all of
    it, so every rank cuts its own piece, as from a one-rank save. `prepare` takes the rest
    (`step`, hyperparameters) from the layout instead of a shard file."""
    params = _params(obj)
    rest: dict[str, Any] = {"state": {}, "param_groups": state_dict["param_groups"]}
    specs, whole = {}, {}
    for i, state in state_dict["state"].items():
        shape = _piece_of(f"parameter #{i}", params[i], registry)[1] if i < len(params) else None
        rest["state"][i] = {}
        for key, value in state.items():
            if shape is not None and torch.is_tensor(value) and tuple(value.shape) == shape and value.dim() > 0:
                specs[(i, key)] = {"shape": shape, "dtype": value.dtype, "pieces": [shard_pieces.whole_piece(shape)]}
                whole[(i, key)] = value
            else:
                rest["state"][i][key] = value
    return {"specs": specs, "whole": whole, "rest": rest}


def _load_piece(where: str, spec: dict, target: torch.Tensor, read, ctx: dict) -> torch.Tensor:
    """This rank's piece of a saved tensor, shaped as `target` holds it (a DTensor for a DTensor)."""
    piece, shape = _piece_of(where, target, ctx["registry"])
    if tuple(spec["shape"]) != shape:
        raise ValueError(f"load_state: {where} was saved with shape {tuple(spec['shape'])}, here it is {shape}")
    prefer = ctx["rank"] if len(spec["pieces"]) == ctx["saved_world_size"] else 0
    try:
        values = shard_pieces.assemble(where, spec["dtype"], piece, spec["pieces"], read, prefer)
    except ValueError as exc:
        raise ValueError(f"load_state: {exc}") from None
    if is_dtensor(target):
        local = target.to_local()
        values = values.view(local.shape).to(device=local.device)
        from torch.distributed.tensor import DTensor  # [Note: DTensor on first use]

        return DTensor.from_local(
            values, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
        )
    return values.view(target.shape).to(device=target.device)


def _glue_zero1(name: str, obj: ZeroRedundancyOptimizer, shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The full optimizer state (plain format) from every saving rank's `sharded_state_dict()`."""
    params = _params(obj)
    parts: dict[int, list] = {}
    for shard in shards:
        for owned in shard[SHARD_KEY]["owned"]:
            index, start, stop = (owned, 0, None) if isinstance(owned, int) else owned
            if index >= len(params):
                raise ValueError(f"load_state: {name} was saved with more parameters than it has ({len(params)})")
            if index in shard["state"]:
                stop = params[index].numel() if stop is None else stop
                parts.setdefault(index, []).append((start, stop, shard["state"][index]))
    try:
        state = {i: assemble_state(params[i], parts[i]) for i in sorted(parts)}
    except RuntimeError as exc:
        raise ValueError(f"load_state: {name}: {exc}") from None
    return {"state": state, "param_groups": shards[0]["param_groups"]}


def apply(obj: Any, module: nn.Module | None, kind: str, prepared: Any) -> None:
    """Load what `prepare` computed."""
    if kind == "zero1":
        how, state = prepared
        (obj.load_sharded_state_dict if how == "sharded" else obj.load_state_dict)(state)
    elif kind == "replica_optim":
        obj.load_state_dict(prepared)
    elif kind == "sharded_module":
        assert module is not None  # a sharded module's kind comes with its module
        module.load_state_dict(prepared)
    else:
        obj.load_state_dict(prepared)
