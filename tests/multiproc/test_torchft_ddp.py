"""torchft's own fault-tolerant DDP on `nanoddp train`'s job (`nanoddp.bench.torchft_ddp`), the
third mode of `nanoddp bench restarts --cost-trials`: without failures it must train what
`nanoddp train --on-failure continue` trains.

One launch of each, 2 replicas, at the same time (the tiny GPT job of tests/multiproc/test_ft.py,
5 steps): torchft's launcher and `nanoddp train`. Both take the same samples at every step (the
shards of torchft's sampler are interleaved pieces of the same seeded permutation that
`nanoddp.ft` cuts into contiguous pieces) and average the same gradients.
[Note: why a tolerance] The replicas' pieces hold the same samples in a different order and
split (replica r takes every other sample rather than a half), so each piece's mean loss and
gradient are summed in another order: the averages agree to float rounding, not bitwise, and
AdamW carries that rounding into the weights (seen: 1.2e-7 after 5 steps). atol 1e-5 is ~100x
that, and ~100x below what one step moves a weight (lr 1e-3 with Adam's normalised step), so
a replica that trained on its own piece alone, or a missed average, is far outside it.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.testing import assert_close

from nanoddp.base.records import read_records, step_records
from nanoddp.bench.training_run import run_training

STEPS = 5
JOB = [
    "--nproc", "2", "--on-failure", "continue", "--steps", str(STEPS), "--collective-timeout", "20",
    "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
    "--d-ff", "64", "--batch-size", "12", "--warmup-steps", "2", "--seed", "0", "--snapshot-every", "0",
    "--eval-every", "0", "--log-every", "1", "--no-progress",
]  # fmt: skip
ATOL = 1e-5  # see the module docstring


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, launched together (one wall time for two): {"torchft": dir, "continue": dir}."""
    root = tmp_path_factory.mktemp("torchft-ddp")
    commands = {
        "torchft": [sys.executable, "-m", "nanoddp.bench.torchft_ddp"],
        "continue": [sys.executable, "-m", "nanoddp", "train"],
    }
    with ThreadPoolExecutor(len(commands)) as pool:  # forked from the fork server: imports shared
        done = {name: pool.submit(run_training, [*command, *JOB, "--out", str(root / name)], root / name,
                                  timeout_s=240, forked=True)
                for name, command in commands.items()}  # fmt: skip
    for name, run in done.items():
        assert run.result().returncode == 0, f"{name}:\n{run.result().output[-5000:]}"
    return {name: root / name for name in commands}


def _steps(run_dir) -> list[dict]:
    return step_records(read_records(run_dir))


def _initial_weights() -> dict[str, torch.Tensor]:
    from nanoddp.train.config import TrainConfig
    from nanoddp.train.recipe import build_job

    config = TrainConfig(
        text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12,
        warmup_steps=2, seed=0, steps=STEPS,
    )  # fmt: skip
    return build_job(config).module.state_dict()


def test_torchft_ddp_ends_close_to_continue(runs):
    got = torch.load(runs["torchft"] / "model.pt")
    want = torch.load(runs["continue"] / "model.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=name)
    # the tolerance is small against what training moved: a model that did not train would not pass
    start = _initial_weights()
    moved = max((want[name] - start[name]).abs().max().item() for name in want)
    assert moved > 100 * ATOL, moved


def test_torchft_ddp_writes_the_trainers_step_records(runs):
    got, want = _steps(runs["torchft"]), _steps(runs["continue"])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # one record per committed step, from 1
    assert all(r.keys() == want[0].keys() and r["world_size"] == 2 for r in got)
    # the loss recorded is the global batch's mean (averaged over the replicas), as continue's is
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], atol=1e-5, rtol=0)
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
