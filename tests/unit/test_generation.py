"""GPT's cached generation against the plain loop it replaces: a full forward over the last
seq_len tokens for every new token. Same tokens (greedy and seeded sampling), also once the text
outgrows the window and the cache has to start over; logits of a cached step close to the full
forward's (another kernel's summation order, so not bitwise)."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_by_full_recompute

from nanoddp.models.gpt import GPT, GPTConfig, KVCache

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: this model's ops are microseconds, and on a busy 2-core machine a
    second thread spins waiting for a descheduled peer (seconds per test, not milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


@pytest.mark.parametrize("prompt_len", [3, 16, 21])  # inside the window, filling it, longer than it
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 1), (0.8, None), (1.3, 5)])  # greedy, sampled
def test_cached_generation_gives_the_full_recompute_tokens(prompt_len, temperature, top_k):
    model = tiny_gpt()
    prompt = torch.randint(0, CFG.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    new_tokens = 2 * CFG.seq_len + 5  # the window slides: the cache starts over every step past it
    want = generate_by_full_recompute(model, prompt, new_tokens, temperature, top_k, torch.Generator().manual_seed(7))
    got = model.generate(prompt, new_tokens, temperature, top_k, torch.Generator().manual_seed(7))
    assert torch.equal(got, want)
    streamed = list(model.stream(prompt, new_tokens, temperature, top_k, torch.Generator().manual_seed(7)))
    assert len(streamed) == new_tokens and all(t.shape == (2, 1) for t in streamed)
    assert torch.equal(torch.cat([prompt, *streamed], dim=1), want)


def test_cached_forward_matches_the_full_forward():
    """Prefill, then one token and then three at a time: each position's logits are the full
    forward's; the prefill itself runs the training path's ops (bitwise)."""
    model = tiny_gpt()
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        cache = KVCache()
        prefill = model(idx[:, :5], cache=cache)
        assert torch.equal(prefill, model(idx[:, :5]))
        one = model(idx[:, 5:6], cache=cache)
        three = model(idx[:, 6:9], cache=cache)
        assert cache.length == 9 and cache.keys[0].shape == (2, CFG.n_heads, 9, CFG.d_model // CFG.n_heads)
        torch.testing.assert_close(torch.cat([prefill, one, three], dim=1), full[:, :9])
        with pytest.raises(ValueError, match="sequence length 17 exceeds the model's seq_len=16"):
            model(idx[:, :8], cache=cache)
