"""nanoddp.DistributedDataParallel's constructor against torch's: the same signature, the same
defaults and meanings, so code written for torch's DDP runs unchanged.

Single-process checks (no launch) plus one ws=2 launch for the arguments that change what is
communicated (init_sync, broadcast_buffers / forward_sync_buffers, bucket_cap_mb=None).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from nanoddp import DistributedDataParallel

BACKENDS = ("torch", "nanoddp")


def test_signature_matches_torch():
    """Every torch argument, in torch's order, with torch's default; ours adds only the
    keyword-only comm_backend. A new torch argument makes this fail, so it gets noticed."""
    ours = inspect.signature(DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    extra = [name for name in ours if name not in theirs]
    assert extra == ["comm_backend"], extra
    assert ours["comm_backend"].kind is inspect.Parameter.KEYWORD_ONLY
    shared = [name for name in ours if name in theirs]
    assert shared == list(theirs), f"ours {shared} vs torch {list(theirs)}"
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        assert ours[name].default == param.default, f"{name}: ours {ours[name].default!r}, torch {param.default!r}"


def test_check_reduction_is_deprecated_like_torch():
    """Every other torch argument is implemented (tests/test_ddp_delayed.py,
    tests/test_ddp_mixed_precision.py); check_reduction only warns, as in torch."""
    model = nn.Linear(2, 2)
    with pytest.warns(FutureWarning, match="check_reduction"):
        DistributedDataParallel(model, check_reduction=True)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("counter", torch.zeros(2))

    def forward(self, x):
        return self.lin(x).sum() + self.counter.sum()


def _build(rank: int) -> WithBuffer:
    torch.manual_seed(rank)  # different values per rank: shows what was synchronised
    model = WithBuffer()
    model.counter.fill_(rank)
    return model


def case_buffer_and_init_sync_like_torch(env, backend):
    """The same parameters and buffers as torch's DDP after construction and after a forward,
    for each way of saying what to synchronise."""
    for kwargs in (
        {},
        {"broadcast_buffers": False},
        {"broadcast_buffers": True},
        {"forward_sync_buffers": False},
        {"init_sync": False},
        {"bucket_cap_mb": None},
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates broadcast_buffers
            ours = DistributedDataParallel(_build(env.rank), comm_backend=backend, **kwargs)
            theirs = TorchDDP(_build(env.rank), **kwargs)
        for when in ("construction", "forward"):
            if when == "forward":
                for engine in (ours, theirs):
                    engine.module.counter.add_(10 * (env.rank + 1))  # rank-local buffer change
                    engine(torch.ones(1, 4))
            for (name, p), q in zip(ours.module.state_dict().items(), theirs.module.state_dict().values(), strict=True):
                assert torch.equal(p, q), f"{kwargs} after {when}: {name}: {p} vs {q}"
        assert ours.bucket_cap_mb == 25


def cases(world_size: int):
    return [(f"{b}-buffer_and_init_sync", functools.partial(case_buffer_and_init_sync_like_torch, backend=b))
            for b in BACKENDS]  # fmt: skip


def args_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(args_suite, tmp_path_factory, "ddp-args", timeout=180)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [name for name, _ in cases(2)])
def test_args(suite, case):
    suite(2).check(case)
