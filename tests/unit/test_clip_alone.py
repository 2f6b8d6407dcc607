"""`nanoddp.clip_grad_norm_` on plain gradients in one process: torch's `clip_grad_norm_`, bitwise.

The reference is torch's own function on a copy of the model with the same gradients, for a
clip that fires (the norm above `max_norm`: every gradient scaled down) and one that does not
(below it: the factor is capped at 1, so the gradients stay exactly as they were), in the norm
orders torch users pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanoddp


def _with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    nn.functional.mse_loss(model(x), y).backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("fires", [True, False])
def test_clip_equals_torch_whether_or_not_it_fires(norm_type, fires):
    ours, theirs = _with_grads(), _with_grads()  # one seed: the same gradients, bitwise
    before = [p.grad.clone() for p in ours.parameters()]
    norm = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()], norm_type)
    max_norm = float(norm) / 4 if fires else float(norm) * 4
    got = nanoddp.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type=norm_type)
    assert torch.equal(got, want)
    for p, q, b in zip(ours.parameters(), theirs.parameters(), before, strict=True):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(p.grad, b) != fires  # scaled down when it fires; untouched when not
