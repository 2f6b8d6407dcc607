"""A Trainer snapshot is a `save_state` file: `nanoddp.load_state(snapshot, model=m, optimizer=o)`
reads one into a user's fresh objects, bitwise what the Trainer held (a replicated engine's,
fsdp's from its per-rank files, and a replicated one into a model sharded by `fully_shard`), a
model of other shapes refused naming the tensor; and a ZeroRedundancyOptimizer under torch's DDP
resumes bitwise. One launch of 2 ranks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_cases, suites_by_world_size
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.train.checkpoint import snapshot

STEPS = 4


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=generator)  # (64, 6)
    return TensorDataset(x, (x.sum(1) > 0).long())  # (64,) labels


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _fit(out: str, engine: str, steps: int = STEPS, zero: bool = False) -> nanoddp.Trainer:
    model = _model()
    if zero:
        optimizer = nanoddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = nanoddp.Trainer(
        model, optimizer, _data(), loss_fn=F.cross_entropy, steps=steps, batch_size=16, seed=7,
        engine=engine, out=out, snapshot_every=STEPS, progress=False,
    )  # fmt: skip
    trainer.fit()
    return trainer


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t  # collective for a DTensor


def _assert_same_optimizer(got: torch.optim.Optimizer, expected: torch.optim.Optimizer) -> None:
    """Per-parameter state bitwise (whole tensors: a DTensor's gathered) and the same hyperparameters."""
    params = [(p, q) for g, h in zip(got.param_groups, expected.param_groups, strict=True)
              for p, q in zip(g["params"], h["params"], strict=True)]  # fmt: skip
    for i, (p, q) in enumerate(params):
        assert got.state[p].keys() == expected.state[q].keys() and got.state[p], i
        for key, value in expected.state[q].items():
            assert torch.equal(_whole(got.state[p][key]), _whole(value)), (i, key)
    drop = ("params",)
    assert [{k: v for k, v in g.items() if k not in drop} for g in got.param_groups] == [
        {k: v for k, v in g.items() if k not in drop} for g in expected.param_groups
    ]


def case_replicated_snapshot_into_a_plain_model(env, tmp: str) -> None:
    trainer = _fit(f"{tmp}/torch", "torch")
    fresh = _model(seed=1)  # other weights: the test fails if nothing is loaded
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = nanoddp.load_state(
        snapshot.snapshot_path(f"{tmp}/torch/snapshots", STEPS), model=fresh, optimizer=optimizer
    )
    assert state["train"]["step"] == STEPS and state["train"]["world_size"] == env.world_size
    for name, value in trainer.module.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    _assert_same_optimizer(optimizer, trainer.optimizer)


def case_fsdp_snapshot_into_a_plain_model(env, tmp: str) -> None:
    """Every rank reads every rank's shard file and gets the whole model and optimizer state."""
    trainer = _fit(f"{tmp}/fsdp", "fsdp")
    fresh = _model(seed=1)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    nanoddp.load_state(snapshot.snapshot_path(f"{tmp}/fsdp/snapshots", STEPS), model=fresh, optimizer=optimizer)
    for name, value in trainer.engine.state_dict().items():  # collective: the whole model
        assert torch.equal(fresh.state_dict()[name], value), name
    _assert_same_optimizer(optimizer, trainer.optimizer)


def case_a_different_model_is_refused_naming_the_tensor(env, tmp: str) -> None:
    """The fsdp snapshot's pieces into a model of other shapes: one clear error on every rank."""
    torch.manual_seed(0)
    other = nanoddp.fsdp.fully_shard(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match=r"0\.weight was saved with shape \(16, 6\), here it is \(8, 6\)"):
        nanoddp.load_state(snapshot.snapshot_path(f"{tmp}/fsdp/snapshots", STEPS), model=other)


def case_replicated_snapshot_into_a_sharded_model(env, tmp: str) -> None:
    """A whole model and optimizer into `fully_shard`'s DTensors: each rank cuts its own rows."""
    trainer = _fit(f"{tmp}/torch-to-fsdp", "torch")
    sharded = nanoddp.fsdp.fully_shard(_model(seed=1))
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.5)
    path = snapshot.snapshot_path(f"{tmp}/torch-to-fsdp/snapshots", STEPS)
    nanoddp.load_state(path, model=sharded, optimizer=optimizer)
    for name, value in trainer.module.state_dict().items():
        assert torch.equal(_whole(sharded.state_dict()[name]), value), name
    assert all(isinstance(v, DTensor) for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    _assert_same_optimizer(optimizer, trainer.optimizer)


def case_zero_optimizer_under_torch_ddp_resumes_bitwise(env, tmp: str) -> None:
    whole = _fit(f"{tmp}/zero-whole", "torch", steps=2 * STEPS, zero=True)
    _fit(f"{tmp}/zero-split", "torch", zero=True)  # snapshot at STEPS, then a fresh process state
    resumed = _fit(f"{tmp}/zero-split", "torch", steps=2 * STEPS, zero=True)
    assert resumed.resumed_from == snapshot.snapshot_path(f"{tmp}/zero-split/snapshots", STEPS)
    for name, value in whole.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[name], value), name


def cases(tmp: str):
    fns = (
        case_replicated_snapshot_into_a_plain_model,
        case_fsdp_snapshot_into_a_plain_model,
        case_a_different_model_is_refused_naming_the_tensor,
        case_replicated_snapshot_into_a_sharded_model,
        case_zero_optimizer_under_torch_ddp_resumes_bitwise,
    )
    return [(fn.__name__.removeprefix("case_"), functools.partial(fn, tmp=tmp)) for fn in fns]


def snapshot_suite(env, out_dir: str) -> None:
    run_cases(env, cases(out_dir), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(snapshot_suite, tmp_path_factory, "trainer-snapshot", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [name for name, _ in cases("")])
def test_trainer_snapshot(suite, case):
    suite(2).check(case)
