"""Datasets for the trainer: byte-level text, synthetic tokens, and scikit-learn's digits.

Every dataset returns `(input, target)` pairs so that the trainer can call `model(x, y)` the
same way for all of them, and exposes `tokens_per_sample` for throughput figures.

Text (the Python stdlib's source by default, see `text_windows`) is read in a fixed order and
its byte stream is split into train/val by position, so every rank and every run sees the same
data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from nanoddp.train.data.hf_text import tokenized_text_splits
from nanoddp.train.data.text_windows import BUILTIN_DATA as BUILTIN_DATA
from nanoddp.train.data.text_windows import TokenWindows as TokenWindows
from nanoddp.train.data.text_windows import read_text_source as read_text_source
from nanoddp.train.data.text_windows import stdlib_source_files as stdlib_source_files

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256


class TokenRows(Dataset):
    """Rows of a (N, T + 1) token matrix as next-token pairs (x, y)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows.to(torch.int64)
        self.tokens_per_sample = rows.shape[1] - 1

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[index]  # (T + 1,)
        return row[:-1], row[1:]


class TensorPairs(Dataset):
    """(features, label) pairs for classification."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor):
        self.features = features
        self.labels = labels
        self.tokens_per_sample = 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]


# --- text ---------------------------------------------------------------------------------


def byte_text_splits(source: str, seq_len: int, val_fraction: float, max_bytes: int = 0):
    """Byte-level LM datasets (train, val); val is the last `val_fraction` of the bytes."""
    blob = read_text_source(source, max_bytes)
    if not blob:  # torch.frombuffer would fail with an obscure "buffer length (0)" error
        raise ValueError(f"data {source!r} is empty (0 bytes of text); give a non-empty text file or directory")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # (N,)
    split = int(len(tokens) * (1.0 - val_fraction))
    train, val = TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len)
    if len(train) == 0:
        raise ValueError(
            f"data {source!r} has {len(blob)} bytes: too few for even one training sequence of "
            f"seq_len={seq_len}; give more text or a smaller --seq-len"
        )
    logger.debug("text %s: %d bytes, %d train / %d val sequences", source, len(blob), len(train), len(val))
    return train, val


# --- synthetic ----------------------------------------------------------------------------


def random_tokens(num_samples: int, seq_len: int, vocab_size: int, seed: int = 1234) -> TokenRows:
    """Toy data for the DDP-vs-manual-all-reduce comparison: uniformly random tokens.

    Nothing to learn; the loss stays near ln(V).
    """
    generator = torch.Generator().manual_seed(seed)
    return TokenRows(torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator))


def copy_task(num_samples: int, seq_len: int, vocab_size: int = 16, period: int = 8, seed: int = 1234) -> TokenRows:
    """A learnable task: each row is a random block of `period` tokens (ids < `vocab_size`)
    repeated to fill the row.

    Learning happens in two visible phases: first which ids occur (loss from ~ln(256) down to
    ln(vocab_size)), then copying: after the first block every token is predictable by looking
    `period` positions back, which drives the loss towards (period / seq_len) * ln(vocab_size).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, vocab_size, (num_samples, period), generator=generator)  # (N, P)
    repeats = -(-(seq_len + 1) // period)
    return TokenRows(blocks.repeat(1, repeats)[:, : seq_len + 1])  # (N, T + 1)


def digits_splits(val_fraction: float, seed: int = 0) -> tuple[TensorPairs, TensorPairs]:
    """scikit-learn's bundled 8x8 digit images (1797 of them), scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError("--data digits needs scikit-learn: pip install 'nanoddp[data]'") from None
    bunch = load_digits()
    features = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # (N, 64)
    labels = torch.tensor(bunch.target, dtype=torch.int64)  # (N,)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    split = int(len(labels) * (1.0 - val_fraction))
    train, val = order[:split], order[split:]
    return TensorPairs(features[train], labels[train]), TensorPairs(features[val], labels[val])


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data."""

    kind: str  # "lm" or "classification"
    vocab_size: int  # tokens for LM, classes for classification
    in_features: int = 0


def build_datasets(
    data: str,
    seq_len: int,
    val_fraction: float,
    max_bytes: int = 0,
    synthetic_samples: int = 8192,
    *,
    model: str = "gpt",
) -> tuple[Dataset, Dataset, DataSpec]:
    """(train, val, spec) for a `--data` value: text, synthetic, copy, digits, or a path.

    `model="smollm2"` reads the same text but tokenizes it with SmolLM2's own tokenizer
    (`nanoddp.train.data.hf_text`) instead of bytes.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if model == "smollm2":
        from nanoddp.models import load_smollm2_tokenizer

        tokenizer = load_smollm2_tokenizer()
        train, val = tokenized_text_splits(data, seq_len, val_fraction, max_bytes, tokenizer)
        return train, val, DataSpec("lm", len(tokenizer))
    if data == "digits":
        digits_train, digits_val = digits_splits(val_fraction)
        return digits_train, digits_val, DataSpec("classification", 10, in_features=digits_train.features.shape[1])
    if data in ("synthetic", "copy"):
        if data == "synthetic":
            rows = random_tokens(synthetic_samples, seq_len, BYTE_VOCAB)
        else:
            rows = copy_task(synthetic_samples, seq_len)
        split = int(len(rows) * (1.0 - val_fraction))
        return TokenRows(rows.rows[:split]), TokenRows(rows.rows[split:]), DataSpec("lm", BYTE_VOCAB)
    train, val = byte_text_splits(data, seq_len, val_fraction, max_bytes)
    return train, val, DataSpec("lm", BYTE_VOCAB)
