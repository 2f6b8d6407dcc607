"""A run directory has one owner and never loses or mixes work: the lock, unique default names,
run id and fingerprint, `--resume never` / `--overwrite`, and resume refusals. One process,
no torchrun: every refusal here happens in the launcher before any worker would start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import psutil
import pytest
import torch
from helpers import FLAGS, SMALL

from nanoddp import cli
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import rundir, snapshot
from nanoddp.train.config import TrainConfig
from nanoddp.train.data.datasets import build_datasets
from nanoddp.train.launcher import preflight
from nanoddp.train.trainer import Trainer


def _train(config: TrainConfig) -> Trainer:
    trainer = Trainer.from_config(config, DistEnv.single_process("gloo"))
    torch.set_num_threads(1)
    trainer.train()
    return trainer


def _spec():
    return build_datasets(SMALL.data, SMALL.seq_len, SMALL.val_fraction, SMALL.text_max_bytes)[2]


@pytest.mark.timeout(60)
def test_second_run_on_a_locked_dir_refuses_naming_the_holder(tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from nanoddp.train.checkpoint import rundir;"
         "rundir.lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli.main(["train", *FLAGS, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"in use by another run (pid {holder.pid})" in err and err.count("\n") == 1, err
        holder.send_signal(signal.SIGKILL)  # the kernel releases the lock of a dead holder
        holder.wait(timeout=30)
        fd = rundir.lock_run_dir(tmp_path)
        assert int((tmp_path / ".lock").read_text()) == psutil.Process().pid
        with pytest.raises(rundir.RunDirBusy):  # a second open file in this process is refused too
            rundir.lock_run_dir(tmp_path)
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_default_run_names_are_unique():
    names = {rundir.default_run_dir() for _ in range(50)}  # all in the same second
    assert len(names) == 50


def test_run_id_and_fingerprint_in_config_and_snapshots(tmp_path):
    trainer = _train(replace(SMALL, out=str(tmp_path), resume="never"))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["run_id"] == trainer.run_id and len(trainer.run_id) == 12
    assert saved["fingerprint"] == rundir.fingerprint(
        {k: v for k, v in saved.items() if k not in ("run_id", "fingerprint")}
    )
    for _, path in snapshot.list_snapshots(tmp_path / "snapshots"):
        state = snapshot.train_state(snapshot.load(path), path)
        assert state["run_id"] == trainer.run_id and state["fingerprint"] == saved["fingerprint"]
    resumed = Trainer.from_config(
        replace(SMALL, out=str(tmp_path), steps=5, resume="auto"), DistEnv.single_process("gloo")
    )
    assert resumed.step == 3 and resumed.run_id == trainer.run_id  # resuming continues the same run
    assert cli.main(["sample", "--run", str(tmp_path), "--tokens", "5"]) == 0  # config.json still loads


def test_resume_never_on_a_run_with_snapshots_refuses_unless_overwrite(tmp_path, capsys):
    _train(replace(SMALL, out=str(tmp_path), resume="never"))
    before = {p.name: p.read_bytes() for _, p in snapshot.list_snapshots(tmp_path / "snapshots")}
    assert cli.main(["train", *FLAGS, "--out", str(tmp_path), "--resume", "never"]) == 2
    assert "already holds snapshots of an earlier run" in capsys.readouterr().err
    with pytest.raises(ValueError, match="already holds snapshots"):  # the Trainer API refuses too
        Trainer.from_config(replace(SMALL, out=str(tmp_path), resume="never"), DistEnv.single_process("gloo"))
    status = preflight.prepare_run_dir(replace(SMALL, out=str(tmp_path), resume="never"), _spec(), overwrite=True)
    assert "earlier outputs moved to" in status and status.endswith("starting fresh at step 0")
    (aside,) = tmp_path.glob("previous-*")
    assert {p.name: p.read_bytes() for _, p in snapshot.list_snapshots(aside / "snapshots")} == before
    assert (aside / "model.pt").is_file() and not (tmp_path / "model.pt").exists()
    assert not rundir.has_snapshots(tmp_path)


def test_resume_with_a_different_configuration_names_the_fields(tmp_path, capsys):
    _train(replace(SMALL, out=str(tmp_path), resume="never"))
    assert cli.main(["train", *FLAGS, "--out", str(tmp_path), "--seq-len", "32", "--lr", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "lr: 0.002 -> 0.01" in err and "seq_len: 16 -> 32" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="seq_len: 16 -> 32"):
        Trainer.from_config(replace(SMALL, out=str(tmp_path), seq_len=32), DistEnv.single_process("gloo"))
    # fields that may change (run length, logging, engine) resume fine
    status = preflight.prepare_run_dir(replace(SMALL, out=str(tmp_path), steps=9, log_every=3), _spec(), False)
    assert status.startswith("resuming from") and "(step 3)" in status


def test_resume_path_without_a_valid_snapshot_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["train", *FLAGS, "--out", str(tmp_path / "a"), "--resume", str(empty)]) == 2
    assert f"no valid snapshot (step-*.pt) in {empty}" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt" / "snapshots"
    corrupt.mkdir(parents=True)
    (corrupt / "step-00000005.pt").write_bytes(b"garbage")
    assert cli.main(["train", *FLAGS, "--out", str(tmp_path / "b"), "--resume", str(corrupt.parent)]) == 2
    assert "no valid snapshot" in capsys.readouterr().err
    (corrupt / "step-00000009.pt").write_bytes(b"more garbage")
    launched = subprocess.run(  # as a user sees it: the whole of stderr is one line naming both files
        [sys.executable, "-m", "nanoddp", "train", *FLAGS, "--out", str(tmp_path / "d"),
         "--resume", str(corrupt.parent)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 2 and len(launched.stderr.strip().splitlines()) == 1, launched.stderr
    assert "2 did not verify" in launched.stderr and "step-00000005.pt" in launched.stderr
    with pytest.raises(ValueError, match="no valid snapshot"):
        Trainer.from_config(replace(SMALL, out=str(tmp_path / "c"), resume=str(empty)), DistEnv.single_process("gloo"))


def test_resume_auto_on_an_empty_dir_starts_fresh_and_says_so(tmp_path, caplog):
    status = preflight.prepare_run_dir(replace(SMALL, out=str(tmp_path), resume="auto"), _spec(), False)
    assert status == "no snapshot to resume: starting fresh"
    with caplog.at_level("INFO"):
        trainer = Trainer.from_config(replace(SMALL, out=str(tmp_path), resume="auto"), DistEnv.single_process("gloo"))
    assert trainer.step == 0 and "starting fresh at step 0" in caplog.text
