"""What a joiner receives is packed into one flat tensor per dtype (`nanoddp.ft.packed_state`) and
unpacked bitwise equal, each tensor on its own storage; `LiveState` moves a trained GPT's weights,
AdamW state and RNG through it. The transfer over a rebuilt group, and the step after it, are run
end to end in tests/multiproc/test_ft.py (a replacement's run bitwise equal to its replay)."""

from __future__ import annotations

import random
from collections import OrderedDict, namedtuple

import numpy as np
import torch

from nanoddp.ft.live_state import LiveState
from nanoddp.ft.packed_state import FLAT_KEY, pack, unpack
from nanoddp.models.gpt import GPT, GPTConfig

Pair = namedtuple("Pair", "left right")


def _assert_same(got, want):
    """Equal structure, types and bits (tensors: dtype, shape and every byte)."""
    assert type(got) is type(want) or isinstance(want, torch.Tensor), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    else:
        assert got == want


def test_a_mixed_state_comes_back_bitwise_from_one_tensor_per_dtype():
    torch.manual_seed(0)
    matrix = torch.randn(6, 5)
    state = {
        "weights": OrderedDict(a=torch.randn(3, 4), b=matrix.t(), scalar=torch.tensor(2.5)),  # b: not contiguous
        "half": [torch.randn(7).to(torch.bfloat16), torch.tensor([], dtype=torch.bfloat16)],
        "counts": Pair(torch.arange(5), torch.tensor([True, False, True])),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "meta": {"step": 3, "name": "x", "nested": (1, [2.0, None])},
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    packed = pack(state)
    dtypes = [flat.dtype for flat in packed[FLAT_KEY]]
    assert sorted(map(str, dtypes)) == sorted(map(str, {torch.float32, torch.bfloat16, torch.int64, torch.bool}))
    got = unpack(packed)
    _assert_same(got["weights"], state["weights"])
    _assert_same(got["half"], state["half"])
    _assert_same(got["counts"], state["counts"])
    _assert_same(got["nan"], state["nan"])
    assert got["meta"] == state["meta"]
    _assert_same(got["param"], state["param"].detach())
    storages = {t.untyped_storage().data_ptr() for t in (*got["weights"].values(), got["nan"]) if t.numel()}
    assert len(storages) == 4  # each its own tensor: none pins the transfer buffer
    state["weights"]["a"].add_(1)  # packing copied: the source may step on
    assert not torch.equal(got["weights"]["a"], state["weights"]["a"])


def test_a_live_state_moves_a_trained_gpt_and_adamw_bitwise():
    def trained(seed: int):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(seed + 1):
            idx = torch.randint(0, 64, (2, 8))
            model(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    source_model, source_optimizer = trained(1)
    source_history = [3, 3, 2]
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    sent = LiveState(source_model, source_optimizer, source_history).take()
    want_rng, want_random, want_numpy = torch.get_rng_state(), random.random(), np.random.random()

    model, optimizer = trained(2)  # other weights, another optimizer step count
    history: list[int] = []
    torch.manual_seed(99)
    np.random.seed(98)
    LiveState(model, optimizer, history).put(sent)

    _assert_same(model.state_dict(), source_model.state_dict())
    _assert_same(optimizer.state_dict(), source_optimizer.state_dict())
    assert history == source_history
    assert torch.equal(torch.get_rng_state(), want_rng) and random.random() == want_random
    assert np.random.random() == want_numpy  # a healed rank restores every generator a resumed one does
