"""The trainer on sharded engines (zero2, fsdp): clipping by the global norm, the whole model in
snapshots and model.pt, per-rank optimizer state, bitwise resume, and evaluation with uneven
validation shards (every FSDP forward all-gathers, so every rank must run as many)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers import FLAGS, TINY, run_on_ranks, train_tiny, trainer_params

from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.trainer import Trainer

STOP, END = 5, 12  # TINY's clip (0.05) is active at every step: the global norm decides every update


def _sharded_worker(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine in ("zero2", "fsdp"):
        base = replace(TINY, engine=engine, steps=END, snapshot_every=STOP)
        whole = train_tiny(replace(base, out=f"{tmp}/whole-{engine}"), env)
        dist.barrier()  # rank 0 writes model.pt after the collective gather
        out[engine] = {k: v for k, v in torch.load(f"{tmp}/whole-{engine}/model.pt", weights_only=True).items()}
        out[f"{engine}-val"] = whole.evaluate()  # 5 validation windows over 2 ranks: 3 and 2
        split = train_tiny(replace(base, out=f"{tmp}/split-{engine}"), env, stop_after=STOP)
        _check_own_pieces_only(split, f"{tmp}/split-{engine}/snapshots", env)
        resumed = Trainer.from_config(replace(base, out=f"{tmp}/split-{engine}", resume="auto"), env)
        assert resumed.step == STOP
        resumed.train()
        dist.barrier()
        resumed_model = torch.load(f"{tmp}/split-{engine}/model.pt", weights_only=True)
        for key, value in out[engine].items():  # bitwise, on every rank
            assert torch.equal(value, resumed_model[key]), (engine, key)
    return out


def _check_own_pieces_only(trainer: Trainer, directory: str, env: DistEnv) -> None:
    """A sharded snapshot gathers nothing on rank 0: its manifest holds no parameter and no
    optimizer state tensor, and each rank's shard file holds exactly this rank's pieces."""
    dist.barrier()  # rank 0 writes the manifest after every rank's shard file
    manifest = snapshot.snapshot_path(directory, STOP)
    saved = snapshot.load(manifest)["objects"]
    assert (saved["model"]["kind"], saved["optimizer"]["kind"]) == ("sharded_module", "sharded_optim")
    assert not set(saved["model"]["state"]["whole"]) & {name for name, _ in trainer.module.named_parameters()}
    assert _tensors(saved["optimizer"]) == 0  # where each piece lies; the values are in the rank files
    (mine,) = manifest.parent.glob(f"{manifest.name}.*.rank{env.rank}-of-{env.world_size}")
    held = {k: v.numel() for k, v in snapshot.load(mine)["model"]["tensors"].items()}
    pieces = trainer.module.state_dict(keep_vars=True)  # the registered parameters: this rank's pieces
    local = {k: getattr(v, "_local_tensor", v).numel() for k, v in pieces.items()}
    assert held == {k: n for k, n in local.items() if k in held}  # this rank's piece of each, no more
    whole = sum(p.numel() for p in trainer.engine.state_dict().values())  # collective
    assert 0 < sum(held.values()) < whole  # a part of the model, not all of it


def _tensors(value) -> int:
    """How many tensors `value` holds, however deep."""
    if torch.is_tensor(value):
        return 1
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_tensors(v) for v in items)


def test_sharded_engines_match_one_process_and_resume_bitwise(tmp_path):
    results = run_on_ranks(_sharded_worker, 2, str(tmp_path / "ws2"), timeout=300)[0]
    reference = train_tiny(
        replace(TINY, engine="single", steps=END, out=str(tmp_path / "single")), DistEnv.single_process("gloo")
    )
    expected = trainer_params(reference)
    for engine in ("zero2", "fsdp"):
        assert results[engine].keys() == expected.keys()
        # rtol as for the other engines in test_trainer: gradient sums and the clip norm are
        # added in another order than in one process (shards, then ranks)
        torch.testing.assert_close(results[engine], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(results[f"{engine}-val"], reference.evaluate(), rtol=1e-4, atol=1e-5)


def _nanoddp_train(out, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nanoddp", "train", *FLAGS, "--engine", "fsdp", "--nproc", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=400, env=env)


@pytest.mark.timeout(900)
def test_cli_resumes_a_sharded_run_whose_snapshot_keeps_the_model_in_rank_files(tmp_path):
    """`nanoddp train` checks a snapshot against the model before any worker starts: for a sharded
    run the shapes come from the manifest's layout (the model itself is in the rank files)."""
    first = _nanoddp_train(tmp_path, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        snapshot.load(snapshot.snapshot_path(tmp_path / "snapshots", 2))["objects"]["model"]["kind"] == "sharded_module"
    )
    again = _nanoddp_train(tmp_path, "--steps", "4", "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and "step 2" in again.stderr
    bigger = _nanoddp_train(tmp_path, "--steps", "6", "--resume", "auto", "--d-model", "64")
    assert bigger.returncode == 2, bigger.stderr[-3000:]  # refused in the launcher, named
    assert "does not fit this model" in bigger.stderr or "different configuration" in bigger.stderr
