"""A NaN loss on one rank never reaches the weights, the snapshots or `model.pt`.

The reported case: rank 1's loss NaN from step 3 of 8, snapshots every 2, keep 3. Before the
check, the NaN gradients were all-reduced into every rank's weights: snapshots 4, 6, 8 and
`model.pt` all NaN, and pruning deleted snapshot 2, the last finite one. The reference is the
same run stopped after step 2 with no NaN at all: its `model.pt` is what snapshot 2 must hold
(`--on-nan stop`), and what every later state must still be when each update from step 3 on is
skipped (`--on-nan skip`), bitwise: a skipped step changes no weight and no optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_on_ranks
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.base.records import read_records
from nanoddp.env import DistEnv
from nanoddp.train import step_check
from nanoddp.train.checkpoint import snapshot

NAN_FROM_STEP = 3


def _trainer(env: DistEnv, out: str, nan_on_rank: int | None, **options) -> nanoddp.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(128, 6, generator=torch.Generator().manual_seed(0))  # (128, 6)
    calls = {"n": 0}  # one micro-batch per step, no eval set: the call count is the step number

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = F.cross_entropy(logits, target)
        return loss * float("nan") if env.rank == nan_on_rank and calls["n"] >= NAN_FROM_STEP else loss

    options = {
        "steps": 8,
        "batch_size": 8,
        "snapshot_every": 2,
        "keep_snapshots": 3,
        "seed": 5,
        "log_every": 1,
        **options,
    }
    return nanoddp.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), TensorDataset(x, (x.sum(1) > 0).long()),
        loss_fn=loss_fn, out=out, engine="nanoddp", progress=False, env=env, **options,
    )  # fmt: skip


def _worker(env: DistEnv, tmp: str) -> dict:
    _trainer(env, f"{tmp}/reference", None, steps=NAN_FROM_STEP - 1).fit()
    try:
        _trainer(env, f"{tmp}/stop", nan_on_rank=1).fit()
        stopped = None
    except Exception as exc:
        stopped = f"{type(exc).__name__}: {exc}"
    skipping = _trainer(env, f"{tmp}/skip", nan_on_rank=1, on_nan="skip")
    skipping.fit()
    adam_steps = {int(s["step"]) for s in skipping.optimizer.state_dict()["state"].values()}
    return {"stopped": stopped, "adam_steps": adam_steps}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("nonfinite")
    return tmp, run_on_ranks(_worker, 2, str(tmp), timeout=150)


def _model_of(snapshot_state: dict) -> dict[str, torch.Tensor]:
    return snapshot_state["objects"]["model"]["state"]


@pytest.mark.timeout(200)
def test_stop_raises_on_every_rank_before_the_nan_reaches_the_weights(runs):
    tmp, got = runs
    line = (
        f"NonFiniteLoss: step {NAN_FROM_STEP}: the loss is NaN or inf on rank(s) 1; stopped before the optimizer step"
    )
    assert [r["stopped"][: len(line)] for r in got] == [line, line], got
    steps = [step for step, _ in snapshot.list_snapshots(tmp / "stop" / "snapshots")]
    assert steps == [NAN_FROM_STEP - 1]
    assert not (tmp / "stop" / "model.pt").exists()
    reference = torch.load(tmp / "reference" / "model.pt")
    saved = _model_of(snapshot.load(snapshot.snapshot_path(tmp / "stop" / "snapshots", NAN_FROM_STEP - 1)))
    assert saved.keys() == reference.keys() and all(torch.equal(saved[k], reference[k]) for k in reference)


@pytest.mark.timeout(200)
def test_skip_drops_every_nan_update_and_pruning_keeps_the_last_finite_snapshot(runs):
    tmp, got = runs
    assert all(r["adam_steps"] == {NAN_FROM_STEP - 1} for r in got), got  # on every rank: 6 skips
    reference = torch.load(tmp / "reference" / "model.pt")
    final = torch.load(tmp / "skip" / "model.pt")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
    listed = snapshot.list_snapshots(tmp / "skip" / "snapshots")
    assert [step for step, _ in listed] == [8, 6, 4, 2]  # keep 3, and the newest finite one
    assert [snapshot.train_state(snapshot.load(p), p)["loss_finite"] for _, p in listed] == [False, False, False, True]
    records = read_records(tmp / "skip")
    events = [r for r in records if r.get("event") == "nonfinite_loss"]
    assert [(e["step"], e["ranks"], e["action"]) for e in events] == [(s, [1], "skipped") for s in range(3, 9)]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}  # a step's log: its loss, None when skipped
    assert all(losses[step] is not None for step in (1, 2)) and all(losses[step] is None for step in range(3, 9))


def test_model_pt_is_refused_from_a_nonfinite_state():
    """The last guard: a state that went non-finite with finite losses (an inf gradient) is no model.pt."""
    env = DistEnv.single_process("gloo")
    state = {"w": torch.ones(2), "b": torch.tensor([0.0, float("inf")]), "count": torch.tensor(3)}
    with pytest.raises(step_check.NonFiniteLoss, match=r"^model\.pt not written: b hold NaN or inf after step 7$"):
        step_check.refuse_nonfinite_export(state, 7, env)
    step_check.refuse_nonfinite_export({"w": torch.ones(2), "count": torch.tensor(3)}, 7, env)  # finite: written
