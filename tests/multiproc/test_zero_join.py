"""ZeroRedundancyOptimizer under torch's Join with uneven inputs (ws=2, ranks with 5 / 3 batches).

Reference: torch's DDP + torch's ZeroRedundancyOptimizer run the same way. torch's optimizer
splits by whole parameters, so nanoddp's runs with partition="parameter" (the same greedy
split): a joined rank steps its shard on the `.grad` its last backward left (that is what
torch's join hook does), so which rank owns what shows in the result. Bitwise: at ws=2 each
averaged gradient element is a*0.5 + b*0.5 (b = 0 from a joined rank) in both stacks, and the
optimizers run the same elementwise math on the same values.

Without the optimizer in the Join (the old code could not be given to Join: not a Joinable),
the training rank's step waits for a shard broadcast the joined rank never sends.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from nanoddp import DistributedDataParallel
from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer

BATCHES = (5, 3)  # per rank: rank 1 joins after 3 iterations, rank 0 is the last joiner
BACKENDS = ("torch", "nanoddp")
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 9, generator=torch.Generator().manual_seed(1000 * step + rank))  # (B, 9)


def train(rank: int, ddp: nn.Module, opt) -> None:
    with Join([ddp, opt]):
        for step in range(BATCHES[rank]):
            opt.zero_grad()
            ddp(batch(step, rank)).pow(2).mean().backward()
            opt.step()


def case_join_matches_torch(env, backend, opt_name):
    """The same parameters as torch's DDP + ZeroRedundancyOptimizer under Join, on every rank."""
    opt_class, kwargs = OPTIMIZERS[opt_name]
    ours = DistributedDataParallel(make_model(), comm_backend=backend)
    ours_opt = ZeroRedundancyOptimizer(
        ours.parameters(), opt_class, partition="parameter", comm_backend=backend, **kwargs
    )
    theirs = TorchDDP(make_model())
    theirs_opt = TorchZero(theirs.parameters(), opt_class, **kwargs)
    assert ours_opt.partition[env.rank] == [
        i for i, p in enumerate(theirs.parameters()) if any(p is q for q in theirs_opt.optim.param_groups[0]["params"])
    ], "same owners as torch's greedy split"
    train(env.rank, ours, ours_opt)
    train(env.rank, theirs, theirs_opt)
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {(p - q).abs().max().item()}"


def local_grads(model: nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s own gradients at `step` (the reference's current parameters)."""
    model.zero_grad(set_to_none=True)
    model(batch(step, rank)).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def case_zero_alone_under_join(env, backend):
    """ZeRO as the only (so the first) joinable, over a model without DDP: `step()` is what tells
    Join this rank still trains (a joined rank's loop all-reduces the count of those), and a
    joined rank's shadow step must not say so. Each owner steps its parameters on its own local
    gradient (its last one, once joined); against that computed in one process, bitwise.
    (torch's ZeroRedundancyOptimizer hangs here: its joined rank's step announces itself too.)"""
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="parameter", comm_backend=backend, lr=1e-2
    )
    with Join([opt]):
        for step in range(BATCHES[env.rank]):
            opt.zero_grad()
            model(batch(step, env.rank)).pow(2).mean().backward()
            opt.step()
    owner = {i: r for r, indices in enumerate(opt.partition) for i in indices}
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    held: list[list[torch.Tensor]] = [[], []]  # the .grad each rank holds
    for step in range(max(BATCHES)):
        for r in range(2):
            if step < BATCHES[r]:
                held[r] = local_grads(ref, step, r)
        for i, p in enumerate(ref.parameters()):
            p.grad = held[owner[i]][i]
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {(p - q).abs().max().item()}"


def case_element_partition_joins(env, backend):
    """The default by-element partition (no torch counterpart) under Join, against a
    single-process reference: every element is stepped by its owner on the `.grad` the owner
    holds, the average while it trains (a joined rank adds zeros) and its last one after it
    joined (the join hook's step). Bitwise: at ws=2 the average is g0*0.5 + g1*0.5 either way,
    and AdamW is elementwise, so stepping flat pieces is stepping the whole tensors."""
    ddp = DistributedDataParallel(make_model(), comm_backend=backend)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, comm_backend=backend, lr=1e-2)
    train(env.rank, ddp, opt)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    pieces = [  # parameter i -> (owner, start, stop) of its flat elements
        [(r, start, stop) for r, owned in enumerate(opt.partition) for index, start, stop in owned if index == i]
        for i in range(len(list(ref.parameters())))
    ]
    held: list[list[torch.Tensor]] = [[], []]  # the .grad each rank holds
    for step in range(max(BATCHES)):
        training = [r for r in range(2) if step < BATCHES[r]]
        local = {r: local_grads(ref, step, r) for r in training}
        average = [sum(local[r][i] * 0.5 for r in training) for i in range(len(local[0]))]
        for r in training:
            held[r] = average
        for i, p in enumerate(ref.parameters()):
            grad = torch.empty(p.numel())
            for r, start, stop in pieces[i]:
                grad[start:stop] = held[r][i].flatten()[start:stop]
            p.grad = grad.view_as(p)
        ref_opt.step()
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {(p - q).abs().max().item()}"


def cases(world_size: int):
    out = [
        (f"{b}-{o}", functools.partial(case_join_matches_torch, backend=b, opt_name=o))
        for b in BACKENDS
        for o in OPTIMIZERS
    ]
    out += [(f"{b}-zero_alone", functools.partial(case_zero_alone_under_join, backend=b)) for b in BACKENDS]
    return out + [(f"{b}-element", functools.partial(case_element_partition_joins, backend=b)) for b in BACKENDS]


def zero_join_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(zero_join_suite, tmp_path_factory, "zero-join", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [name for name, _ in cases(2)])
def test_zero_join(suite, case):
    suite(2).check(case)
