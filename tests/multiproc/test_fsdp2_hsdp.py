"""HSDP: `fully_shard` on a 2-D mesh (replicate, shard) at ws 4 = 2 x 2, against one process on
the concatenated batch. Gradients are reduce-scattered within each shard group, then all-reduced
across the replicas; an average over 4 ranks done as two averages over 2 must give the
one-process gradient. Tolerance: assert_close's float32 defaults (the one process sums the
batch inside one matmul, in another order)."""

from __future__ import annotations

import torch
import torch.nn as nn
from helpers import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from nanoddp.fsdp import fully_shard

STEPS = 2


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # dim 0 of 7 and 3: uneven at 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _hsdp(env) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model[0].weight.placements == (Replicate(), Shard(0))
    ref = build()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(STEPS):
        x, y = batch(step, env.rank)
        nn.functional.mse_loss(model(x), y).backward()
        xs, ys = zip(*(batch(step, r) for r in range(env.world_size)), strict=True)
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        for name, p in model.named_parameters():
            want = dict(ref.named_parameters())[name].grad
            torch.testing.assert_close(p.grad.full_tensor(), want, msg=lambda m, name=name: f"{name}.grad: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[name].detach())


def test_hsdp_2x2_matches_one_process():
    run_on_ranks(_hsdp, 4, timeout=300)
