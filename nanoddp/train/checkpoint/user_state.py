"""`save_state` / `load_state`: exact resume for people who keep their own training loop.

`nanoddp.Trainer` snapshots everything a step depends on; a hand-written loop needs the same
guarantees without adopting the Trainer. You name the objects, we sort them by kind::

    nanoddp.save_state("ckpt/", step=step, model=ddp_model, optimizer=opt, scheduler=sched,
                       sampler=sampler, scaler=scaler)
    state = nanoddp.load_state("ckpt/", model=ddp_model, optimizer=opt, scheduler=sched,
                               sampler=sampler, scaler=scaler)   # None: nothing saved yet
    step = state["step"] if state else 0

- modules are saved unwrapped (a DDP/DataParallel wrapper's inner module, so no `module.`
  prefix), from rank 0: data parallelism keeps the replicas identical;
- sharded objects (a model with DTensor parameters, `fully_shard`'s; a `zero2` model; our
  `ZeroRedundancyOptimizer`; a torch optimizer over such a model's parameters, passed in the
  same call; a `nanoddp.LocalSGD`/`DiLoCo` and the model it steps, whose replicas are each
  rank's own between syncs) differ on every rank, so each rank writes its own shard file next to the file,
  which is then a manifest of where every piece lies (`nanoddp.train.checkpoint.sharded`):
  same world size, each rank gets its own pieces back bitwise; another one, each rank reads
  the pieces it now holds from the files that have them. A module or optimizer whose shapes
  differ across ranks in a way none of these explains is refused rather than saved as rank 0's;
- torch's `ZeroRedundancyOptimizer` is consolidated onto rank 0 first, so the file holds the
  whole optimizer state and resumes on any world size;
- anything else with `state_dict`/`load_state_dict` (optimizers, LR schedulers, GradScalers,
  `ResumableDistributedSampler`) is saved from rank 0; torch's `DistributedSampler` keeps its
  epoch; any other value (ints, floats, strings, tensors, lists and dicts of them) is stored
  as is and handed back by `load_state`;
- what is saved must load back under `torch.load(weights_only=True)` (the only safe way to read
  a file), which refuses numpy and most Python classes. So numpy scalars are saved as Python
  numbers (`np.mean(losses)` comes back a `float`, `np.int64` an `int`) and numpy arrays as
  tensors (`torch.from_numpy(a)` would give the same values), in plain values and in the
  state_dicts alike; anything else that would not load (a `datetime`, a dataclass, an object
  array) is refused before anything is written, with a TypeError naming where it sits: store
  its parts instead (`.isoformat()`, `dataclasses.asdict`), or allow its class with
  `torch.serialization.add_safe_globals`;
- every rank's RNG streams (python, numpy, torch CPU and CUDA) are gathered and restored per
  rank, which is what makes dropout and augmentation continue bitwise after a resume.

One thing the loop must do itself: give its `DataLoader` a `generator=` of its own. Otherwise
every `iter(loader)` draws a seed from the global torch RNG, and a resumed run starts its
iterator at another point of that stream than the uninterrupted run did.

The file is a `nanoddp.train.checkpoint.snapshot` file: written atomically with a checksum, so a job
killed mid-write leaves the previous file intact, and `load_state(directory)` skips a newest
file that does not load (damaged, truncated, holding what weights_only refuses, or listing a
shard file that is missing or not the one it was written with), logging one line each, for the
newest one that does (a shard file damaged inside is an error naming it: load an older step's
file by name). A `nanoddp.Trainer` snapshot is such a file, with fixed names (model, optimizer,
scheduler, scaler, sampler, train), so `load_state(snapshot, model=m, optimizer=o)` reads one.
Both functions are collective when a process group is initialised: call them on every rank
with the same names; a refusal or a failed read or write on any rank is the same error on every
rank. A sharded save holds the lock `.<name>.lock` beside the file while it writes: a second job
saving to the same path at once is refused (`SaveInProgress`) instead of deleting the first's
shard files.
"""

from __future__ import annotations

import logging
import numbers
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from nanoddp.base.rng import capture_rng_state, restore_rng_state
from nanoddp.parallel.ddp.wrapper import DistributedDataParallel
from nanoddp.parallel.dp.data_parallel import DataParallel
from nanoddp.parallel.manual import SimpleDDP
from nanoddp.train.checkpoint import loadable, shard_files, sharded, snapshot
from nanoddp.train.checkpoint.shard_files import SAME_ON_EVERY_RANK
from nanoddp.train.ranks import distributed

logger = logging.getLogger(__name__)

