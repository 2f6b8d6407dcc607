"""no_sync checked by gradient values, after every micro-step, not by launch counts.

Two micro-batches per rank, the first inside no_sync. After the first backward each rank must
hold its OWN local gradient (nothing averaged yet, so ranks differ); after the second, synced
one, every rank holds the full-batch gradient of a single process that saw every rank's two
micro-batches. A no_sync that still reduces passes the final check (the average of sums is
the sum of averages), so the first check is the one that catches it. Checked for nanoddp DDP
on both comm backends, torch DDP (the behaviour we copy) and a manual engine's micro_step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import run_on_ranks

import nanoddp
from nanoddp.train.engines import build_engine

WORLD_SIZE = 2
BATCH = 4  # per rank and micro-step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)


def _loss(model: nn.Module, rank: int, micro: int) -> torch.Tensor:
    x, y = _batch(rank, micro)
    return nn.functional.mse_loss(model(x), y)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _local_then_synced(env, wrapper: str) -> dict:
    """This rank's gradients after micro-step 1 (no_sync) and micro-step 2 (synced)."""
    module = _model()
    if wrapper == "allreduce":  # a manual engine: the sync runs after the last micro-step's backward
        engine = build_engine("allreduce", module, env)
    elif wrapper == "torch":
        engine = build_engine("torch", module, env)
    else:
        ddp = nanoddp.DistributedDataParallel(module, comm_backend=wrapper)
        engine = nanoddp.train.engines.Engine(wrapper, ddp, module)
    out = {}
    for micro, name in ((0, "local"), (1, "synced")):
        with engine.micro_step(sync=micro == 1):
            _loss(engine.model, env.rank, micro).backward()
        out[name] = _grads(module)
    return out


def _references() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """(each rank's own micro-batch-0 gradient, the full-batch gradient), in one process."""
    model = _model()
    local = []
    for rank in range(WORLD_SIZE):
        model.zero_grad()
        _loss(model, rank, 0).backward()
        local.append(_grads(model))
    full = copy.deepcopy(model)
    full.zero_grad()
    for rank in range(WORLD_SIZE):
        for micro in (0, 1):
            (_loss(full, rank, micro) / WORLD_SIZE).backward()  # DDP averages over ranks, sums micro-steps
    return local, _grads(full)


@pytest.mark.parametrize("wrapper", ["nanoddp", "torch", "allreduce"])
def test_gradients_stay_local_until_the_synced_micro_step(wrapper):
    local, full = _references()
    results = run_on_ranks(_local_then_synced, WORLD_SIZE, wrapper, timeout=120)
    for rank, result in enumerate(results):
        # fp32 sums in a different order than the reference: a few ulps
        torch.testing.assert_close(result["local"], local[rank], rtol=0, atol=0)
        torch.testing.assert_close(result["synced"], full, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(local[0], local[1], strict=True)), "ranks' data must differ"
