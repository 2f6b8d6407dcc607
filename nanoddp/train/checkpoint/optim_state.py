"""The optimizer's part of a snapshot, inline: whole for replicated engines, and the sharded
layouts earlier versions wrote.

A replicated optimizer is the same on every rank, so rank 0's `state_dict()` is the snapshot.
A sharded one (zero2, fsdp, our ZeRO-1) goes to per-rank files instead (`companion`). Before
that, snapshots held sharded state inline, and `restore` still resumes them:

fsdp: `{"full": state_dict, "layout": {"engine": "fsdp", ...}}`, every DTensor state whole; a
restore at any world size loads it and keeps this rank's rows (`state_dict`), bitwise.

zero2: `{"per_rank": [state_dict, ...], "layout": ...}`, every rank's state gathered on rank 0.
Resharding: next to the per-rank states the snapshot kept the flat layout that cut them, the
engine's units as lists of (optimizer parameter index, numel, shape) in flat order. Which
parameters share a unit does not depend on the world size (zero2: buckets by size), and a
unit's cut at any world size is `FlatLayout(numels, ws)`. So a restore at another world size
glues each parameter's pieces back into its whole state tensors (exp_avg, exp_avg_sq: the old
ranks' pieces in rank order) and slices out the piece this rank holds at the new world size;
per-parameter scalars (Adam's `step`) are the same on every rank and are kept. At the saving
world size the rank's own state is loaded untouched, so same-size resume stays bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoddp.env import DistEnv
from nanoddp.parallel.zero.flat import FlatLayout, Piece
from nanoddp.train.engines import SHARDED_ENGINES

# A unit of the saved layout: (optimizer index or None for a frozen parameter, numel, shape)
# for each of its parameters, in flat order.
UnitLayout = list[tuple[int | None, int, tuple[int, ...]]]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in `state_dict()` index order (groups in order, then their params)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def restore(optimizer: torch.optim.Optimizer, saved: dict[str, Any], engine: str, env: DistEnv) -> None:
    """Load a snapshot's inline optimizer state into this rank's optimizer, or say why it cannot be.

    Call before the engine shards the module (the trainer does): at another world size than
    the snapshot's, the parameters' whole shapes check the saved layout against this model.
    """
    sharded = engine in SHARDED_ENGINES
    per_rank = saved.get("per_rank") if isinstance(saved, dict) else None
    full = saved.get("full") if isinstance(saved, dict) and "layout" in saved else None
    if sharded != (per_rank is not None or full is not None):
        kind = "an unsharded engine" if sharded else "a sharded engine (zero2/fsdp)"
        raise ValueError(
            f"the snapshot's optimizer state was saved by {kind}; resume with the engine it was "
            f"saved with, not --engine {engine}"
        )
    if not sharded:
        optimizer.load_state_dict(saved)
        return
    layout = saved.get("layout")
    saved_by = (layout or {}).get("engine", engine)
    if saved_by != engine:  # zero2 buckets and fsdp rows cut the parameters differently
        raise ValueError(
            f"the snapshot's optimizer shards were cut by --engine {saved_by}; resume with --engine "
            f"{saved_by}, not --engine {engine}"
        )
    if full is not None:  # fsdp: whole state; this rank keeps its rows of each DTensor parameter's
        from nanoddp.parallel.fsdp.state_dict import shard_optimizer_state

        optimizer.load_state_dict(full)
        shard_optimizer_state(optimizer)
        return
    if per_rank is None:
        raise ValueError(f"the snapshot's {saved_by} optimizer state holds no shards: it is damaged")
    if len(per_rank) == env.world_size:
        optimizer.load_state_dict(per_rank[env.rank])
        return
    if layout is None:
        raise ValueError(
            f"the snapshot holds {len(per_rank)} optimizer shards ({engine}) and no layout to reshard "
            f"them (saved by an older nanoddp); this run has {env.world_size} ranks: resume it at "
            f"--nproc {len(per_rank)}"
        )
    optimizer.load_state_dict(reshard(per_rank, layout, optimizer, env.world_size, env.rank))


def reshard(
    per_rank: list[dict[str, Any]], layout: dict[str, Any], optimizer: torch.optim.Optimizer, world_size: int, rank: int
) -> dict[str, Any]:
    """Rank `rank`'s optimizer `state_dict` at `world_size`, from the per-rank ones saved with `layout`."""
    old_ws = layout["world_size"]
    if len(per_rank) != old_ws:
        raise ValueError(f"the snapshot's layout is for {old_ws} ranks but it holds {len(per_rank)} optimizer shards")
    _check_model(layout["units"], _optimizer_params(optimizer))
    state: dict[int, dict[str, Any]] = {}
    for unit in layout["units"]:
        numels = [n for _, n, _ in unit]
        old = [FlatLayout(numels, old_ws).piece_of(r) for r in range(old_ws)]  # [old rank][param in unit]
        new = FlatLayout(numels, world_size).piece_of(rank)
        for j, (index, _, _) in enumerate(unit):
            if index is None:
                continue
            old_states = [states["state"].get(index) for states in per_rank]
            found = _reshard_param(index, old_states, [o[j] for o in old], new[j])
            if found is not None:
                state[index] = found
    return {"state": state, "param_groups": per_rank[0]["param_groups"]}


def _check_model(units: list[UnitLayout], params: list[torch.Tensor]) -> None:
    """The saved layout must describe this optimizer's parameters, shape for shape."""
    saved = {index: shape for unit in units for index, _, shape in unit if index is not None}
    current = {i: tuple(p.shape) for i, p in enumerate(params)}
    if saved != current:
        differ = sorted(i for i in set(saved) | set(current) if saved.get(i) != current.get(i))[:5]
        detail = ", ".join(f"#{i}: saved {saved.get(i)}, now {current.get(i)}" for i in differ)
        raise ValueError(
            f"the snapshot's optimizer layout does not match this model's parameters ({detail}); "
            "resume with the model configuration the snapshot was saved with"
        )


def _reshard_param(index: int, old_states: list[dict | None], old: list[Piece], new: Piece) -> dict[str, Any] | None:
    """One parameter's state at the new piece `new`, from the old ranks' states at pieces `old`.

    A 1-D tensor the size of the old piece on every rank is sharded state: its pieces laid end
    to end are the whole (flat) tensor, of which `new` is sliced. Anything else (0-d `step`,
    Python numbers) is per-parameter, identical on every rank: rank 0's is kept.
    """
    held = [s for s in old_states if s is not None]
    if not held:
        return None  # never stepped: no state anywhere
    if len(held) != len(old_states):
        raise ValueError(f"optimizer parameter #{index} has state on some ranks only: the snapshot is inconsistent")
    out: dict[str, Any] = {}
    for key, value in held[0].items():
        values: list[Any] = [s.get(key) for s in held]
        if torch.is_tensor(value) and value.dim() == 1 and _shaped_like(values, old):
            parts = [v for v, piece in zip(values, old, strict=True) if piece.numel]
            whole = torch.cat(parts) if parts else value.new_empty(0)  # (numel,)
            out[key] = whole[new.start : new.stop].clone()  # (new piece numel,)
        else:
            out[key] = value
    return out


def _shaped_like(values: list[Any], pieces: list[Piece]) -> bool:
    pairs = zip(values, pieces, strict=True)
    return all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == p.numel for v, p in pairs)