FORMAT = "nanoddp.save_state/1"
FORMAT_SHARDED = "nanoddp.save_state/2"  # a manifest: some objects are in per-rank shard files
_WRAPPERS = (
    torch.nn.parallel.DistributedDataParallel,
    torch.nn.DataParallel,
    DistributedDataParallel,
    DataParallel,
)


def unwrap(module: torch.nn.Module | SimpleDDP) -> torch.nn.Module:
    """The user's model inside any data-parallel wrappers (whose state_dict adds `module.`)."""
    while isinstance(module, (*_WRAPPERS, SimpleDDP)):
        module = module.model if isinstance(module, SimpleDDP) else module.module
    return module


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _kind(obj: Any) -> str:
    if isinstance(obj, (torch.nn.Module, SimpleDDP)):
        return "module"
    if hasattr(obj, "consolidate_state_dict") and hasattr(obj, "load_state_dict"):
        return "sharded_optimizer"
    if isinstance(obj, DistributedSampler) and not hasattr(obj, "state_dict"):
        return "torch_sampler"
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return "stateful"
    return "value"


def _capture(obj: Any, kind: str, is_master: bool) -> Any:
    """This object's saved form (collective for a sharded optimizer; None off rank 0)."""
    if kind == "sharded_optimizer":
        obj.consolidate_state_dict(to=0)  # every rank takes part in the gather
    if not is_master:
        return None
    if kind == "module":
        return unwrap(obj).state_dict()
    if kind == "torch_sampler":
        return {"epoch": obj.epoch}
    if kind in ("stateful", "sharded_optimizer"):
        return obj.state_dict()
    return obj


def _names_directory(path: str | Path) -> bool:
    """A directory: one that exists, a path written with a trailing slash, or a new name with no suffix."""
    as_path = Path(path)
    if as_path.is_dir() or str(path).endswith(("/", "\\")):
        return True
    return not as_path.exists() and as_path.suffix == ""


def _target_file(path: str | Path, objects: dict[str, Any]) -> Path:
    """The file to write: `path` itself, or `step-<N>.pt` in directory `path` for step=N."""
    if not _names_directory(path):
        return Path(path)
    step = objects.get("step")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:  # np.int64 too
        raise ValueError(
            f"save_state({str(path)!r}) names a directory, so the file is step-<N>.pt and needs "
            f"step=N (an int >= 0), got step={step!r}; pass step=..., or a file path such as state.pt"
        )
    return snapshot.snapshot_path(path, int(step))


def save_state(path: str | Path, **objects: Any) -> Path:
    """Save `objects` (see the module docstring) atomically; return the file written.

    Collective when a process group is initialised. `path` is a file (`state.pt`), or a
    directory (an existing one, `ckpt/`, or a new name without suffix) in which the file is
    `step-<N>.pt` for `step=N`, so that `load_state(directory)` finds the newest.
    """
    if not objects:
        raise ValueError("save_state needs at least one object to save, e.g. save_state(path, model=model)")
    target = save_objects(_target_file(path, objects), objects)  # target checked on every rank first
    logger.info("saved state %s (%s)", target, ", ".join(objects))
    return target


def save_objects(target: Path, objects: dict[str, Any]) -> Path:
    """`save_state` into file `target`, without its log line (the Trainer's snapshots)."""
    modules, registry, kinds = _classify(objects)
    shards = [name for name, kind in kinds.items() if kind in sharded.KINDS]
    token, lock_fd = shard_files.begin_save(target) if shards else ("", None)
    try:
        return _save_locked(target, objects, (modules, registry, kinds), shards, token)
    finally:
        shard_files.end_save(lock_fd)


def _save_locked(target: Path, objects: dict[str, Any], classified, shards: list[str], token: str) -> Path:
    """`save_objects` once the save lock is held."""
    rank, world_size = _rank(), _world_size()
    modules, registry, kinds = classified
    rng = capture_rng_state()
    saved = {
        name: {"kind": kinds[name], "state": _capture(obj, kinds[name], rank == 0)}
        for name, obj in objects.items()
        if name not in shards
    }
    own_file, layouts, report = _save_own_shard(target, token, shards, objects, modules, kinds, registry)
    mine = (rng, sharded.shapes(objects, modules, kinds), report)  # one gather: RNG streams, shapes, shard files
    reports: list[Any] | None = [mine]
    if distributed():
        reports = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, reports, dst=0)
    outcome: list[tuple[str, str] | None] = [None]
    error: Exception | None = None
    if rank == 0:
        try:
            assert reports is not None  # rank 0 gathered every rank's report
            _write_manifest(target, saved, reports, shards, layouts, kinds)
        except Exception as exc:  # every rank raises it, rather than wait for rank 0
            outcome, error = [(type(exc).__name__, str(exc))], exc
    if distributed():  # nobody returns (and maybe loads) before the file exists
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        if own_file is not None:
            own_file.unlink(missing_ok=True)  # no manifest lists it
        raise error if error is not None else SAME_ON_EVERY_RANK.get(outcome[0][0], RuntimeError)(outcome[0][1])
    return target


