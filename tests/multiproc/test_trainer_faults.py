"""Trainer faults the other tests could not see, each against a real reference: fp16 clipping
on the unscaled gradients (a hand-written GradScaler loop), the loss divided by `grad_accum`
(plain SGD on the global batch), sharded evaluation with ranks holding unequal numbers of eval
batches (one process over the same samples), the seed in the config fingerprint, and what a
resume with another `steps` does to the learning-rate schedule."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import SMALL, run_on_ranks
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import nanoddp
from nanoddp.dataclass_cli import to_dict
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import rundir
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.recipe import WarmupCosine
from nanoddp.train.trainer import Trainer

SEED, BATCH = 7, 16
EVAL_LEN = 33  # eval batches hold 16: rank 0's 17 samples make 2 batches, rank 1's 16 make 1


def _data(n: int = 96, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=generator)  # (n, 6)
    return TensorDataset(x, (x.sum(1) > 0).long())  # (n,) labels


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _trainer(out: Path | str, env: DistEnv | None = None, model: nn.Module | None = None, **options) -> Trainer:
    model = model or _model()
    options = {"steps": 1, "batch_size": BATCH, "seed": SEED, "grad_clip": 0.0, "engine": "single", **options}
    return nanoddp.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), _data(), loss_fn=F.cross_entropy, out=str(out),
        env=env, **options,
    )  # fmt: skip


def _first_global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's BATCH samples, whatever the world size: the sampler's first BATCH of epoch 0."""
    order = ResumableDistributedSampler(_data(), 1, 0, shuffle=True, seed=SEED).permutation(0)[:BATCH]
    x, y = _data().tensors
    return x[order], y[order]


def _one_sgd_step_on_the_global_batch() -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch, one plain SGD step, no clip."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _first_global_batch()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


# ---- two ranks, one launch -----------------------------------------------------------------


def _ws2_worker(env: DistEnv, tmp: str) -> dict:
    out = {}
    for engine in ("torch", "nanoddp"):  # 2 ranks x 2 micro-batches of 4 = the global batch of 16
        trainer = _trainer(f"{tmp}/accum-{engine}", env, engine=engine, grad_accum=2)
        trainer.fit()
        out[f"accum-{engine}"] = _params(trainer)
    eval_set = _data(EVAL_LEN, seed=1)
    for engine in ("zero2", "fsdp"):  # every forward of a sharded engine takes every rank
        model = _model()
        trainer = nanoddp.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.5), _data(), loss_fn=F.cross_entropy,
            eval_dataset=eval_set, out=f"{tmp}/eval-{engine}", steps=1, batch_size=BATCH, engine=engine,
        )  # fmt: skip
        out[f"eval-{engine}"] = trainer.evaluate()  # before any step: the weights are _model()'s
    return out


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    # ~10 s of work; a rank that skips its filler forward leaves fsdp's all-gather waiting forever,
    # so the limit is what turns that hang into a failure: 120 s is 10x the run, even under load
    return run_on_ranks(_ws2_worker, 2, str(tmp_path_factory.mktemp("faults-ws2")), timeout=120)


@pytest.mark.timeout(300)
def test_accumulated_sgd_step_equals_one_step_on_the_global_batch(ws2, tmp_path):
    """grad_accum=2 at ws 2, SGD, no clip: the update is lr x the global-batch mean gradient. A loss
    not divided by grad_accum doubles the gradient, and plain SGD shows it in the parameters."""
    expected = _one_sgd_step_on_the_global_batch()
    single = _trainer(tmp_path / "ws1", DistEnv.single_process("gloo"), grad_accum=2)
    single.fit()
    # Tolerance: the mean over 16 samples is summed as 4 (or 2 x 4 over ranks) partial means;
    # everything else (samples, weights, lr) is identical.
    assert_close(_params(single), expected, rtol=1e-5, atol=1e-6)
    for rank_results in ws2:
        for engine in ("torch", "nanoddp"):
            assert_close(rank_results[f"accum-{engine}"], expected, rtol=1e-5, atol=1e-6, msg=engine)


@pytest.mark.timeout(300)
def test_sharded_eval_with_unequal_batch_counts_equals_one_process(ws2):
    """33 eval samples: rank 0 runs 2 eval batches, rank 1 one real batch and one filler forward
    (sharded engines all-gather in forward, so every rank must run as many)."""
    x, y = _data(EVAL_LEN, seed=1).tensors
    with torch.no_grad():
        expected = F.cross_entropy(_model()(x), y).item()  # one process, all 33 samples at once
    for rank_results in ws2:
        for engine in ("zero2", "fsdp"):
            # Tolerance: per-batch float32 means weighted by their counts and summed in float64,
            # against one float32 mean over all 33 samples: a few float32 ulps apart.
            assert rank_results[f"eval-{engine}"] == pytest.approx(expected, rel=1e-6), engine


# ---- one process ---------------------------------------------------------------------------


