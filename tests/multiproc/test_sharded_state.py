"""save_state/load_state of sharded models and optimizers: each rank writes its own shard file
and a manifest says where every piece lies, so each rank gets its own pieces back (bitwise, at
the same world size), another world size gets them resharded from the pieces that overlap, and
a damaged shard file is one clear error on every rank instead of a hang or a silent swap.

Engines: torch's and nanoddp's `fully_shard` (DTensor parameters, AdamW state as DTensors), `zero2` (flat
element shards), our ZeRO-1 optimizer. The ws=3 references are the ws=2 run's whole tensors
(`full_tensor()`, `full_state_dict()`, a consolidated ZeRO-1 state, and optimizer pieces glued
by hand from each rank's element range), never the code under test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_on_ranks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import nanoddp
import nanoddp.fsdp
from nanoddp.parallel.zero.stage2 import zero2
from nanoddp.train.checkpoint import snapshot

ENGINES = ("fsdp", "nanoddp_fsdp", "zero2", "zero1")


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 10 rows: 5+5 at ws=2, 4+4+2 at ws=3; 93 elements: flat chunks cut inside parameters
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _build(engine: str, seed: int):
    """(model as trained, module whose state we read, optimizer) for `engine`, from seed `seed`."""
    net = _net(seed)
    if engine in ("fsdp", "nanoddp_fsdp"):  # torch's FSDP2, ours: DTensor parameters alike
        shard = fully_shard if engine == "fsdp" else nanoddp.fsdp.fully_shard
        for layer in (net[0], net[2], net):
            shard(layer)
        return net, net, torch.optim.AdamW(net.parameters(), lr=1e-2)
    if engine == "zero2":
        model = zero2(net, bucket_cap_mb=40 * 4 / 2**20)  # two buckets
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddp = nanoddp.DistributedDataParallel(net)
    return ddp, net, nanoddp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)


def _train(model, optimizer, rank: int, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=g)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _locals(module: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """This rank's pieces of everything: model entries and optimizer state tensors."""
    out = {f"model {k}": _local(v) for k, v in module.state_dict().items()}
    state = optimizer.sharded_state_dict() if hasattr(optimizer, "sharded_state_dict") else optimizer.state_dict()
    for i, per_param in state["state"].items():
        out.update({f"optim {i} {k}": _local(v) for k, v in per_param.items() if torch.is_tensor(v)})
    return out


def _wholes(engine: str, model, module: nn.Module, optimizer, env) -> dict:
    """Whole tensors (collective): model and optimizer state; zero2's optimizer as pieces to glue."""
    if engine in ("fsdp", "nanoddp_fsdp"):
        out = {f"model {k}": v.full_tensor() for k, v in module.state_dict().items()}
        for i, per_param in optimizer.state_dict()["state"].items():
            out.update(
                {f"optim {i} {k}": v.full_tensor() if isinstance(v, DTensor) else v for k, v in per_param.items()}
            )
        return out
    if engine == "zero2":
        out = {f"model {k}": v for k, v in model.full_state_dict().items()}
        units = model._units()
        where = {id(p): (piece.start, piece.stop) for u in units for p, piece in zip(u.params, u.pieces, strict=True)}
        pieces = {i: (where[id(p)], {k: v.clone() for k, v in optimizer.state[p].items()})
                  for i, p in enumerate(model.parameters())}  # fmt: skip
        out["pieces"] = [None] * env.world_size
        dist.all_gather_object(out["pieces"], pieces)
        return out
    optimizer.consolidate_state_dict(to=0)
    full = optimizer.state_dict() if env.rank == 0 else None
    box = [full]
    dist.broadcast_object_list(box, src=0)
    out = {f"model {k}": v.clone() for k, v in module.state_dict().items()}
    out.update({f"optim {i} {k}": v for i, s in box[0]["state"].items() for k, v in s.items()})
    return out


def _glue(pieces_per_rank: list[dict], shapes: dict[int, torch.Size]) -> dict[str, torch.Tensor]:
    """zero2's whole optimizer state: each parameter's pieces laid end to end by element range."""
    out = {}
    for i, shape in shapes.items():
        parts = sorted(((a, b, s) for (a, b), s in (r[i] for r in pieces_per_rank)), key=lambda t: t[:2])
        for key, value in parts[0][2].items():
            if value.dim() == 0:
                out[f"optim {i} {key}"] = value
            else:
                out[f"optim {i} {key}"] = torch.cat([s[key] for a, b, s in parts if b > a]).view(shape)
    return out


