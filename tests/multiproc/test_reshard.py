"""Resuming a sharded engine (zero2, fsdp) at another world size: the model and optimizer shards
each ws=2 rank wrote to its own file (listed by the snapshot's manifest) are resharded for ws=3 and ws=1.

The reference is built by hand, independently of the checkpoint's piece arithmetic: each ws=2
rank reports the optimizer state of its live shard pieces together with the elements of the
parameter each piece holds (zero2: the engine's own `unit.pieces`; fsdp: the DTensor's rows,
from torch's `compute_local_shape_and_global_offset`), the test glues those into whole
per-parameter tensors, and at the new world size (1) every rank's restored state must be the
whole tensors' slice at that rank's new piece, bitwise, and (2) a run that resumes from the
snapshot must end bitwise where a fresh run does into which the test loaded the same whole
model, whole optimizer state, scheduler and data position by hand. A ws=2 run that was never
interrupted ends close to both (tolerance below). Same-size bitwise resume is in
test_trainer_sharded.py.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import torch
import torch.distributed as dist
from helpers import TINY, run_on_ranks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nanoddp.env import DistEnv
from nanoddp.parallel.zero.flat import FlatLayout
from nanoddp.train.checkpoint import shard_pieces, snapshot
from nanoddp.train.trainer import Trainer

STOP, END = 5, 12  # batch 12 is 9 steps an epoch: stop mid-epoch 0, finish in epoch 1
ENGINES = ("zero2", "fsdp")


def _config(engine: str, out: str, resume: str = "never"):
    # batch 12 divides into 1, 2 and 3 ranks
    return replace(TINY, engine=engine, batch_size=12, steps=END, snapshot_every=STOP, out=out, resume=resume)


def _trainer(config, env: DistEnv) -> Trainer:
    make = getattr(Trainer, "from_config", None)  # the trainer's constructor is being renamed
    return make(config, env) if make is not None else Trainer(config, env)


def _rows(p: DTensor) -> tuple[int, int]:
    """The flat element range of a DTensor parameter's rows on this rank."""
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = p[0].numel()
    return offset[0] * row, (offset[0] + local_shape[0]) * row


def _flat_local(v):
    """A state tensor as this rank holds it, flat (a DTensor's local rows)."""
    return v.to_local().reshape(-1).clone() if isinstance(v, DTensor) else v.clone()


def _pieces(trainer: Trainer) -> dict[str, tuple[int, int, torch.Size, dict]]:
    """name -> (start, stop, whole shape, flat optimizer state) of this rank's piece of each parameter."""
    if trainer.config.engine == "fsdp":
        where = {id(p): (*_rows(p), p.shape) for p in trainer.module.parameters()}
    else:
        where = {
            id(p): (piece.start, piece.stop, shape)
            for unit in trainer.engine.module._units()
            for p, piece, shape in zip(unit.params, unit.pieces, unit.shapes, strict=True)
        }
    out = {}
    for name, p in trainer.module.named_parameters():
        start, stop, shape = where[id(p)]
        state = {k: _flat_local(v) if torch.is_tensor(v) else v for k, v in trainer.optimizer.state.get(p, {}).items()}
        out[name] = (start, stop, shape, state)
    return out


