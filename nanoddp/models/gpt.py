"""Models that know nothing of parallelism: a small GPT and an MLP classifier.

`GPT` is the DDP tutorials' TinyTransformerLM (sinusoidal positions, SDPA causal attention, GELU MLP,
pre-LN blocks) with the loss computed inside `forward` when targets are given (DataParallel's
"loss in forward": DataParallel then gathers one scalar per replica instead of the logits).
Generation keeps each block's past keys and values (`KVCache`), so a new token costs one position's
forward instead of the whole context's; training never passes a cache and runs the same ops as without one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 512
    """Number of token ids (256 for byte-level text)."""
    seq_len: int = 64
    """Longest context the model sees (size of the positional table)."""
    d_model: int = 256
    """Width of the residual stream."""
    n_heads: int = 8
    """Attention heads; must divide d_model."""
    n_layers: int = 4
    """Transformer blocks."""
    d_ff: int = 1024
    """Hidden width of each block's MLP."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


GPT_PRESETS = {
    "tiny": GPTConfig(),  # the DDP tutorials' TinyTransformerLM, ~3.4 M parameters
    "small": GPTConfig(d_model=512, n_heads=8, n_layers=8, d_ff=2048, seq_len=256),  # ~25 M
}


def gpt_config(preset: str, **overrides: int) -> GPTConfig:
    """A named preset with some fields replaced (e.g. vocab_size from the dataset)."""
    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose one of {sorted(GPT_PRESETS)}")
    return replace(GPT_PRESETS[preset], **overrides)


def sinusoidal_positions(seq_len: int, d_model: int) -> torch.Tensor:
    """The fixed sin/cos table of "Attention is all you need", shape (T, C)."""
    position = torch.arange(seq_len, dtype=torch.float32).unsqueeze(1)  # (T, 1)
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(seq_len, d_model)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


@dataclass
class KVCache:
    """The keys and values every block has computed so far for the tokens at positions [0, length):
    one (B, H, length, C/H) pair per block, grown by `CausalSelfAttention` as generation feeds tokens."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    """Positions held (the same in every block once a forward has finished)."""

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append block `layer`'s keys/values for the new positions; return all of them so far."""
        if layer == len(self.keys):  # the first forward through this block
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)  # (B, H, T_past + T, C/H)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.layer = layer  # this block's slot in a KVCache
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.extend(self.layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        else:
            past = cache.length
            k, v = cache.extend(self.layer, k, v)  # (B, H, past + T, C/H)
            # query i sits at position past + i: it sees every cached key and the new ones up to itself
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One sampled token per row from the last position's `logits` (B, V) -> (B, 1); the k
    likeliest only when `top_k` is given (1 = greedy)."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


class GPT(nn.Module):
    """Decoder-only transformer LM. `forward(idx)` -> logits (B, T, V);
    `forward(idx, targets)` -> (logits, mean cross-entropy loss)."""

    pos_emb: torch.Tensor  # the buffer registered in __init__ (nn.Module's __getattr__ types it Tensor | Module)

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(self.cfg.vocab_size, self.cfg.d_model)
        # A buffer, not a parameter: fixed, and excluded from the state_dict (recomputed).
        self.register_buffer("pos_emb", sinusoidal_positions(self.cfg.seq_len, self.cfg.d_model), persistent=False)
        self.blocks = nn.ModuleList(Block(self.cfg, layer) for layer in range(self.cfg.n_layers))
        self.ln_f = nn.LayerNorm(self.cfg.d_model)
        self.head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        """Logits for the tokens `idx` (B, T); with `cache`, `idx` continues the positions it holds
        (generation: the cache grows by T)."""
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if self.cfg.seq_len < start + T:
            raise ValueError(f"sequence length {start + T} exceeds the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb[start : start + T].unsqueeze(0)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cache)
        if cache is not None:
            cache.length += T
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def stream(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield `new_tokens` sampled continuations of `idx` (B, T) one step at a time, each (B, 1),
        as soon as it is drawn. Each step sees the last seq_len tokens, as a full forward would.

        [Note: the cache past seq_len] Positions are absolute (token i of the window gets
        pos_emb[i]), so once the text outgrows the window every token's position shifts by one
        each step and no cached key or value stays valid: from there each step recomputes the
        window (the last seq_len tokens), which is what a full forward without a cache does.
        """
        cache, context = KVCache(), idx[:, -self.cfg.seq_len :]
        for _ in range(new_tokens):
            if cache.length + context.size(1) > self.cfg.seq_len:  # the window slides: start over
                cache, context = KVCache(), idx[:, -self.cfg.seq_len :]
            next_token = sample_next(self(context, cache=cache)[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat([idx, next_token], dim=1)
            context = next_token
            yield next_token

    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`idx` (B, T) followed by `new_tokens` sampled continuations (B, T + new_tokens)."""
        return torch.cat([idx, *self.stream(idx, new_tokens, temperature, top_k, generator)], dim=1)


class MLPClassifier(nn.Module):
    """A plain MLP for small images (e.g. 8x8 digits flattened to 64 features).
    `forward(x)` -> logits (B, classes); `forward(x, targets)` -> (logits, loss)."""

    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.net(x.flatten(1))  # (B, classes)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float(), targets)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
