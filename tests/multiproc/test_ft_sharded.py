"""`nanoddp train --on-failure continue` with snapshots, evaluation, resume and the sharded engines.

Every run here is 3 replicas of a tiny GPT for a few steps (a launch costs seconds: the quorum
service and three processes that import torch). The references are real runs and a replay:
- a continue run resumed from its own snapshot ends bitwise equal to the same run uninterrupted
  (both sum the same pieces in the same order from the same state);
- the restart path (`nanoddp train`, the Trainer) resumes from a continue run's snapshot;
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

TINY_GPT = [
    "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
    "--d-ff", "64", "--batch-size", "12", "--warmup-steps", "2", "--seed", "0", "--log-every", "1",
    "--no-progress", "--collective-timeout", "10",
]  # fmt: skip
STEPS, EVERY = 6, 3


def _train(out: Path, *flags: str, on_failure: str = "continue", nproc: int = 3) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", on_failure, "--nproc", str(nproc)]
    command += ["--steps", str(STEPS), "--snapshot-every", str(EVERY), "--eval-every", str(EVERY)]
    done = subprocess.run([*command, "--out", str(out), *TINY_GPT, *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_model(got: Path, want: Path) -> None:
    a, b = torch.load(got), torch.load(want)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: {(a[name] - b[name]).abs().max()}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The uninterrupted continue run of engine nanoddp: snapshots at 3 and 6, evaluations there."""
    out = tmp_path_factory.mktemp("plain") / "run"
    _train(out)
    return out


def test_continue_writes_snapshots_and_evaluates(plain):
    from nanoddp.train.checkpoint import snapshot

    assert [step for step, _ in snapshot.list_snapshots(plain / "snapshots")] == [6, 3]
    state = snapshot.load_checked(plain / "snapshots" / "step-00000003.pt")
    assert sorted(state["objects"]) == ["model", "optimizer", "sampler", "scheduler", "train"]
    train = snapshot.train_state(state, "step 3")
    assert (train["step"], train["history"], train["config"]["on_failure"]) == (3, [3, 3, 3], "continue")
    assert len(state["objects"]["optimizer"]["state"]["state"]) == sum(1 for _ in torch.load(plain / "model.pt"))
    evals = [(r["step"], r["world_size"]) for r in _records(plain) if r.get("event") == "eval"]
    assert evals == [(3, 3), (6, 3)]


def test_continue_resumed_from_its_snapshot_equals_the_uninterrupted_run_bitwise(plain, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(plain, out)  # as if the whole job had died after step 4: the newest snapshot is step 3
    (out / "snapshots" / "step-00000006.pt").unlink()
    (out / "model.pt").unlink()
    done = _train(out, "--resume", "auto")
    output = done.stdout + done.stderr
    assert "resumed from" in output and "(step 3)" in output, output[-3000:]
    _assert_same_model(out / "model.pt", plain / "model.pt")
    steps = [r["step"] for r in _records(out) if "event" not in r]
    assert steps == list(range(1, STEPS + 1)), steps  # the records after the snapshot were redone, once


def test_restart_resumes_from_a_continue_snapshot(plain, tmp_path):
    """The Trainer (the restart path's loop, here in this process) reads it: model, AdamW,
    schedule, sampler position. One process sums the batch as one piece, the continue run as
    three weighted pieces (another order of float additions): the losses agree to float32
    rounding, not bitwise."""
    from nanoddp.env import DistEnv
    from nanoddp.train.config import TrainConfig
    from nanoddp.train.trainer import Trainer

    config = TrainConfig(
        engine="single", text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12,
        warmup_steps=2, seed=0, steps=STEPS, snapshot_every=EVERY, eval_every=EVERY, log_every=1, progress=False,
        out=str(tmp_path / "run"), resume=str(plain / "snapshots" / "step-00000003.pt"),
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        trainer = Trainer.from_config(config, DistEnv.single_process("gloo"))
        assert trainer.step == 3 and trainer.sampler.position == 3 * 12
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    want = {r["step"]: r for r in _records(plain) if "event" not in r}
    got = [r for r in _records(tmp_path / "run") if "event" not in r and "loss" in r]
    assert [r["step"] for r in got] == [4, 5, 6]
    for record in got:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)