def _write_manifest(target: Path, saved: dict, reports: list[Any], shards: list[str], layouts: dict, kinds: dict):
    """Rank 0: check every rank's report, write the file, remove what it no longer lists."""
    _check_reports(reports)
    for name in shards:
        sharded.merge(name, layouts[name], [r[2]["pieces"][name] for r in reports])
        saved[name] = {"kind": kinds[name], "state": layouts[name]}
    for name, entry in saved.items():
        where = name if entry["kind"] == "value" else f"{name} (its state_dict)"
        entry["state"] = loadable.convert(entry["state"], where)
    state: dict[str, Any] = {
        "format": FORMAT,
        "objects": saved,
        "rng": [r[0] for r in reports],
        "world_size": len(reports),
    }
    if shards:
        state["format"] = FORMAT_SHARDED
        state["shards"] = [{"file": r[2]["file"], "sha256": r[2]["sha256"]} for r in reports]
    if shards:  # under the save lock since `begin_save`
        snapshot.save(target, state)
        shard_files.remove_unlisted(target, {entry["file"] for entry in state["shards"]})
        return
    with shard_files.replacing_sharded(target):  # a whole save over a sharded one: lock, remove its files
        snapshot.save(target, state)


def _classify(objects: dict[str, Any]) -> tuple[dict[str, torch.nn.Module], sharded.Registry, dict[str, str]]:
    """The modules unwrapped, their flat-unit pieces, and every object's kind (alike on every rank)."""
    modules = {name: unwrap(obj) for name, obj in objects.items() if isinstance(obj, (torch.nn.Module, SimpleDDP))}
    registry = sharded.flat_registry(list(modules.values()))
    registry |= sharded.replica_registry(list(objects.values()), list(modules.values()))
    kinds = {name: sharded.kind_of(obj, modules.get(name), registry) or _kind(obj) for name, obj in objects.items()}
    return modules, registry, kinds


def _save_own_shard(target, token, shards, objects, modules, kinds, registry):
    """Write this rank's shard file: (its path, rank 0's layouts, report) where the report is
    {file, sha256, pieces} or the (error class, message) that stopped it."""
    if not shards:
        return None, {}, None
    path = None
    try:
        part, found, layouts = {}, {}, {}
        for name in shards:
            part[name], found[name], layouts[name] = sharded.capture(
                name, objects[name], modules.get(name), kinds[name], registry, _rank() == 0
            )
            part[name] = loadable.convert(part[name], f"{name} (its shard)")
        path = target.parent / shard_files.shard_name(target, token, _rank(), _world_size())
        digest = shard_files.write_shard(path, part)
        return path, layouts, {"file": path.name, "sha256": digest, "pieces": found}
    except Exception as exc:
        return path, {}, (type(exc).__name__, str(exc))


def _check_reports(reports: list[Any]) -> None:
    """Rank 0: the first rank's failed shard write, or an object saved whole whose shapes differ
    across ranks (sharded by something not recognised: rank 0's alone would be half of it)."""
    for _, _, report in reports:
        if isinstance(report, tuple):
            raise SAME_ON_EVERY_RANK.get(report[0], RuntimeError)(report[1])
    for name, shapes in reports[0][1].items():
        for rank, (_, other, _) in enumerate(reports):
            if other[name] != shapes:
                raise ValueError(
                    f"save_state: {name} has other tensor shapes on rank {rank} than on rank 0, so it is "
                    "sharded, by nothing save_state recognises: pass the sharded model in the same call"
                )


def _resolve(path: str | Path) -> tuple[Path, dict[str, Any] | None] | None:
    """The file to load (with its state when already read): `path` itself, or the newest
    snapshot in directory `path` that loads (rank 0 decides; every rank loads that one)."""
    if not _names_directory(path):
        if not Path(path).exists():
            raise FileNotFoundError(f"no saved state at {path}: pass the file save_state wrote, or its directory")
        return Path(path), None
    found = snapshot.find_latest_valid(path) if _rank() == 0 else None  # a warning line per file skipped
    chosen = [str(found[0]) if found else None]
    if distributed():
        dist.broadcast_object_list(chosen, src=0)  # every rank loads the same file
    if chosen[0] is None:
        return None
    return Path(chosen[0]), found[1] if found else None


