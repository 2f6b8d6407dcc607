"""Uneven inputs: nanoddp's DDP under join() against torch's DDP under join(), at ws=3.

Ranks get 4 / 5 / 3 batches. Under `join()` the finished ranks shadow the others with zero
gradients, and at the end every replica holds the last joiner's parameters (rank 1's: not rank
0's, so a final broadcast from the wrong rank shows, as stale parameters): they must equal
torch's DDP run the same way, to fp32 rounding: at ws=3 gloo's ring adds an element's three
terms in an order set by its offset in the bucket, and nanoddp's ring in its own order, so
sums can differ in the last bit wherever a bucket layout differs from torch's. Without join
the ranks must fail with an error within the collective timeout, never hang.
"""

from __future__ import annotations

import datetime
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, run_on_ranks, suites_by_world_size
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from nanoddp import DistributedDataParallel

BACKENDS = ("torch", "nanoddp")
BATCHES = (4, 5, 3)  # per rank: rank 2 joins first, then rank 0; rank 1 is the last joiner
B, D = 4, 12
TOL = {"rtol": 1e-5, "atol": 1e-6}  # summation order of 3 terms (see the module docstring)


class Net(nn.Module):
    """With a BatchNorm (buffers to broadcast) and a branch only rank 0 uses (unused params)."""

    def __init__(self, with_branch: bool = False):
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)  # a bias before BatchNorm has ~0 gradient: AdamW amplifies noise
        self.norm = nn.BatchNorm1d(D)
        self.branch = nn.Linear(D, D) if with_branch else nn.Identity()
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))  # (B, D)
        if use_branch:
            h = self.branch(h)
        return self.out(h).pow(2).mean()


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def train(env, engine, opt_name: str, find_unused: bool, **join_kwargs) -> None:
    opt = make_opt(opt_name, engine.parameters())
    with engine.join(**join_kwargs):
        for step in range(BATCHES[env.rank]):
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(10 * step + env.rank))  # (B, D)
            opt.zero_grad()
            engine(x, find_unused and env.rank == 0 and step % 2 == 0).backward()
            opt.step()


def case_join_matches_torch(env, backend, opt_name, divide, find_unused, via_join_class=False):
    torch.manual_seed(0)
    ours = DistributedDataParallel(Net(find_unused), comm_backend=backend, find_unused_parameters=find_unused)
    torch.manual_seed(0)
    theirs = TorchDDP(Net(find_unused), find_unused_parameters=find_unused)
    if via_join_class:  # torch's generic context manager, as with several Joinables
        ours.join = lambda **kw: Join([ours], **kw)
    train(env, ours, opt_name, find_unused, divide_by_initial_world_size=divide)
    train(env, theirs, opt_name, find_unused, divide_by_initial_world_size=divide)
    for (name, p), q in zip(ours.module.state_dict().items(), theirs.module.state_dict().values(), strict=True):
        assert_close(p, q, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    probe = torch.ones(2)  # every rank left the join in step: a collective completes
    dist.all_reduce(probe)
    assert probe.tolist() == [env.world_size] * 2


def case_throw_on_early_termination(env, backend):
    torch.manual_seed(0)
    ours = DistributedDataParallel(Net(), comm_backend=backend)
    with pytest.raises(RuntimeError, match="exhausted"):
        train(env, ours, "sgd", False, throw_on_early_termination=True)


def cases(world_size: int) -> list[tuple[str, callable]]:
    p = functools.partial
    out = []
    for backend in BACKENDS:
        for opt_name in ("sgd", "adamw"):
            for divide in (True, False):
                name = f"{backend}-join-{opt_name}-{'initial_ws' if divide else 'active_ws'}"
                out.append(
                    (
                        name,
                        p(
                            case_join_matches_torch,
                            backend=backend,
                            opt_name=opt_name,
                            divide=divide,
                            find_unused=False,
                        ),
                    )
                )
        # find_unused_parameters: the joined ranks also shadow the parameter-use all-reduce (else
        # the others would hang), re-sending their last use counts as torch's do
        for opt_name in ("sgd", "adamw"):
            out.append(
                (
                    f"{backend}-join-find_unused-{opt_name}",
                    p(case_join_matches_torch, backend=backend, opt_name=opt_name, divide=True, find_unused=True),
                )
            )
        out.append(
            (
                f"{backend}-Join_class",
                p(
                    case_join_matches_torch,
                    backend=backend,
                    opt_name="adamw",
                    divide=True,
                    find_unused=False,
                    via_join_class=True,
                ),
            )
        )
        out.append((f"{backend}-throw_on_early_termination", p(case_throw_on_early_termination, backend=backend)))
    return out


def join_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(join_suite, tmp_path_factory, "ddp-join", timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [name for name, _ in cases(3)])
def test_join(suite, case):
    suite(3).check(case)


# ---- without join(): an error on every rank within the collective timeout ---------------------


def uneven_without_join(env) -> dict[str, str]:
    """For each comm backend: train 4 / 5 / 3 batches without join() over a fresh group with a 5 s
    timeout, then (as the end of an epoch does) all-reduce a metric. Returns the error each rank
    saw, per backend. One launch for both: each backend's failure stays in its own group."""
    errors = {}
    for backend in BACKENDS:
        group = dist.new_group(timeout=datetime.timedelta(seconds=5))
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net(), comm_backend=backend, process_group=group)
        errors[backend] = "no error"
        try:
            for step in range(BATCHES[env.rank]):
                x = torch.randn(B, D, generator=torch.Generator().manual_seed(step))
                ddp(x).backward()
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError as exc:
            errors[backend] = str(exc)
        dist.barrier()  # on the default group: every rank is past this backend's failure
    return errors


@pytest.mark.timeout(150)
def test_uneven_inputs_without_join_fail_on_every_rank():
    per_rank = run_on_ranks(uneven_without_join, 3, timeout=120)
    for backend in BACKENDS:
        errors = [rank_errors[backend] for rank_errors in per_rank]
        assert "no error" not in errors, (backend, errors)
