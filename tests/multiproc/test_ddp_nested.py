"""nanoddp.DistributedDataParallel under nested backward passes and static_graph, against torch's DDP.

Reentrant activation checkpointing runs a backward *inside* the outer backward; the engine must
still finalise once, after every gradient of the iteration is ready. Every case compares the
gradients after each of 3 steps with torch's DDP on the same data, bitwise (same reduction
order, same division: the math is identical), with the torch backend; the nanoddp backend's ring
all-reduce sums in another order, so it is compared with a tolerance of fp32 rounding.
All cases of one world size run in one launch (see suite_runner).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from helpers import run_cases, suites_by_world_size
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from nanoddp import DistributedDataParallel

BACKENDS = ("torch", "nanoddp")
B, D, STEPS = 4, 16, 3
# nanoddp's ring sums in a different order than gloo: fp32 rounding of a sum of 2 terms.
RING_TOL = {"rtol": 1e-5, "atol": 1e-7}


class Blocks(nn.Module):
    """stem -> 3 blocks -> loss; `ckpt` names how block `where` is checkpointed.

    The last block is the last thing with parameters, so when it is checkpointed reentrantly
    the very first gradient hooks of the iteration fire inside the checkpoint's inner backward.
    The stem makes the first block's input require grad, as real models' embeddings do, so a
    reentrant checkpoint of block 0 still produces gradients. `reuse` applies block 1 twice
    (its gradient then arrives in two parts, each from its own reentrant backward); `extra` is
    a layer that takes part only when `use_extra`.
    """

    def __init__(self, ckpt: str = "none", where: int = 2, reuse: bool = False, use_extra: bool = True):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.extra = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.ckpt, self.where, self.reuse, self.use_extra = ckpt, where, reuse, use_extra

    def _run(self, i: int, h: torch.Tensor) -> torch.Tensor:
        if self.ckpt != "none" and i == self.where:
            return checkpoint(self.blocks[i], h, use_reentrant=self.ckpt == "reentrant")
        return self.blocks[i](h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)  # (B, D)
        if self.use_extra:
            h = h + self.extra(h)
        for i in range(3):
            h = self._run(i, h)
            if self.reuse and i == 1:
                h = self._run(i, h)
        return h.pow(2).mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(100 * step + rank))  # (B, D)


def assert_same_grads(ours: nn.Module, theirs: nn.Module, backend: str, what: str) -> None:
    tol = {"rtol": 0, "atol": 0} if backend == "torch" else RING_TOL
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}: grad None on one side only"
        if p.grad is not None:
            assert_close(p.grad, q.grad, **tol, msg=lambda m, name=name: f"{what}: {name}: {m}")


def compare(env, backend: str, make, steps: int = STEPS, **kwargs) -> None:
    """Train ours and torch's DDP side by side (SGD), comparing gradients at every step."""
    torch.manual_seed(0)
    ours = DistributedDataParallel(make(), comm_backend=backend, bucket_cap_mb=0.001, **kwargs)
    torch.manual_seed(0)
    theirs = TorchDDP(make(), bucket_cap_mb=0.001, **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(steps):
        x = batch(env.rank, step)
        for engine, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            engine(x).backward()
        assert_same_grads(ours.module, theirs.module, backend, f"step {step}")
        for opt in opts:
            opt.step()


def case_checkpoint(env, backend, ckpt, where, find_unused):
    compare(env, backend, functools.partial(Blocks, ckpt, where), find_unused_parameters=find_unused)


def case_checkpoint_reference(env, backend, where):
    """find_unused_parameters=True with a reentrant checkpoint: torch's DDP itself refuses it
    (its graph search cannot see inside the checkpoint), so the reference is torch's DDP
    without the checkpoint, which computes the same gradients."""
    torch.manual_seed(0)
    ours = DistributedDataParallel(
        Blocks("reentrant", where), comm_backend=backend, bucket_cap_mb=0.001, find_unused_parameters=True
    )
    torch.manual_seed(0)
    theirs = TorchDDP(Blocks("none", where), bucket_cap_mb=0.001, find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(STEPS):
        x = batch(env.rank, step)
        for engine, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            engine(x).backward()
        assert_same_grads(ours.module, theirs.module, backend, f"step {step}")
        for opt in opts:
            opt.step()


class GradPenalty(nn.Module):
    """A torch.autograd.grad call with create_graph inside the forward (gradient penalty):
    a nested backward that produces no .grad, then a double backward through it."""

    def __init__(self):
        super().__init__()
        self.inner = Blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        loss = self.inner(x)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)  # (B, D)
        return loss + g.pow(2).sum()


def case_grad_penalty(env, backend):
    compare(env, backend, GradPenalty)


def case_static_graph(env, backend, ckpt, reuse, unused):
    make = functools.partial(Blocks, ckpt, 1, reuse, not unused)
    compare(env, backend, make, steps=4, static_graph=True)


def cases(world_size: int) -> list[tuple[str, callable]]:
    p = functools.partial
    out = []
    for backend in BACKENDS:
        for ckpt in ("reentrant", "nonreentrant"):
            for where in (0, 1, 2):
                for find_unused in (False, True):
                    if ckpt == "reentrant" and find_unused:
                        fn = p(case_checkpoint_reference, backend=backend, where=where)
                    else:
                        fn = p(case_checkpoint, backend=backend, ckpt=ckpt, where=where, find_unused=find_unused)
                    name = f"{backend}-checkpoint-{ckpt}-block{where}-{'unused' if find_unused else 'default'}"
                    out.append((name, fn))
        out.append((f"{backend}-grad_penalty", p(case_grad_penalty, backend=backend)))
        for ckpt, reuse, skip in (
            ("none", False, False),
            ("none", False, True),
            ("reentrant", False, False),
            ("reentrant", True, False),
            ("reentrant", True, True),
        ):
            name = f"{backend}-static_graph-{ckpt}{'-reused' if reuse else ''}{'-unused' if skip else ''}"
            out.append((name, p(case_static_graph, backend=backend, ckpt=ckpt, reuse=reuse, unused=skip)))
    return out


def nested_suite(env, out_dir):
    run_cases(env, cases(env.world_size), out_dir)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return suites_by_world_size(nested_suite, tmp_path_factory, "ddp-nested", timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [name for name, _ in cases(2)])
def test_nested(suite, case):
    suite(2).check(case)
