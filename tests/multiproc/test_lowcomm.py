"""LocalSGD and DiLoCo against their references, on 2 gloo ranks (one launch), LocalSGD on 3 too.

- LocalSGD equals torch's post-local SGD (`PostLocalSGDOptimizer` over a
  `PeriodicModelAverager` set to average after the same steps) bitwise, and a single-process
  replay of the two replicas bitwise; at 3 ranks, bitwise only where the sums run in the same
  order: torch's with comm_backend="torch" (the same gloo all-reduce), close otherwise;
- DiLoCo equals a single-process replay (two replicas, inner AdamW, the pseudo-gradients
  averaged, an outer Nesterov SGD) bitwise, for both comm backends;
- DiLoCo resumed from `state_dict()` mid-way equals the uninterrupted run bitwise.

Bitwise by construction: with two ranks the all-reduce adds two numbers (x/2 + y/2), and float
addition of two terms does not depend on their order; every other operation is the same
sequence of torch ops on the same values as in the replay. Three terms added in another order
can round differently (by an ulp), so there only the same all-reduce gives the same bits.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

from nanoddp.parallel.lowcomm import DiLoCo, LocalSGD

STEPS, H = 7, 3
BACKENDS = ("nanoddp", "torch")


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)  # (4, 8), (4, 1)


def train(model: nn.Module, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"


def replay_localsgd(world_size: int, rank: int) -> list[torch.Tensor]:
    """The replicas trained one after the other in this process, averaged every H steps;
    returns replica `rank`'s parameters (after a step that is not a sync step they differ)."""
    models = [build() for _ in range(world_size)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for step in range(STEPS):
        for replica, (m, o) in enumerate(zip(models, opts, strict=True)):
            train(m, o, replica, range(step, step + 1))
        if (step + 1) % H == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = sum(p / world_size for p in ps)
                    for p in ps:
                        p.copy_(mean)
    return params(models[rank])


def replay_diloco(world_size: int, rank: int, steps: int = STEPS) -> list[torch.Tensor]:
    """The replicas with inner AdamW; every H steps the averaged pseudo-gradient, outer SGD;
    returns replica `rank`'s parameters."""
    models = [build() for _ in range(world_size)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    synced = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(synced, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        for replica, (m, o) in enumerate(zip(models, inner, strict=True)):
            train(m, o, replica, range(step, step + 1))
        if (step + 1) % H == 0:
            with torch.no_grad():
                for i, s in enumerate(synced):
                    s.grad = sum((s - list(m.parameters())[i]) / world_size for m in models)
                outer.step()
                for m in models:
                    for p, s in zip(m.parameters(), synced, strict=True):
                        p.copy_(s)
    return params(models[rank])


def case_localsgd_matches_torch_post_local_sgd(env, backend):
    model = build()
    ours = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), sync_every=H, comm_backend=backend)
    train(model, ours, env.rank, range(STEPS))
    theirs_model = build()
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)  # averages after steps H, 2H, ...
    theirs = PostLocalSGDOptimizer(torch.optim.SGD(theirs_model.parameters(), lr=0.05, momentum=0.9), averager)
    train(theirs_model, theirs, env.rank, range(STEPS))
    # the collective first, so that a failed assertion on one rank cannot leave the other waiting
    gathered = [torch.empty(0)] * env.world_size
    dist.all_gather_object(gathered, params(model)[0])
    torch_same_sums = env.world_size == 2 or backend == "torch"  # the docstring's "bitwise by construction"
    replay = replay_localsgd(env.world_size, env.rank)
    for want, what, bitwise in [(params(theirs_model), "torch's PostLocalSGDOptimizer", torch_same_sums),
                                (replay, "the single-process replay", env.world_size == 2)]:  # fmt: skip
        if bitwise:
            assert_bitwise(params(model), want, f"LocalSGD vs {what}")
        else:  # a sum of 3 in another order: an ulp or so, carried through 7 steps of momentum SGD
            torch.testing.assert_close(params(model), want, rtol=0, atol=1e-6, msg=f"LocalSGD vs {what}")
    # step 7 is not a sync step: the replicas drifted apart since step 6 (else nothing was local)
    assert not torch.equal(gathered[0], gathered[1]), "replicas equal between syncs: nothing trained locally"
    assert ours.last_sync_bytes == 0 and ours.local_step == STEPS


def case_diloco_matches_the_replay(env, backend):
    model = build()
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, comm_backend=backend)
    train(model, opt, env.rank, range(H))
    numel = sum(p.numel() for p in model.parameters())
    assert opt.last_sync_bytes == numel * 4, "one fp32 pseudo-gradient per parameter element"
    train(model, opt, env.rank, range(H, STEPS))
    assert_bitwise(params(model), replay_diloco(env.world_size, env.rank), "DiLoCo vs the single-process replay")


def case_diloco_resumes_exactly(env, backend):
    model = build()
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, comm_backend=backend)
    train(model, opt, env.rank, range(4))  # one outer step done, one inner step into the next round
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = build()
    resumed_opt = DiLoCo(torch.optim.AdamW(resumed.parameters(), lr=1e-2), sync_every=H, comm_backend=backend)
    resumed.load_state_dict(saved_model)  # after the wrapper: its start-up broadcast would undo it
    resumed_opt.load_state_dict(saved_opt)
    train(resumed, resumed_opt, env.rank, range(4, STEPS))
    assert_bitwise(
        params(resumed), replay_diloco(env.world_size, env.rank), "DiLoCo resumed at step 4 vs uninterrupted"
    )


def case_bad_arguments_are_refused(env, backend):
    model = build()
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=0, comm_backend=backend)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        LocalSGD(model, sync_every=2, comm_backend=backend)  # type: ignore[arg-type]


CASES = [
    case_localsgd_matches_torch_post_local_sgd,
    case_diloco_matches_the_replay,
    case_diloco_resumes_exactly,
    case_bad_arguments_are_refused,
]


def cases(world_size: int = 2):
    """Every case at 2 ranks; at 3 the one whose claim changes with the world size."""
    chosen = CASES if world_size == 2 else [case_localsgd_matches_torch_post_local_sgd]
    return [
        (f"{b}-{fn.__name__.removeprefix('case_')}", functools.partial(fn, backend=b))
        for b in BACKENDS
        for fn in chosen
    ]


def lowcomm_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(lowcomm_suite, tmp_path_factory, "lowcomm", timeout=200)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [name for name, _ in cases()])
def test_lowcomm(suite, case):
    suite(2).check(case)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [name for name, _ in cases(3)])
def test_localsgd_at_three_ranks(suite, case):
    suite(3).check(case)
