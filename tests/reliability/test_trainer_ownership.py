"""What `nanoddp.Trainer` owns, it checks and gives back: the optimizer must step the model's own
parameters (else training changes nothing that is saved, and exits 0); a Trainer that fails in
construction or in `fit()` releases its run directory's lock and removes the directory it made
while that holds nothing but its own setup files (a notebook's corrected retry then works); and
the lock file is never followed through a symlink."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from helpers import FLAGS
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp import cli
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import rundir

ENV = DistEnv.single_process("gloo")
OPTIONS = {"steps": 2, "batch_size": 8, "log_every": 1, "progress": False, "engine": "single", "env": ENV}
OPTIONS["loss_fn"] = nn.functional.cross_entropy


def _data(n: int = 32) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x.sum(1) > 0).long())


def test_an_optimizer_of_another_models_parameters_is_refused(tmp_path):
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"none of the optimizer's 2 parameters are the model's") as info:
        nanoddp.Trainer(model, torch.optim.SGD(other.parameters(), lr=0.1), _data(), out=str(out), **OPTIONS)
    assert "\n" not in str(info.value) and not out.exists()
    mixed = torch.optim.SGD([*model.parameters(), other.bias], lr=0.1)
    with pytest.raises(ValueError, match=r"1 of the optimizer's 3 parameters are not the model's"):
        nanoddp.Trainer(model, mixed, _data(), out=str(out), **OPTIONS)
    # A subset of the model's parameters is fine (a frozen layer): it trains.
    before = model.bias.detach().clone()
    trainer = nanoddp.Trainer(model, torch.optim.SGD([model.weight], lr=0.1), _data(), out=str(out), **OPTIONS)
    trainer.fit()
    assert torch.equal(model.bias, before) and (out / "model.pt").exists()


def test_a_failed_construction_gives_back_the_run_directory(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        nanoddp.Trainer(model, optimizer, _data(4), out=str(out), **OPTIONS)  # fails in setup, after the lock
    assert not out.exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        nanoddp.Trainer(model, optimizer, _data(4), out=str(existing), **OPTIONS)
    assert (existing / "notes.txt").read_text() == "the user's"  # a directory it did not make is kept
    # The corrected retry, in the same process, is not refused naming this very pid.
    trainer = nanoddp.Trainer(model, optimizer, _data(), out=str(existing), **OPTIONS)
    trainer.fit()
    assert (existing / "model.pt").exists()


def _failing_loss(at_call: int):
    calls = []

    def loss_fn(output, target):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("bug in the loss")
        return nn.functional.cross_entropy(output, target)

    return loss_fn


def test_a_failed_fit_removes_the_directory_it_made_unless_work_was_saved(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "run"
    trainer = nanoddp.Trainer(model, optimizer, _data(), out=str(out), **{**OPTIONS, "loss_fn": _failing_loss(2)})
    with pytest.raises(RuntimeError, match="bug in the loss"):
        trainer.fit()
    assert not out.exists()  # only the lock, config.json and a metrics line of step 1: nothing to resume
    saved = tmp_path / "saved"
    options = {**OPTIONS, "steps": 3, "snapshot_every": 1}
    trainer = nanoddp.Trainer(model, optimizer, _data(), out=str(saved), **{**options, "loss_fn": _failing_loss(3)})
    with pytest.raises(RuntimeError, match="bug in the loss"):
        trainer.fit()
    assert list((saved / "snapshots").glob("step-*.pt"))  # a snapshot to resume: kept
    trainer = nanoddp.Trainer(model, optimizer, _data(), out=str(saved), **options)  # lock given back
    assert trainer.step == 2
    trainer.fit()


def _planted_lock(directory, victim):
    directory.mkdir()
    os.symlink(victim, directory / rundir.LOCK_NAME)


def test_a_symlinked_lock_file_is_refused_never_followed(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "run"
    _planted_lock(out, victim)
    with pytest.raises(ValueError, match=r"run/\.lock is a symbolic link, not a regular file.*remove it") as info:
        rundir.lock_run_dir(out)
    assert "\n" not in str(info.value)
    assert victim.read_text() == "keep me\n"
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        nanoddp.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), out=str(out), **OPTIONS)
    assert victim.read_text() == "keep me\n"
    dangling = tmp_path / "dangling"
    _planted_lock(dangling, tmp_path / "created-by-following")
    assert cli.main(["train", *FLAGS, "--out", str(dangling)]) == 2
    err = capsys.readouterr().err
    assert ".lock is a symbolic link" in err and err.count("\n") == 1, err
    assert not (tmp_path / "created-by-following").exists()
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / rundir.LOCK_NAME)
    with pytest.raises(ValueError, match=r"\.lock is a FIFO, not a regular file"):
        rundir.lock_run_dir(fifo)
