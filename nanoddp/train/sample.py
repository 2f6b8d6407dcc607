"""`nanoddp sample`: text from a trained run's model, written as it is generated.

It reads the run's `config.json` and `model.pt` (or, for a sharded run without one, the newest
valid snapshot's pieces), rebuilds the model in this one process and streams: the prompt first,
then each token's text the moment the model has drawn it (`GPT.stream`, with its key/value cache).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from nanoddp.dataclass_cli import build_config, load_config_file
from nanoddp.train.config import TrainConfig

if TYPE_CHECKING:  # torch is imported where it is used: `nanoddp --help` stays fast
    import torch


class _Streams(Protocol):
    """The text models `sample` builds (GPT, SmolLM2): `build_model` types them as nn.Module."""

    def stream(self, idx: torch.Tensor, new_tokens: int, **kwargs: Any) -> Iterator[torch.Tensor]: ...


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `nanoddp sample` and its flags."""
    sample = subparsers.add_parser("sample", help="generate text from a trained run")
    sample.add_argument("--run", dest="run_dir", required=True, metavar="DIR", help="run directory of `nanoddp train`")
    sample.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    sample.add_argument("--tokens", type=int, default=300, help="tokens to generate (bytes; smollm2: BPE tokens)")
    sample.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (default: 0.8)")
    sample.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest (default: 40)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    sample.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default: 1: one sequence's matmuls are small, and on a busy machine a "
        "second thread spends its time waiting for the first)",
    )
    sample.set_defaults(run=run_sample)


def run_sample(args: argparse.Namespace) -> int:
    """Check the flags and the run, load its model, and stream the continuation of the prompt."""
    import torch

    from nanoddp.train.checkpoint import snapshot, user_state
    from nanoddp.train.config import build_model
    from nanoddp.train.data.datasets import BYTE_VOCAB, DataSpec

    run_dir = Path(args.run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: --run must be a `nanoddp train` output directory")
    values = load_config_file(config_path)
    for key in ("run_id", "fingerprint"):  # the run's identity, stored beside its config
        values.pop(key, None)
    config = build_config(TrainConfig, values, source=str(config_path))
    if config.model == "mlp" or config.data in ("synthetic", "copy", "digits"):
        raise ValueError(f"sample generates text, but run {run_dir} was trained on {config.data!r}")
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1 (1 = always the likeliest byte), got {args.top_k}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    encode, decode = _text_codec(config.model)
    model = build_model(config, DataSpec("lm", BYTE_VOCAB))
    if (run_dir / "model.pt").is_file():
        model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True))
    else:
        found = snapshot.find_latest_valid(run_dir / "snapshots")
        if found is None:
            raise FileNotFoundError(f"no model.pt and no valid snapshot in {run_dir}")
        # a sharded run's model is in per-rank files: this one process reads every piece
        user_state.load_objects(found[0], {"model": model}, restore_rng=False, manifest=found[1])
    model.eval()
    ids = encode(args.prompt or "\n")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = cast(_Streams, model).stream(
        torch.tensor([ids], dtype=torch.long), args.tokens, temperature=args.temperature, top_k=args.top_k,
        generator=generator,
    )  # fmt: skip
    try:
        _write_as_generated(ids, tokens, decode)
    except BrokenPipeError:  # `nanoddp sample ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def _write_as_generated(ids: list[int], tokens: Iterator[torch.Tensor], decode: Callable[[list[int]], str]) -> None:
    """Write the text of `ids` (the prompt), then each token's text the moment it is drawn."""
    printed = 0
    for token in itertools.chain([None], tokens):  # None: the prompt, shown before the first token
        if token is not None:
            ids.append(int(token[0, 0]))
        # A character split over tokens decodes to U+FFFD until its last piece arrives: hold it back.
        ready = decode(ids).rstrip("\ufffd") if token is not None else decode(ids)
        if len(ready) > printed:
            sys.stdout.write(ready[printed:])
            sys.stdout.flush()  # a pipe is block-buffered: show the text as it comes
            printed = len(ready)
    sys.stdout.write(decode(ids)[printed:] + "\n")


def _text_codec(model: str):
    """(encode, decode) between text and the run's token ids: bytes, or SmolLM2's tokenizer."""
    if model == "smollm2":
        from nanoddp.models import load_smollm2_tokenizer

        tokenizer = load_smollm2_tokenizer()
        return (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]), tokenizer.decode
    return (lambda text: list(text.encode())), (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
