"""torch 2.13 DDP's `delay_all_reduce_named_params` / `param_to_hook_all_reduce` and
`bucket_cap_mb_list` on nanoddp's DDP, against torch's DDP given the same arguments.

Gradients are compared bitwise: with ws=2 each averaged element is (a + b) * 0.5 or (a + b) / 2
whatever the bucket it travels in, so neither the delayed buffer nor the bucket layout may
change a bit. One ws=2 launch runs every case for both comm backends.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from nanoddp import DistributedDataParallel

BACKENDS = ("torch", "nanoddp")


def build(width: int = 8, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()] if i < depth - 1 else [nn.Linear(width, 2)]
    return nn.Sequential(*layers)


def batch(rank: int, step: int, width: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, width, generator=g)  # (B, width)


def delay_args(model: nn.Module, names: list[str]) -> dict:
    """Delay `names`; the hook is on the first layer's weight, whose gradient comes last."""
    named = dict(model.named_parameters())
    delayed = [(n, named[n]) for n in names]
    return {"delay_all_reduce_named_params": delayed, "param_to_hook_all_reduce": named["0.weight"]}


def backward(engine, x: torch.Tensor) -> None:
    engine(x).square().sum().backward()
    if isinstance(engine, TorchDDP):
        # torch never waits for its delayed all-reduce (it drops the Work), so its .grad may
        # still be changing when backward() returns; gloo's barrier waits for all earlier work
        dist.barrier()


