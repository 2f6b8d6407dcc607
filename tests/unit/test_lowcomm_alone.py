"""LocalSGD and DiLoCo in a process with no process group: one rank, as our DDP treats it.

References: LocalSGD alone is its inner optimizer (the average of one replica is itself); DiLoCo
alone is the outer SGD stepped on (last sync - now) every `sync_every` inner steps, replayed here
with torch's own optimizers on a copy of the model: the paper's Nesterov momentum, and plain SGD
(`outer_momentum=0`, which torch's SGD takes without Nesterov), and any outer optimizer the
`outer=` factory builds (Adam). Streaming DiLoCo's knobs, checked before any work: one
ValueError naming the rule; its cut of the model and its int8 rounding, by their definitions.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import nanoddp
from nanoddp.parallel.lowcomm.fragments import cut_fragments
from nanoddp.parallel.lowcomm.pseudo_grad_mean import INT8_BLOCK, dequantize_int8, quantize_int8

STEPS, H = 5, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, after_step=lambda step: None) -> None:
    for step, (x, y) in enumerate(_batches(), start=1):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        after_step(step)


def test_localsgd_without_a_group_is_its_inner_optimizer():
    assert not dist.is_initialized()
    ours, plain = _model(), _model()
    _train(ours, nanoddp.LocalSGD(torch.optim.SGD(ours.parameters(), lr=0.1), sync_every=H))
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


OUTERS = {
    "nesterov": ({"outer_momentum": 0.9}, functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)),
    "plain": ({"outer_momentum": 0.0}, functools.partial(torch.optim.SGD, lr=0.7, momentum=0.0)),
    "adam": ({"outer": functools.partial(torch.optim.Adam, lr=0.1)}, functools.partial(torch.optim.Adam, lr=0.1)),
}


@pytest.mark.parametrize("outer_kind", OUTERS)
def test_diloco_without_a_group_is_the_outer_step_on_one_replica(outer_kind):
    assert not dist.is_initialized()
    options, reference_outer = OUTERS[outer_kind]
    ours, ref = _model(), _model()
    inner = torch.optim.AdamW(ours.parameters(), lr=0.01)
    _train(ours, nanoddp.DiLoCo(inner, sync_every=H, **options))

    synced = copy.deepcopy(list(ref.parameters()))
    outer = reference_outer(synced)

    @torch.no_grad()
    def outer_step(step: int) -> None:
        if step % H:
            return
        for s, p in zip(synced, ref.parameters(), strict=True):
            s.grad = s - p
        outer.step()
        for s, p in zip(synced, ref.parameters(), strict=True):
            p.copy_(s)

    _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), outer_step)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"fragments": 0}, "fragments must be >= 1"),
        ({"fragments": 3}, r"fragments must be between 1 and the number of trainable parameter tensors \(2\)"),
        ({"sync_every": 3, "fragments": 2}, "sync_every must be a multiple of fragments"),
        ({"sync_every": 4, "fragments": 2, "sync_delay": 2}, r"sync_delay must be in \[0, sync_every/fragments\)"),
        ({"sync_delay": -1}, "sync_delay must be in"),
        ({"mix": 1.5}, r"mix must be in \[0, 1\]"),
        ({"compress": "int4"}, "compress .* must be one of"),
    ],
)
def test_streaming_diloco_refuses_bad_knobs(knobs, message):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        nanoddp.DiLoCo(torch.optim.AdamW(model.parameters()), **{"sync_every": H, **knobs})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_fragments_are_contiguous_near_equal_and_never_empty():
    assert cut_fragments([64, 8, 64, 8], 2) == [range(0, 2), range(2, 4)]  # the halves
    assert cut_fragments([64, 8, 64, 8], 1) == [range(0, 4)]
    # one big tensor cannot be split: the others still get a fragment each
    assert cut_fragments([100, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert cut_fragments([10] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_int8_rounds_each_block_to_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(INT8_BLOCK, generator=g), torch.zeros(INT8_BLOCK), 1e-3 * torch.randn(7, generator=g)])
    q, scales = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (3,)
    assert q.abs().max() == 127 and torch.equal(scales[1], torch.tensor(0.0))  # absmax -> 127; zeros stay 0
    back = dequantize_int8(q, scales)
    for block, scale in zip(range(0, x.numel(), INT8_BLOCK), scales, strict=True):
        error = (back - x)[block : block + INT8_BLOCK].abs().max()
        assert error <= scale / 2 * (1 + 1e-6)  # round to nearest: at most half a step