def _glue(per_rank: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole per-parameter optimizer state from every rank's pieces (by element range)."""
    whole = {}
    for name, (_, _, shape, state) in per_rank[0].items():
        pieces = sorted((start, stop, s) for start, stop, _, s in (r[name] for r in per_rank) if stop > start)
        assert [a for a, _, _ in pieces] == [0] + [b for _, b, _ in pieces[:-1]], name  # they tile the parameter
        whole[name] = {}
        for key, value in state.items():
            if value.dim() == 0:  # Adam's step: the same on every rank
                assert all(torch.equal(r[name][3][key], value) for r in per_rank), (name, key)
                whole[name][key] = value
            else:
                whole[name][key] = torch.cat([s[key] for _, _, s in pieces]).view(shape)
    return whole


def _ws2_worker(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine in ENGINES:
        split = _trainer(_config(engine, f"{tmp}/{engine}"), env)
        split.train(stop_after=STOP)
        out[engine] = _pieces(split)
        out[f"{engine}-model"] = split.engine.state_dict()  # collective: the whole model at STOP
        out[f"{engine}-groups"] = [{k: v for k, v in g.items() if k != "params"} for g in split.optimizer.param_groups]
        whole = _trainer(_config(engine, f"{tmp}/whole-{engine}"), env)
        whole.train()
        out[f"{engine}-whole"] = whole.engine.state_dict()  # collective
    return out


def _load_by_hand(trainer: Trainer, saved: dict, whole: dict[str, dict[str, torch.Tensor]], at_stop: dict) -> None:
    """Put the state at STOP into a fresh trainer the long way round: the whole model and the
    hyperparameters the ws=2 run had there, each whole optimizer state tensor sliced at this
    rank's piece, and the snapshot's schedule and data position."""
    trainer.engine.module.load_full_state_dict(at_stop["model"])
    for name, (start, stop, _, _) in _pieces(trainer).items():
        p = dict(trainer.module.named_parameters())[name]
        trainer.optimizer.state[p] = {
            key: value.clone() if value.dim() == 0 else _as_held(value.reshape(-1)[start:stop].clone(), p)
            for key, value in whole[name].items()
        }
    for group, saved_group in zip(trainer.optimizer.param_groups, at_stop["groups"], strict=True):
        group.update(saved_group)
    trainer.scheduler.load_state_dict(saved["scheduler"]["state"])
    trainer.sampler.load_state_dict(saved["sampler"]["state"])
    trainer.step = saved[snapshot.TRAIN]["state"]["step"]


def _as_held(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A flat piece as the optimizer keeps state for `p`: for a DTensor, a DTensor of its rows."""
    if not isinstance(p, DTensor):
        return flat
    local = flat.view(-1, *p.shape[1:])
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _resume_worker(env: DistEnv, tmp: str, wholes: dict, at_stop: dict) -> dict:
    out = {}
    for engine in ENGINES:
        whole = wholes[engine]
        resumed = _trainer(_config(engine, f"{tmp}/{engine}", resume="auto"), env)
        assert resumed.step == STOP
        for name, (start, stop, _, state) in _pieces(resumed).items():  # the restored shard, bitwise
            assert state.keys() == whole[name].keys(), name
            for key, value in state.items():
                expected = whole[name][key] if value.dim() == 0 else whole[name][key].reshape(-1)[start:stop]
                assert torch.equal(value, expected), (engine, name, key)
        resumed.train()
        out[engine] = resumed.engine.state_dict()  # collective

        saved = snapshot.load(snapshot.snapshot_path(f"{tmp}/{engine}/snapshots", STOP))["objects"]
        by_hand = _trainer(_config(engine, f"{tmp}/by-hand-{engine}"), env)
        kinds = (saved["model"]["kind"], saved["optimizer"]["kind"])
        assert kinds == ("sharded_module", "sharded_optim")  # in per-rank files, never gathered
        _load_by_hand(by_hand, saved, whole, at_stop[engine])
        by_hand.train()
        reference = by_hand.engine.state_dict()
        for key, value in reference.items():  # bitwise, on every rank
            assert torch.equal(value, out[engine][key]), (engine, key)
        if dist.is_initialized():
            dist.barrier()
    return out


def test_sharded_resume_at_another_world_size(tmp_path):
    """Snapshot at ws=2, resume at ws=3 and at ws=1: restored shards and the continued run
    match the hand-resharded reference bitwise."""
    results = run_on_ranks(_ws2_worker, 2, str(tmp_path / "ws2"), timeout=300)
    wholes = {engine: _glue([r[engine] for r in results]) for engine in ENGINES}
    at_stop = {
        engine: {"model": results[0][f"{engine}-model"], "groups": results[0][f"{engine}-groups"]} for engine in ENGINES
    }
    for new_ws in (3, 1):
        for engine in ENGINES:
            shutil.copytree(tmp_path / "ws2" / engine, tmp_path / f"ws{new_ws}" / engine)
        resumed = run_on_ranks(_resume_worker, new_ws, str(tmp_path / f"ws{new_ws}"), wholes, at_stop, timeout=300)[0]
        for engine in ENGINES:
            # against the run never interrupted at ws=2: the same samples and schedule, but
            # gradients are summed over 3 ranks (or 1) instead of 2, and the clip norm over
            # other shards, so values agree up to float32 reduction order (as in test_trainer)
            torch.testing.assert_close(resumed[engine], results[0][f"{engine}-whole"], rtol=1e-4, atol=1e-5)


def test_reshard_round_trip_with_empty_pieces_and_a_frozen_parameter():
    """Pure arithmetic, no processes: a ZeRO-2 unit of sizes 5, 1 (frozen, not in the optimizer)
    and 7, and one of size 2, cut at ws=4 (some ranks hold no piece of a parameter); each state
    tensor's pieces are put back together at ws=3 and ws=1 by the checkpoint's piece arithmetic,
    and every new rank's pieces, laid end to end in rank order, give back the whole tensor."""
    units = [[5, 1, 7], [2]]
    g = torch.Generator().manual_seed(0)
    whole = [[torch.randn(n, generator=g) for n in unit] for unit in units]

    def cut(unit: list[int], ws: int, j: int) -> list[tuple[str, int, int]]:
        return [("range", p[j].start, p[j].stop) for p in (FlatLayout(unit, ws).piece_of(r) for r in range(ws))]

    assert any(piece[1] == piece[2] for unit in units for j in range(len(unit)) for piece in cut(unit, 4, j))
    for u, unit in enumerate(units):
        for j in range(len(unit)):
            if (u, j) == (0, 1):
                continue  # the frozen parameter: it shapes the cut, it has no optimizer state
            saved = cut(unit, 4, j)
            for new_ws in (3, 1):
                got = []
                for rank, target in enumerate(cut(unit, new_ws, j)):
                    read = lambda r, u=u, j=j, saved=saved: whole[u][j][saved[r][1] : saved[r][2]].clone()  # noqa: E731
                    got.append(shard_pieces.assemble(f"#{u}.{j}", torch.float32, target, saved, read, prefer=rank))
                assert torch.equal(torch.cat(got), whole[u][j]), (u, j, new_ws)
