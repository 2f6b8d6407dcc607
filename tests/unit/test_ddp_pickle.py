"""Pickling nanoddp's DDP wrapper without torch.distributed (the world-size-1 pass-through that
torch's DDP has no counterpart of: it needs a process group). The copy must be a working,
independent wrapper: one step on it equals one step on a plain copy of the module, bitwise.
With a process group the wrapper is compared with torch's in tests/multiproc/test_ddp_torch_seams.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nanoddp import DistributedDataParallel


def _save_and_load(obj: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _step(model: nn.Module) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # (B, in)
    model(x).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


@pytest.mark.parametrize("copy_fn", [_save_and_load, copy.deepcopy], ids=["torch_save", "deepcopy"])
def test_pass_through_wrapper_pickles_and_trains_on(copy_fn):
    assert not dist.is_initialized()  # the pass-through path: no group to drop or rebuild
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    ddp = DistributedDataParallel(copy.deepcopy(plain), bucket_cap_mb=1)
    before = [p.detach().clone() for p in ddp.parameters()]
    loaded = copy_fn(ddp)
    assert loaded.module is not ddp.module and loaded.reducer is not ddp.reducer
    assert loaded.bucket_cap_mb == 1 and loaded.require_backward_grad_sync
    _step(loaded)
    _step(plain)
    for (name, p), q in zip(loaded.module.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    for p, q in zip(ddp.parameters(), before, strict=True):
        assert torch.equal(p, q), "training the copy changed the original"
