"""What torch DDP users plug into nanoddp's DDP and nothing else checked: torch's PowerSGD comm
hook, torch.compile around the wrapper, and a process group that is a subgroup of the world.
ws=2 for PowerSGD and compile, ws=4 for subgroups; one launch per world size.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from nanoddp import DistributedDataParallel, verify_replicas
from nanoddp.models import MLPClassifier
from nanoddp.parallel.ddp.comm_hooks import allreduce_hook

BACKENDS = ("torch", "nanoddp")
B = 4
TIGHT = {"rtol": 1e-5, "atol": 1e-6}  # summation order of the all-reduce (see test_ddp.py)


def build() -> nn.Module:
    torch.manual_seed(0)
    return MLPClassifier(in_features=32, hidden=64, num_classes=10, depth=3)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(B, 32, generator=g), torch.randint(0, 10, (B,), generator=g)  # (B, 32), (B,)


def assert_same_grads(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_close(p.grad, q.grad, **TIGHT, msg=lambda m, name=name: f"{what}: {name}: {m}")


def case_powersgd_keeps_replicas_equal(env, backend, bucket_cap_mb=None):
    """Rank-dependent data, PowerSGD from iteration 2 (vanilla all-reduce before): after every
    step all replicas hold the same parameters, and the hook really compressed (the gradients
    differ from the exact average once PowerSGD is on).

    With several buckets (bucket_cap_mb=0.005: 3), PowerSGD issues each bucket's second
    all-reduce from a future callback, which gloo runs on its own thread: unless the engine
    waits for the previous bucket's future before launching the next, ranks issue collectives in
    different orders (SIGABRT or a hang, as torch's own DDP does on gloo here)."""
    ddp = DistributedDataParallel(build(), comm_backend=backend, bucket_cap_mb=bucket_cap_mb)
    if bucket_cap_mb is not None:
        assert len(ddp.bucket_param_names) > 1
    exact = DistributedDataParallel(build(), comm_backend=backend)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    assert ddp.reducer.serialize_hooks, "a hook from outside nanoddp on CPU: the buckets' hooks are serialised"
    exact.register_comm_hook(None, allreduce_hook)
    assert not exact.reducer.serialize_hooks, "nanoddp's own hooks keep the buckets overlapping"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch(env.rank, step)
        opt.zero_grad()
        exact.zero_grad()
        ddp(x, y)[1].backward()
        exact(x, y)[1].backward()
        if step == 3:  # compressed: close to, but not, the exact average
            diffs = [
                (p.grad - q.grad).abs().max().item() for p, q in zip(ddp.parameters(), exact.parameters(), strict=True)
            ]
            assert max(diffs) > 1e-6, "PowerSGD produced the exact average: the hook did not run"
        opt.step()
        with torch.no_grad():
            for p, q in zip(exact.parameters(), ddp.parameters(), strict=True):
                p.copy_(q)
        verify_replicas(ddp.module, atol=0, comm_backend=backend)


def case_compile_matches_torch_ddp(env, backend):
    """torch.compile(our DDP) computes torch DDP's gradients, over 2 steps (the second one on
    rebuilt buckets). The inductor backend needs a C++ compiler; aot_eager still traces the
    wrapper through dynamo and AOTAutograd, which is what can break a DDP's hooks."""
    ours = DistributedDataParallel(build(), comm_backend=backend)
    theirs = TorchDDP(build())
    compiled = torch.compile(ours, backend="aot_eager")
    for step in range(2):
        x, y = batch(env.rank, step)
        for engine in (compiled, theirs):
            engine.zero_grad()
            engine(x, y)[1].backward()
        assert_same_grads(ours.module, theirs.module, f"step {step}")


def case_subgroup_matches_torch(env, backend):
    """Two DDP groups of 2 inside ws=4 ({0, 2} and {1, 3}): each equals torch's DDP over the same
    subgroup, and the groups really are separate (their gradients differ)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[env.rank % 2]
    ours = DistributedDataParallel(build(), comm_backend=backend, process_group=group, bucket_cap_mb=0.01)
    theirs = TorchDDP(build(), process_group=group, bucket_cap_mb=0.01)
    for step in range(2):
        x, y = batch(env.rank, step)
        for engine in (ours, theirs):
            engine.zero_grad()
            engine(x, y)[1].backward()
        assert_same_grads(ours.module, theirs.module, f"step {step}")
    probe = ours.module.net[0].weight.grad.clone()
    gathered = [torch.zeros_like(probe) for _ in range(env.world_size)]
    dist.all_gather(gathered, probe)
    assert torch.equal(gathered[0], gathered[2]) and torch.equal(gathered[1], gathered[3])
    assert not torch.equal(gathered[0], gathered[1])


def cases(world_size: int):
    p = functools.partial
    fns = [case_powersgd_keeps_replicas_equal, case_compile_matches_torch_ddp] if world_size == 2 else []
    fns += [case_subgroup_matches_torch] if world_size == 4 else []
    out = [(f"{b}-{fn.__name__.removeprefix('case_')}", p(fn, backend=b)) for b in BACKENDS for fn in fns]
    if world_size == 2:
        out += [(f"{b}-powersgd_3_buckets", p(case_powersgd_keeps_replicas_equal, backend=b, bucket_cap_mb=0.005))
                for b in BACKENDS]  # fmt: skip
    return out


def compat_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(compat_suite, tmp_path_factory, "ddp-compat", timeout=400)


@pytest.mark.timeout(800)
@pytest.mark.parametrize(
    "world_size,case", [(ws, name) for ws in (2, 4) for name, _ in cases(ws)], ids=lambda v: str(v)
)
def test_compat(suite, world_size, case):
    suite(world_size).check(case)
