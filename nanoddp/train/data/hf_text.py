"""Text for a pretrained LLM: tokenized with its own tokenizer and *packed* into windows.

The same text sources as the byte-level GPT (the Python stdlib's source by default, or a
`--data PATH`), read as one UTF-8 stream (files joined as `text_windows.read_text_source` joins
them), tokenized with the model's Hugging Face tokenizer, and split into non-overlapping
windows of `seq_len + 1` tokens (`TokenWindows`: input = window[:-1], target = window[1:]).
The last `val_fraction` of the stream is the validation set.

Packed, not dynamically padded, because:

- every micro-batch then holds exactly `B * seq_len` real tokens on every rank, so the mean
  loss per rank averaged over ranks *is* the loss of the concatenated global batch, and DDP's
  gradient average equals a single process on that batch. With padding, ranks would hold
  different numbers of real tokens and a per-rank mean would weight them unequally;
- no compute goes to pad tokens, which matters most where steps are slow (a CPU);
- samples are plain `(x, y)` tensors of one shape, so the trainer's DataLoader, the resumable
  sampler and snapshots work unchanged (no collate function, no attention mask).

The cost is that a window may start mid-line or mid-file and run across a file boundary, the
usual trade in LM pre-training and fine-tuning on code.
"""

from __future__ import annotations

import logging

import torch

from nanoddp.train.data.text_windows import TokenWindows, read_text_source

logger = logging.getLogger(__name__)

TOKENIZE_CHUNK_CHARS = 1 << 16  # characters per tokenizer call, cut at line ends


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids (N,) of `text`, tokenized in line-aligned chunks that decode back to it exactly.

    Chunks keep each tokenizer call small; cutting only after a newline changes at most the
    token split at a chunk's first line, never the text.
    """
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + TOKENIZE_CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return torch.tensor(ids, dtype=torch.int32)


def tokenized_text_splits(
    source: str, seq_len: int, val_fraction: float, max_bytes: int, tokenizer
) -> tuple[TokenWindows, TokenWindows]:
    """(train, val) packed token windows of `source` ("text" or a path) for `tokenizer`."""
    blob = read_text_source(source, max_bytes)
    tokens = tokenize_text(tokenizer, blob.decode("utf-8", errors="replace"))  # (N,)
    split = int(len(tokens) * (1.0 - val_fraction))
    train, val = TokenWindows(tokens[:split], seq_len), TokenWindows(tokens[split:], seq_len)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(
            f"data {source!r} gives {len(tokens)} tokens: too few for one training and one validation "
            f"sequence of seq_len={seq_len} tokens; give more text (--text-max-bytes) or a smaller --seq-len"
        )
    logger.debug(
        "%s: %d bytes, %d tokens, %d train / %d val windows", source, len(blob), len(tokens), len(train), len(val)
    )
    return train, val
