"""A sharded engine's model and optimizer in a Trainer snapshot: per-rank files, never gathered.

Why: zero2's and fsdp's model and optimizer state differ on every rank (ZeRO-1's optimizer state
too). Gathering them onto rank 0 for each snapshot costs rank 0 the memory of the whole state
and one serial write. Instead snapshot `step-N.pt` names a companion `step-N.shards.pt`: a
`save_state` manifest beside which every rank wrote its own shard file, in parallel
(`shard_files`, `sharded`). The order makes it safe:

- the companion is written first, collectively, and the snapshot (rank 0) only after it, so a
  snapshot never names a companion that is not complete;
- `snapshot.find_latest_valid` checks that the companion and each shard file it lists are there
  and are the ones it was written with, else falls back to an older snapshot;
- `snapshot.prune` deletes a companion with its snapshot (and one whose snapshot was never
  written).

Resume loads it with `load_state`'s machinery: each rank reads the pieces it holds now, so a
snapshot resumes at another world size, and into a plain model when the engine changed.
Replicated engines keep model and optimizer inline in the snapshot: rank 0's is the whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer
from nanoddp.train.checkpoint import snapshot, user_state
from nanoddp.train.engines import SHARDED_ENGINES


def objects_for(engine: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What of the trainer's state is sharded over ranks under `engine` ({}: nothing)."""
    objects: dict[str, Any] = {"model": module} if engine in SHARDED_ENGINES else {}
    if engine in SHARDED_ENGINES or isinstance(optimizer, ZeroRedundancyOptimizer):
        objects["optimizer"] = optimizer
    return objects


def save(snapshot_file: Path, objects: dict[str, Any]) -> dict[str, Any] | None:
    """Write the companion of `snapshot_file` (collective); what the snapshot records of it:
    {"file": its name, "objects": the names in it}, or None when `objects` is empty."""
    if not objects:
        return None
    target = user_state.save_objects(snapshot.companion_path(snapshot_file), objects)
    return {"file": target.name, "objects": sorted(objects)}


def load(
    snapshot_file: Path, record: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Load the companion `record` names (from `save`) into `module` and `optimizer` (collective
    when a process group is up; `optimizer=None`: the model only, e.g. `nanoddp sample`).

    The RNG streams are the snapshot's to restore, so they are left alone here."""
    objects = {"model": module, "optimizer": optimizer}
    user_state.load_objects(
        Path(snapshot_file).with_name(record["file"]),
        {name: objects[name] for name in record["objects"] if objects[name] is not None},
        restore_rng=False,
    )


def model_shapes(snapshot_file: Path, record: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The whole shape of every model tensor in the companion, from its manifest alone (no shard
    file read): what the launcher checks against the model a config builds before resuming."""
    manifest = snapshot.load(Path(snapshot_file).with_name(record["file"]))
    layout = manifest["objects"]["model"]["state"]
    shapes = {key: tuple(spec["shape"]) for key, spec in layout["specs"].items()}
    return shapes | {key: tuple(value.shape) for key, value in layout["whole"].items()}