def run_both(env, ours, theirs, steps: int = 3, no_sync_step: int | None = None, width: int = 8) -> None:
    """`steps` SGD steps on both wrappers (rank-dependent data), gradients bitwise after each;
    at `no_sync_step` a no_sync backward is accumulated first (onto the last step's .grad)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(steps):
        for engine, opt in zip((ours, theirs), opts, strict=True):
            if step != no_sync_step:
                opt.zero_grad()
            if step == no_sync_step:
                with engine.no_sync():
                    backward(engine, batch(env.rank, 50 + step, width))
            backward(engine, batch(env.rank, step, width))
        for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
            assert p.grad is not None and torch.equal(p.grad, q.grad), f"step {step}: {name}: {p.grad} vs {q.grad}"
        for opt in opts:
            opt.step()


def case_delayed_params_match_torch(env, backend):
    """Some parameters delayed: the same gradients as torch's DDP over 3 steps (one of them
    accumulating a no_sync backward first), and those parameters are not in any bucket."""
    for names in (["2.weight", "2.bias", "4.weight"], ["4.bias"]):
        ours_model, theirs_model = build(), build()
        ours = DistributedDataParallel(ours_model, comm_backend=backend, **delay_args(ours_model, names))
        theirs = TorchDDP(theirs_model, **delay_args(theirs_model, names))
        assert not {n for bucket in ours.bucket_param_names for n in bucket} & set(names)
        run_both(env, ours, theirs, steps=3, no_sync_step=1)


class InputScaled(nn.Module):
    """`body(x * scale)` where `scale` is a leaf the module does not own: its gradient is the
    last one computed, after every parameter's, so it can trigger the delayed all-reduce of
    all of them (a delayed parameter's own hook fires before its gradient is accumulated)."""

    def __init__(self):
        super().__init__()
        self.body = build()
        self.scale = [torch.ones(8, requires_grad=True)]  # a list: not registered as a parameter

    def forward(self, x):
        return self.body(x * self.scale[0])


def case_all_params_delayed(env, backend):
    """Every parameter delayed. torch 2.13 cannot construct this (its device-type check runs on
    the empty list of non-delayed parameters: "must be on the same type of devices, but ...
    locate in set()"); nanoddp then runs only the delayed all-reduce. Reference: torch's DDP
    without delaying, bitwise (ws=2: a/2 + b/2 equals a*0.5 + b*0.5)."""
    ours_model = InputScaled()
    named = list(ours_model.named_parameters())
    args = {"delay_all_reduce_named_params": named, "param_to_hook_all_reduce": ours_model.scale[0]}
    with pytest.raises(ValueError, match="same type of devices"):
        TorchDDP(ours_model, **args)
    ours = DistributedDataParallel(ours_model, comm_backend=backend, **args)
    assert ours.bucket_param_names == []
    run_both(env, ours, TorchDDP(InputScaled()), steps=3)


def case_delayed_params_broadcast_without_init_sync(env, backend):
    """torch broadcasts the delayed parameters from rank 0 even with init_sync=False, and
    leaves the others rank-local: the same state as torch's DDP after construction."""
    models = []
    for _ in range(2):
        torch.manual_seed(env.rank)  # rank-dependent values show what was synchronised
        models.append(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    local = models[0][0].weight.detach().clone()
    DistributedDataParallel(models[0], init_sync=False, comm_backend=backend, **delay_args(models[0], ["1.weight"]))
    TorchDDP(models[1], init_sync=False, **delay_args(models[1], ["1.weight"]))
    for (name, p), q in zip(models[0].state_dict().items(), models[1].state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(models[0][0].weight, local), "init_sync=False: the other parameters stay rank-local"


def case_delayed_params_refuse_join(env, backend):
    model = build()
    ddp = DistributedDataParallel(model, comm_backend=backend, **delay_args(model, ["2.weight"]))
    with pytest.raises(ValueError, match="join"):
        Join([ddp])


def torch_layout(ddp: TorchDDP) -> list[list[str]]:
    names = {p: n for n, p in ddp.module.named_parameters()}
    return [[names[p] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def case_bucket_cap_mb_list_matches_torch(env, backend):
    """Per-bucket limits: torch's bucket layout before and after the rebuild, and its gradients.
    Limits of 20, 40 and 10 KiB over 16 KiB weights: buckets of 2, 3, then 1 weight each (the
    last limit repeats), in registration order reversed at first, in gradient order after."""
    caps = [0.02, 0.04, 0.01]
    ours = DistributedDataParallel(build(64, 8), comm_backend=backend, bucket_cap_mb_list=caps)
    theirs = TorchDDP(build(64, 8), bucket_cap_mb_list=caps)
    assert ours.bucket_param_names == torch_layout(theirs), "initial layout"
    assert len(ours.bucket_param_names) == 5
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        for engine, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            engine(batch(env.rank, step, 64)).square().sum().backward()
            opt.step()
        assert ours.bucket_param_names == torch_layout(theirs), f"layout after step {step}"
        for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
            assert torch.equal(p, q), f"step {step}: {name}"


def cases(world_size: int):
    fns = {
        "delayed": case_delayed_params_match_torch,
        "all_delayed": case_all_params_delayed,
        "delayed_init_sync": case_delayed_params_broadcast_without_init_sync,
        "delayed_join": case_delayed_params_refuse_join,
        "bucket_cap_mb_list": case_bucket_cap_mb_list_matches_torch,
    }
    return [(f"{b}-{name}", functools.partial(fn, backend=b)) for b in BACKENDS for name, fn in fns.items()]


def delayed_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(delayed_suite, tmp_path_factory, "ddp-delayed", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [name for name, _ in cases(2)])
def test_delayed_and_bucket_list(suite, case):
    suite(2).check(case)


def test_delayed_args_refused_clearly():
    """torch's rule (both or neither), plus names that are not the module's."""
    model = build()
    with pytest.raises(ValueError, match="at the same time"):
        DistributedDataParallel(model, delay_all_reduce_named_params=[("0.weight", model[0].weight)])
    with pytest.raises(ValueError, match="at the same time"):
        DistributedDataParallel(model, param_to_hook_all_reduce=model[0].weight)
    with pytest.raises(ValueError, match="must not be one of"):
        DistributedDataParallel(model, **delay_args(model, ["0.weight"]))
    with pytest.raises(ValueError, match="not the name"):
        DistributedDataParallel(
            model, delay_all_reduce_named_params=[("weight", model[0].weight)], param_to_hook_all_reduce=model[0].bias
        )
    for bad in ([0], [1, -2], ["1"]):
        with pytest.raises(ValueError, match="bucket_cap_mb_list"):
            DistributedDataParallel(model, bucket_cap_mb_list=bad)
