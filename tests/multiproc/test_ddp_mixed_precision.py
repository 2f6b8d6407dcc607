"""torch DDP's `mixed_precision` on nanoddp's DDP, ws=2, both comm backends.

torch's own implementation cannot run here (CPU/gloo: its forward records a torch.Event, which
the CPU backend refuses: "doesn't support events", torch 2.13). The reference is
therefore a single-process computation doing torch's documented casts: each rank's shard run on
a copy of the model with parameters in param_dtype and inputs cast to it, gradients cast to
reduce_dtype, averaged as (g0 * 0.5) + (g1 * 0.5) in reduce_dtype, cast up to the parameters'
fp32 and applied by SGD. The same ops on the same values, so the comparison is bitwise: for two
terms, gloo's and nanoddp's sums are the one rounded addition torch does.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.nn.parallel.distributed import _MixedPrecision

from nanoddp import DistributedDataParallel

BACKENDS = ("torch", "nanoddp")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CONFIGS = {  # name: (param_dtype, reduce_dtype, buffer_dtype)
    "bf16_reduce_fp32": (BF16, F32, BF16),
    "bf16": (BF16, None, BF16),
    "fp16": (F16, F16, F16),
    "reduce_bf16_only": (None, BF16, None),
}


class Net(nn.Module):
    """Two layers and a floating buffer used in the forward (so buffer_dtype matters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # not floating: never cast

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x) + self.shift))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))  # (B, 8)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def shard_grads(ref: nn.Module, x: torch.Tensor, cfg: tuple, earlier: list | None) -> list[torch.Tensor]:
    """One rank's local gradients under torch's documented casts (accumulated onto `earlier`)."""
    param_dtype = cfg[0]
    low = copy.deepcopy(ref)
    for i, p in enumerate(low.parameters()):
        if param_dtype is not None:
            p.data = p.data.to(param_dtype)
        p.grad = None if earlier is None else earlier[i].to(p.dtype, copy=True)
    loss_of(low(x if param_dtype is None else x.to(param_dtype))).backward()
    return [p.grad for p in low.parameters()]


def reference_step(ref: nn.Module, opt, cfg: tuple, step: int, no_sync: bool, joined: tuple = ()) -> None:
    """Both ranks' shards (a no_sync backward first, if asked), reduced; .grad set, then a step.

    A rank in `joined` has run out of batches: under join it all-reduces zeros instead."""
    reduce_dtype = cfg[1] or cfg[0] or F32
    grads = []
    for rank in range(2):
        if rank in joined:
            grads.append([torch.zeros_like(p, dtype=reduce_dtype) for p in ref.parameters()])
            continue
        earlier = None
        if no_sync:  # accumulates onto the last step's averaged .grad, cast down at the forward
            earlier = shard_grads(ref, batch(rank, 50 + step), cfg, [p.grad for p in ref.parameters()])
        grads.append(shard_grads(ref, batch(rank, step), cfg, earlier))
    for p, g0, g1 in zip(ref.parameters(), *grads, strict=True):
        p.grad = ((g0.to(reduce_dtype) * 0.5) + (g1.to(reduce_dtype) * 0.5)).to(p.dtype)
    opt.step()


def case_matches_reference(env, backend, cfg):
    """3 SGD steps (the second accumulating a no_sync backward first): parameters and gradients
    bitwise equal to the reference; fp32 parameters and .grad after every backward and after a
    no-grad forward; floating buffers in buffer_dtype; output in param_dtype."""
    model, ref = Net(), Net()
    ddp = DistributedDataParallel(model, comm_backend=backend, mixed_precision=_MixedPrecision(*cfg))
    if cfg[2] is not None:
        ref.shift.data = ref.shift.to(cfg[2])
    assert model.shift.dtype == (cfg[2] or F32) and model.steps.dtype == torch.int64
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        if step != 1:
            opt.zero_grad()
        else:
            with ddp.no_sync():
                loss_of(ddp(batch(env.rank, 50 + step))).backward()
        out = ddp(batch(env.rank, step))
        assert out.dtype == (cfg[0] or F32)
        loss_of(out).backward()
        for name, p in model.named_parameters():
            assert p.dtype == F32 and p.grad.dtype == F32, name
        reference_step(ref, ref_opt, cfg, step, no_sync=step == 1)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad: {p.grad} vs {q.grad}"
        opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), f"step {step}: {name}"
    with torch.no_grad():
        ddp(batch(env.rank, 9))
    assert all(p.dtype == F32 for p in model.parameters()), "a no-grad forward leaves full precision in place"


JOIN_BATCHES = (3, 5)  # per rank: rank 0 joins after 3 iterations, rank 1 is the last joiner


def case_join_with_bf16_buckets(env, backend):
    """Uneven inputs with bf16 buckets: the joined rank's zero stand-ins must be bf16 too
    (nanoddp's collectives check the dtype on every rank). On every rank the parameters end
    bitwise equal to the reference (the joined rank adds zeros to the last two averages) after
    the final broadcast from the last joiner, rank 1: rank 0's own replica stopped after 3 steps."""
    cfg = (BF16, BF16, BF16)
    model, ref = Net(), Net()
    ref.shift.data = ref.shift.to(BF16)
    ddp = DistributedDataParallel(model, comm_backend=backend, mixed_precision=_MixedPrecision(*cfg))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with ddp.join():
        for step in range(JOIN_BATCHES[env.rank]):
            opt.zero_grad()
            loss_of(ddp(batch(env.rank, step))).backward()
            opt.step()
    for step in range(max(JOIN_BATCHES)):
        joined = tuple(r for r in range(2) if step >= JOIN_BATCHES[r])
        reference_step(ref, ref_opt, cfg, step, no_sync=False, joined=joined)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == F32 and torch.equal(p, q), f"{name}: {(p - q).abs().max().item()}"


def cases(world_size: int):
    out = [(f"{b}-join", functools.partial(case_join_with_bf16_buckets, backend=b)) for b in BACKENDS]
    for b in BACKENDS:
        out += [
            (f"{b}-{name}", functools.partial(case_matches_reference, backend=b, cfg=cfg))
            for name, cfg in CONFIGS.items()
        ]
    return out


def mp_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(mp_suite, tmp_path_factory, "ddp-mp", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [name for name, _ in cases(2)])
def test_mixed_precision(suite, case):
    suite(2).check(case)


def test_mixed_precision_refused_clearly():
    model = Net()
    with pytest.raises(ValueError, match="param_dtype must be a floating-point"):
        DistributedDataParallel(model, mixed_precision=_MixedPrecision(param_dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a floating-point"):
        DistributedDataParallel(model, mixed_precision=object())
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        DistributedDataParallel(model, mixed_precision=_MixedPrecision(BF16), gradient_as_bucket_view=True)
