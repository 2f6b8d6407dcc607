"""The trainer on sharded engines (zero2, fsdp): clipping by the global norm, the whole model in
snapshots and model.pt, per-rank optimizer state, bitwise resume, and evaluation with uneven
validation shards (every FSDP forward all-gathers, so every rank must run as many)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from helpers import TINY, run_on_ranks, train_tiny, trainer_params

from nanoddp.env import DistEnv
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
        train_tiny(replace(base, out=f"{tmp}/split-{engine}"), env, stop_after=STOP)
        resumed = Trainer.from_config(replace(base, out=f"{tmp}/split-{engine}", resume="auto"), env)
        assert resumed.step == STOP
        resumed.train()
        dist.barrier()
        resumed_model = torch.load(f"{tmp}/split-{engine}/model.pt", weights_only=True)
        for key, value in out[engine].items():  # bitwise, on every rank
            assert torch.equal(value, resumed_model[key]), (engine, key)
    return out


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