def _restore(obj: Any, entry: dict[str, Any]) -> Any:
    kind, state = entry["kind"], entry["state"]
    if kind == "module":
        unwrap(obj).load_state_dict(state)
    elif kind == "torch_sampler":
        obj.set_epoch(state["epoch"])
    elif kind in ("stateful", "sharded_optimizer"):
        obj.load_state_dict(state)
    else:
        return state  # a plain value: handed back, the caller rebinds it
    return obj


def _read(path: str | Path, objects: dict[str, Any], manifest: dict | None) -> tuple[Path, dict[str, Any]] | None:
    """The file to load and its state (`manifest`: already read), checked against the names asked for."""
    resolved = _resolve(path) if manifest is None else (Path(path), manifest)
    if resolved is None:
        return None
    file, state = resolved
    state = state if state is not None else snapshot.load(file)
    if state.get("format") not in (FORMAT, FORMAT_SHARDED):
        raise ValueError(f"{file} was not written by nanoddp.save_state (format {state.get('format')!r})")
    missing = sorted(set(objects) - set(state["objects"]))
    if missing:
        raise ValueError(
            f"{file} has no {missing}; it holds {sorted(state['objects'])}: load with the names save_state used"
        )
    return file, state


def load_state(path: str | Path, **objects: Any) -> dict[str, Any] | None:
    """Restore `objects` in place from `path` and return every saved entry by name.

    Modules, optimizers, schedulers, samplers and scalers are loaded into the objects passed;
    plain values come back in the returned dict (`state["step"]`). When `path` is a directory
    the newest valid `step-<N>.pt` is used, and None is returned if there is none yet (a first
    run). Each rank gets back its own RNG streams when the world size is the one that saved.
    """
    return load_objects(path, objects)


def load_objects(
    path: str | Path, objects: dict[str, Any], restore_rng: bool = True, manifest: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """`load_state`; `restore_rng=False` also leaves every RNG as it is and the load unlogged (the
    Trainer restores the streams itself, re-seeding them at another world size, and says it
    resumed); `manifest`: the file `path`'s state, when the caller has read it already."""
    found, error = None, None
    try:
        found = _read(path, objects, manifest)
    except Exception as exc:  # e.g. a file one rank can't read: every rank raises, none waits
        error = exc
    shard_files.agree(error)
    if found is None:
        logger.info("no saved state in %s: starting fresh", path)
        return None
    file, state = found
    saved = state["objects"]
    result = {name: entry["state"] for name, entry in saved.items() if entry["kind"] == "value"}
    modules, registry, kinds = _classify(objects)
    entries = {name: saved[name] for name in objects}
    for name, entry in entries.items():  # a whole state into a sharded object: each rank cuts its pieces
        if entry["kind"] == "module" and kinds[name] == "sharded_module":
            entries[name] = {"kind": "sharded_module", "state": {"specs": {}, "whole": entry["state"]}}
        elif entry["kind"] == "stateful" and kinds[name] == "sharded_optim":
            layout = sharded.whole_optimizer_layout(entry["state"], objects[name], registry)
            entries[name] = {"kind": "sharded_optim", "state": layout}
    shards = [name for name, entry in entries.items() if entry["kind"] in sharded.KINDS]
    prepared = {}
    if shards:  # read and compute every piece first: nothing changes unless every rank can load
        ctx = {"reader": shard_files.ShardReader(file, state.get("shards", [])), "registry": registry}
        ctx.update(rank=_rank(), world_size=_world_size(), saved_world_size=state["world_size"])
        try:
            for name in shards:
                kind, layout = entries[name]["kind"], entries[name]["state"]
                prepared[name] = sharded.prepare(name, objects[name], modules.get(name), kind, layout, ctx)
        except Exception as exc:
            error = exc
        shard_files.agree(error)
    # Modules first: an optimizer that keeps its own copy of the parameters (ZeRO's pieces)
    # refreshes it from the model when its state is loaded.
    try:
        for name in sorted(objects, key=lambda n: entries[n]["kind"] not in ("module", "sharded_module")):
            if name in prepared:
                sharded.apply(objects[name], modules.get(name), entries[name]["kind"], prepared[name])
                result[name] = objects[name]
            else:
                result[name] = _restore(objects[name], entries[name])
    except Exception as exc:
        error = exc
    shard_files.agree(error)
    rng = state["rng"]
    if restore_rng and len(rng) == _world_size():
        restore_rng_state(rng[_rank()])
    elif restore_rng and distributed() and _rank() == 0:  # one process reading a job's weights needs none
        logger.warning(
            "state saved at world size %d, loaded at %d: RNG streams not restored (reseed them)",
            len(rng),
            _world_size(),
        )
    if restore_rng:
        logger.info("loaded state %s", file)
    return result
