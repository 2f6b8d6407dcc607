"""`nanoddp.Trainer` on models and data it did not build: the batch rules against a hand-written
loop (bitwise), exact resume with an fp16 GradScaler, ws=2 against one process, clear errors,
and `examples/your_model.py` (a SIGKILLed worker under `nanoddp run`, bitwise resume)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_on_ranks
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nanoddp
from nanoddp.base.records import read_records
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.data.sampler import ResumableDistributedSampler

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED = 7
BATCH = 16


def _data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=generator)  # (n, 6)
    return TensorDataset(x, (x.sum(1) > 0).long())  # (n,) labels


class DictData(Dataset):
    """Hugging Face style samples: dicts holding the inputs and the labels."""

    def __init__(self, base: TensorDataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.base[i]
        return {"features": x, "labels": y}


class Classifier(nn.Module):
    """Logits from features; `style` picks what forward returns (the three rules of the Trainer)."""

    def __init__(self, style: str = "logits"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        self.style = style

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(features)  # (B, 2)
        if self.style == "logits":
            return logits
        loss = F.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits) if self.style == "hf" else loss


STYLES = {  # style -> (dataset, trainer kwargs, the loss a hand-written loop computes)
    "loss_fn": (lambda: _data(), {"loss_fn": F.cross_entropy}, lambda m, b: F.cross_entropy(m(b[0]), b[1])),
    "hf": (lambda: DictData(_data()), {}, lambda m, b: m(**b).loss),
    "scalar": (lambda: _data(), {}, lambda m, b: m(*b)),
}


def _hand_loop(style: str, dataset, steps: int) -> dict[str, torch.Tensor]:
    """The loop a user would write: the same sampler and order, no Trainer."""
    model = Classifier("logits" if style == "loss_fn" else style)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ResumableDistributedSampler(dataset, 1, 0, shuffle=True, seed=SEED)
    loader = DataLoader(
        dataset, batch_size=BATCH, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(SEED)
    )
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            (STYLES[style][2](model, batch) / 1).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    return model.state_dict()


def _fit(style: str, out: Path, steps: int, **options) -> nanoddp.Trainer:
    make_data, kwargs, _ = STYLES[style]
    model = Classifier("logits" if style == "loss_fn" else style)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options = {"steps": steps, "batch_size": BATCH, "seed": SEED, "grad_clip": 0.0, "engine": "single", **options}
    trainer = nanoddp.Trainer(
        model, optimizer, make_data(), **kwargs, out=str(out), env=DistEnv.single_process("gloo"), **options
    )
    trainer.fit()
    return trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", list(STYLES))
def test_each_batch_rule_equals_a_hand_written_loop_bitwise(style, tmp_path):
    steps = 9  # more than one epoch (96 samples / 16 = 6 steps per epoch)
    trainer = _fit(style, tmp_path, steps)
    expected = _hand_loop(style, STYLES[style][0](), steps)
    exported = torch.load(tmp_path / "model.pt")
    assert exported.keys() == expected.keys()  # no "module." prefix
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name
        assert torch.equal(trainer.module.state_dict()[name], value), name
    records = read_records(tmp_path)
    assert records and records[-1]["step"] == 9


@pytest.mark.timeout(120)
def test_resume_with_an_fp16_grad_scaler_is_bitwise(tmp_path):
    straight = _fit("loss_fn", tmp_path / "straight", 8, amp="fp16", snapshot_every=4)
    _fit("loss_fn", tmp_path / "split", 4, amp="fp16", snapshot_every=4)
    first = snapshot.load(snapshot.snapshot_path(tmp_path / "split" / "snapshots", 4))
    assert first["objects"]["scaler"]["state"]["scale"] > 1  # the scaler's state is saved
    resumed = _fit("loss_fn", tmp_path / "split", 8, amp="fp16", snapshot_every=4)
    assert resumed.resumed_from is not None
    for name, value in straight.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[name], value), name
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()


def _ws_worker(env: DistEnv, out: str, engine: str) -> dict[str, torch.Tensor]:
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = nanoddp.Trainer(
        model, optimizer, _data(), loss_fn=F.cross_entropy, steps=5, batch_size=BATCH, seed=SEED,
        grad_clip=0.0, engine=engine, out=out,
    )  # fmt: skip
    trainer.fit()
    return {k: v.clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["nanoddp", "torch"])
def test_two_ranks_equal_one_process_on_the_global_batch(engine, tmp_path):
    """The process group comes from the launcher (file:// store): the Trainer joins it."""
    distributed = run_on_ranks(_ws_worker, 2, str(tmp_path / "ws2"), engine, timeout=150)
    single = _fit("loss_fn", tmp_path / "ws1", 5).module.state_dict()
    # Tolerance: two half-batch mean gradients averaged over ranks sum in another order than
    # one full-batch mean; everything else (data order, initial weights, steps) is identical.
    for name, value in single.items():
        torch.testing.assert_close(distributed[0][name], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(distributed[0][name], distributed[1][name])


def test_options_and_batches_that_cannot_work_are_named(tmp_path):
    model, data = Classifier(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    env = DistEnv.single_process("gloo")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['stpes'\]"):
        nanoddp.Trainer(model, optimizer, data, stpes=3, env=env, out=str(tmp_path))
    with pytest.raises(TypeError, match="lr describes nanoddp train's built-in setup: set it on your optimizer"):
        nanoddp.Trainer(model, optimizer, data, lr=0.1, env=env, out=str(tmp_path))
    with pytest.raises(ValueError, match="engine 'zero1' shards the optimizer state: pass a nanoddp.ZeroRedundancy"):
        nanoddp.Trainer(model, optimizer, data, engine="zero1", env=env, out=str(tmp_path))
    trainer = nanoddp.Trainer(model, optimizer, data, engine="single", env=env, out=str(tmp_path / "a"))
    with pytest.raises(TypeError, match=r"returned \(16, 2\), not a loss: pass loss_fn"):
        trainer.fit()
    trainer = nanoddp.Trainer(
        model, optimizer, DictData(data), loss_fn=F.cross_entropy, engine="single", env=env, out=str(tmp_path / "b")
    )
    with pytest.raises(TypeError, match="with loss_fn, each batch must be an \\(inputs, target\\) pair, got dict"):
        trainer.fit()


@pytest.mark.timeout(420)
def test_your_model_example_survives_a_sigkilled_worker_bitwise(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "your_model.py"), "--out", str(tmp_path), "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "rank 1: simulated crash (SIGKILL) at step 12" in out
    assert re.search(r"restart 1: resumed from .*step-0*10\.pt \(step 10", out), out[-3000:]
    assert "crash + restart + resume == uninterrupted, bitwise: True" in out
    accuracy = float(re.search(r"eval accuracy (\S+)", out).group(1))
    assert accuracy > 0.5  # four classes: chance is 0.25
