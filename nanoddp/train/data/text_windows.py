"""Text as next-token windows: the piece both tokenizations share.

The byte-level GPT (`datasets.byte_text_splits`) and a pretrained LLM's tokenizer
(`hf_text.tokenized_text_splits`) read the same text sources and cut the token stream into the
same non-overlapping windows. Both import these from here, so neither data module imports the
other.

The default text is the Python standard library's own `.py` source, read from the running
interpreter: it is always there, needs no download, and is real text with structure a small
model can learn (indentation, keywords, identifiers). Files are read in sorted order, so every
rank and every run sees the same bytes.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"})
BUILTIN_DATA = ("text", "synthetic", "copy", "digits")  # the `--data` values that are not paths


class TokenWindows(Dataset):
    """Non-overlapping windows of a 1-D token stream: sample i is (x, y) with y = x shifted by 1."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens.to(torch.int64)
        self.seq_len = seq_len
        self.tokens_per_sample = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]  # (T + 1,)
        return window[:-1], window[1:]


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files in a fixed order (tests and third-party code skipped)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_SKIP_DIRS and not d.startswith(".")]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_files(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate files until `max_bytes` (0 = no limit); skip binary ones (a NUL byte)."""
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        if b"\0" in data[:4096]:
            continue
        chunks.append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    blob = b"\n".join(chunks)
    return blob[:max_bytes] if max_bytes else blob


def read_text_source(source: str, max_bytes: int = 0) -> bytes:
    """Bytes of the default stdlib text (`source == "text"`) or of a file or directory path."""
    if source == "text":
        return _read_files(stdlib_source_files(), max_bytes)
    path = Path(source)
    if path.is_file():
        data = path.read_bytes()
        return data[:max_bytes] if max_bytes else data
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        return _read_files(files, max_bytes)
    raise FileNotFoundError(
        f"data path {source!r} does not exist; give a text file, a directory of text files, "
        f"or one of {list(BUILTIN_DATA)}"
    )