def _ws2_worker(env, tmp: str) -> dict:
    out = {}
    for engine in ENGINES:
        model, module, optimizer = _build(engine, seed=0)
        _train(model, optimizer, env.rank)
        nanoddp.save_state(f"{tmp}/{engine}.pt", model=model, optimizer=optimizer, step=2)
        saved = _locals(module, optimizer)
        wholes = _wholes(engine, model, module, optimizer, env)
        fresh, fresh_module, fresh_opt = _build(engine, seed=1)  # other values: a load must replace them all
        state = nanoddp.load_state(f"{tmp}/{engine}.pt", model=fresh, optimizer=fresh_opt)
        assert state["step"] == 2
        got = _locals(fresh_module, fresh_opt)
        assert got.keys() == saved.keys(), engine
        for key, value in saved.items():  # this rank's own pieces, bitwise
            assert torch.equal(got[key], value), (engine, key, env.rank)
        out[engine] = wholes
    manifest = snapshot.load(f"{tmp}/zero2.pt")
    assert [s["file"] for s in manifest["shards"]] == [f.name for f in _shard_files(tmp, "zero2.pt")]
    return out


def _shard_files(tmp: str, name: str) -> list:
    from pathlib import Path

    return sorted(Path(tmp).glob(f"{name}.*.rank*-of-*"), key=lambda p: p.name.rsplit("rank", 1)[1])


def _ws3_worker(env, tmp: str, references: dict) -> None:
    for engine in ENGINES:
        model, module, optimizer = _build(engine, seed=1)
        nanoddp.load_state(f"{tmp}/{engine}.pt", model=model, optimizer=optimizer)
        got = _wholes(engine, model, module, optimizer, env)
        if engine == "zero2":
            shapes = {i: p.shape for i, p in enumerate(_net(0).parameters())}
            got.update(_glue(got.pop("pieces"), shapes))
        expected = references[engine]
        assert got.keys() == expected.keys(), engine
        for key, value in expected.items():
            assert torch.equal(got[key], value), (engine, key, env.rank)
        assert optimizer.param_groups[0]["lr"] == 1e-2
        _train(model, optimizer, env.rank, steps=1)  # the resharded state steps


@pytest.mark.timeout(400)
def test_round_trip_at_the_same_world_size_and_reshard_to_another(tmp_path):
    """ws=2: every rank gets its own pieces back bitwise (the old code saved rank 0's pieces and
    loaded them on every rank: DTensors could not be saved, zero2 raised on rank 1 only). ws=3
    and a plain single process: the whole tensors are the ws=2 run's, bitwise."""
    results = run_on_ranks(_ws2_worker, 2, str(tmp_path), timeout=180)
    references = results[0]
    shapes = {i: p.shape for i, p in enumerate(_net(0).parameters())}
    references["zero2"].update(_glue(references["zero2"].pop("pieces"), shapes))
    run_on_ranks(_ws3_worker, 3, str(tmp_path), references, timeout=180)

    plain, optimizer = _net(1), None  # one process, no sharding: exporting a sharded checkpoint
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    nanoddp.load_state(tmp_path / "zero2.pt", model=plain, optimizer=optimizer)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, references["zero2"][f"model {key}"]), key
    for i, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, references["zero2"][f"optim {i} {key}"]), (i, key)


def _swap_worker(env, tmp: str) -> list[torch.Tensor]:
    """One 16-element parameter, 8 per rank: rank 0's and rank 1's pieces have the same shape."""
    torch.manual_seed(0)
    model = zero2(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0) + 100 * env.rank)  # this rank's piece: unmistakable
    nanoddp.save_state(f"{tmp}/swap.pt", model=model)
    with torch.no_grad():
        model.weight.zero_()
    nanoddp.load_state(f"{tmp}/swap.pt", model=model)
    unknown = nn.Linear(4, 2 + env.rank)  # sharded by hand: shapes differ, nothing says how
    try:
        nanoddp.save_state(f"{tmp}/unknown.pt", model=unknown)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return model.weight.detach().clone(), refused


def test_two_ranks_with_same_shaped_pieces_each_get_their_own_back(tmp_path):
    """The old code saved rank 0's piece and loaded it on both ranks: rank 1 silently got rank 0's.
    A module whose shapes differ across ranks by no sharding we know is refused on every rank
    (the old code saved rank 0's alone)."""
    got = run_on_ranks(_swap_worker, 2, str(tmp_path), timeout=120)
    assert torch.equal(got[0][0], torch.arange(8.0))
    assert torch.equal(got[1][0], torch.arange(8.0) + 100)
    assert got[0][1] == got[1][1] and "model has other tensor shapes on rank 1" in got[0][1]
    assert not (tmp_path / "unknown.pt").exists()