def test_fp16_clips_the_unscaled_gradients(tmp_path):
    """amp fp16 with a clip that fires: the trainer's steps equal a hand-written GradScaler loop
    (scaler.unscale_(opt), then clip), and the gradients after clipping have norm grad_clip."""
    steps, clip = 3, 0.01
    trainer = _trainer(tmp_path, DistEnv.single_process("gloo"), steps=steps, amp="fp16", grad_clip=clip)
    trainer.fit()

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    sampler = ResumableDistributedSampler(_data(), 1, 0, shuffle=True, seed=SEED)
    loader = DataLoader(
        _data(), batch_size=BATCH, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(SEED)
    )
    norms = []
    for _, (x, y) in zip(range(steps), loader, strict=False):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss / 1).backward()
        scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        scaler.step(optimizer)
        scaler.update()
    assert all(torch.isfinite(n) and n > 10 * clip for n in norms), norms  # no step skipped, the clip fires
    for name, value in model.state_dict().items():
        assert torch.equal(trainer.module.state_dict()[name], value), name
    assert trainer.scaler.state_dict() == scaler.state_dict()
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.module.parameters()]))
    # clip_grad_norm_ scales by clip / (norm + 1e-6): the clipped norm is clip within 1e-6 relative
    assert clipped.item() == pytest.approx(clip, rel=1e-5)


def _single(config) -> Trainer:
    trainer = Trainer.from_config(config, DistEnv.single_process("gloo"))
    torch.set_num_threads(1)
    return trainer


def test_seed_is_part_of_the_fingerprint_and_resume_refuses_another(tmp_path):
    """The seed sets the initial weights and the data order: a snapshot of seed 1 is no start for seed 2."""
    config = replace(SMALL, seed=1, out=str(tmp_path), resume="never")
    assert rundir.fingerprint(to_dict(config)) != rundir.fingerprint(to_dict(replace(config, seed=2)))
    assert rundir.fingerprint(to_dict(config)) == rundir.fingerprint(to_dict(replace(config, steps=7)))
    _single(config).train()
    with pytest.raises(ValueError, match="different configuration \\(seed: 1 -> 2\\)"):
        _single(replace(config, seed=2, resume="auto"))
    assert _single(replace(config, resume="auto")).step == SMALL.steps  # the same seed resumes


def test_resume_with_more_steps_restretches_the_schedule_and_says_so(tmp_path, caplog):
    """`--steps` is the run's length, and the warmup-cosine schedule is a function of it (as in
    nanoGPT's get_lr or a Hugging Face Trainer's scheduler): resuming a 6-step snapshot with
    --steps 12 continues on the 12-step schedule, and one log line says so."""
    base = replace(SMALL, steps=6, warmup_steps=2, snapshot_every=6, out=str(tmp_path / "run"), resume="auto")
    _single(base).train()
    longer = replace(base, steps=12)
    with caplog.at_level(logging.INFO, logger="nanoddp"):
        resumed = _single(longer)
    lines = [r.getMessage() for r in caplog.records if "steps changed" in r.getMessage()]
    lr, ratio = resumed.scheduler.base_lrs[0], base.min_lr_ratio
    old_lr, new_lr = lr * WarmupCosine(2, 6, ratio)(6), lr * WarmupCosine(2, 12, ratio)(6)
    assert lines == [
        "steps changed from 6 to 12 on resume: the warmup-cosine schedule is re-stretched over 12 steps from "
        f"step 6 (lr {old_lr:.3g} -> {new_lr:.3g})"
    ], caplog.text
    reference = _single(replace(longer, out=str(tmp_path / "fresh"), resume="never"))
    reference.train(stop_after=6)
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    resumed_log, reference_log = resumed.train(), reference.train()  # steps 7..12 on both
    assert resumed_log["lr"] == reference_log["lr"] and resumed_log["step"] == 12
    assert resumed.scheduler.get_last_lr() == reference.scheduler.get_last_lr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanoddp"):  # the same steps: nothing to say, nothing changed
        again = _single(replace(longer, steps=12, snapshot_every=0))
    assert "steps changed" not in caplog.text and again.step == 12


def test_resume_with_other_steps_and_a_user_scheduler_says_it_keeps_its_state(tmp_path, caplog):
    def fit(steps: int) -> Trainer:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        trainer = nanoddp.Trainer(
            model, optimizer, _data(), loss_fn=F.cross_entropy, lr_scheduler=scheduler, out=str(tmp_path),
            env=DistEnv.single_process("gloo"), steps=steps, batch_size=BATCH, engine="single", resume="auto",
        )  # fmt: skip
        trainer.fit()
        return trainer

    fit(3)
    with caplog.at_level(logging.INFO, logger="nanoddp"):
        trainer = fit(5)
    lines = [r.getMessage() for r in caplog.records if "steps changed" in r.getMessage()]
    assert lines == [
        "steps changed from 3 to 5 on resume: the lr_scheduler continues from its saved state at step 3, "
        "lengths it saved (such as T_max) included; to follow 5 steps, set them on trainer.scheduler before fit()"
    ], caplog.text
    assert trainer.scheduler.T_max == 3  # torch's load_state_dict restored the saved length, as the line says
