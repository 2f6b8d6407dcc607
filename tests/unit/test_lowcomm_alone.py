"""LocalSGD and DiLoCo in a process with no process group: one rank, as our DDP treats it.

References: LocalSGD alone is its inner optimizer (the average of one replica is itself); DiLoCo
alone is the outer SGD stepped on (last sync - now) every `sync_every` inner steps, replayed here
with torch's own optimizers on a copy of the model: the paper's Nesterov momentum, and plain SGD
(`outer_momentum=0`, which torch's SGD takes without Nesterov).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import nanoddp

STEPS, H = 5, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, after_step=lambda step: None) -> None:
    for step, (x, y) in enumerate(_batches(), start=1):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        after_step(step)


def test_localsgd_without_a_group_is_its_inner_optimizer():
    assert not dist.is_initialized()
    ours, plain = _model(), _model()
    _train(ours, nanoddp.LocalSGD(torch.optim.SGD(ours.parameters(), lr=0.1), sync_every=H))
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_diloco_without_a_group_is_the_outer_step_on_one_replica(momentum):
    assert not dist.is_initialized()
    ours, ref = _model(), _model()
    inner = torch.optim.AdamW(ours.parameters(), lr=0.01)
    _train(ours, nanoddp.DiLoCo(inner, sync_every=H, outer_momentum=momentum))

    synced = copy.deepcopy(list(ref.parameters()))
    outer = torch.optim.SGD(synced, lr=0.7, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def outer_step(step: int) -> None:
        if step % H:
            return
        for s, p in zip(synced, ref.parameters(), strict=True):
            s.grad = s - p
        outer.step()
        for s, p in zip(synced, ref.parameters(), strict=True):
            p.copy_(s)

    _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), outer_step)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