def _skipped_piece_worker(env, tmp: str) -> list:
    """FSDP2 AdamW, one step of a loop that drops a gradient whose local piece is not finite.
    Each rank checks only its own piece, so an overflow in one rank's piece leaves that rank
    without AdamW state for the parameter while the other rank has it. Done once with the
    overflow on rank 0 (rank 1 alone holds the state), once on rank 1."""
    out = []
    for overflowed in (0, 1):
        net = _net(0)
        for layer in (net[0], net[2], net):
            fully_shard(layer)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net(torch.randn(4, 6, generator=torch.Generator().manual_seed(env.rank))).square().mean().backward()
        if env.rank == overflowed:
            net[2].weight.grad.to_local()[0, 0] = float("inf")  # parameter #2 of the optimizer
        for p in net.parameters():
            if not p.grad.to_local().isfinite().all():
                p.grad = None  # AdamW skips it: no state for it on this rank
        optimizer.step()
        has_state = [i for i, p in enumerate(net.parameters()) if p in optimizer.state]
        directory = Path(tmp, f"overflow-on-rank{overflowed}")
        directory.mkdir(exist_ok=True)
        try:
            nanoddp.save_state(directory / "state.pt", model=net, optimizer=optimizer)
            refused = None
        except Exception as exc:  # its type is part of the contract: the test compares both
            refused = f"{type(exc).__name__}: {exc}"
        dist.barrier()  # every rank got here: nobody is left in a collective
        out.append((has_state, refused, sorted(f.name for f in directory.iterdir())))
    return out


def test_ranks_whose_sharded_optimizer_entries_differ_are_refused_on_every_rank(tmp_path):
    """A parameter with AdamW state on one rank only: rank 0 writes the manifest from its own
    entries, so without the check rank 1's state for it was silently left out of the file. The
    save is the same ValueError on every rank, naming the entries, and leaves no files but its lock."""
    got = run_on_ranks(_skipped_piece_worker, 2, str(tmp_path), timeout=120)
    for overflowed in (0, 1):
        (states, messages, leftovers) = zip(*(rank[overflowed] for rank in got), strict=True)
        assert states[overflowed] == [0, 1, 3] and states[1 - overflowed] == [0, 1, 2, 3]
        assert messages[0] == messages[1], messages
        assert messages[0] == (
            "ValueError: save_state: optimizer has sharded entries on some ranks only "
            "([\"(2, 'exp_avg')\", \"(2, 'exp_avg_sq')\"]): ranks disagree"
        )
        assert leftovers == ([".state.pt.lock"], [".state.pt.lock"])  # the save lock (shard_files.begin_save)


def _corrupt_worker(env, tmp: str, how: str) -> str:
    model, _, optimizer = _build("zero2", seed=0)
    _train(model, optimizer, env.rank)
    nanoddp.save_state(f"{tmp}/{how}.pt", model=model, optimizer=optimizer)
    dist.barrier()
    if env.rank == 0:
        victim = _shard_files(tmp, f"{how}.pt")[1]  # rank 1's
        if how == "flipped":
            raw = bytearray(victim.read_bytes())
            raw[-3] ^= 0xFF
            victim.write_bytes(bytes(raw))
        else:  # a valid file, but not the one the manifest was written with
            snapshot.save(victim, {"x": torch.zeros(1)})
    dist.barrier()
    try:
        nanoddp.load_state(f"{tmp}/{how}.pt", model=model, optimizer=optimizer)
    except snapshot.SnapshotError as exc:
        dist.barrier()  # every rank got here: nobody is left in a collective
        return str(exc)
    return "loaded"


@pytest.mark.parametrize("how", ["flipped", "replaced"])
def test_damaged_shard_file_is_the_same_error_on_every_rank(tmp_path, how):
    """The old code never read per-rank files; here rank 1 alone reads the damaged one, and
    both ranks raise its one-line error instead of rank 0 returning and hanging later."""
    messages = run_on_ranks(_corrupt_worker, 2, str(tmp_path), how, timeout=120)
    assert messages[0] == messages[1], messages
    assert "rank1-of-2" in messages[0]
    assert ("corrupted" if how == "flipped" else "not the file manifest") in messages[0]


def test_crash_before_the_manifest_leaves_the_previous_checkpoint(tmp_path):
    """Shard files written but no manifest (a job killed mid-save): load_state(directory) sees
    only complete checkpoints."""
    model = nn.Linear(3, 2)
    nanoddp.save_state(tmp_path, step=1, model=model)
    (tmp_path / "step-00000002.pt.deadbeef.rank0-of-2").write_bytes(b"half")  # no step-2 manifest
    shutil.copy(tmp_path / "step-00000001.pt", tmp_path / "other")
    assert nanoddp.load_state(tmp_path, model=nn.Linear(3, 2))["step"] == 1
