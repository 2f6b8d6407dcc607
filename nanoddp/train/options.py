"""What `nanoddp.Trainer(model, optimizer, dataset, **options)` does before its first step.

`nanoddp train` gets these from its launcher (config checked before any worker starts, run
directory locked by the agent, process group made by the worker). A user script launched with
`nanoddp run` or torchrun has none of that, so the public Trainer does it here, on every rank:
options become a checked `TrainConfig`, the process group comes from torchrun's environment
when the script has not made one, and rank 0 takes the run directory's lock (every rank raises
the same error when it cannot). The optimizer must step the model's own parameters; a Trainer
that fails gives its lock back, and the run directory too while it holds nothing to resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanoddp import env as nd
from nanoddp.base import records
from nanoddp.base.limits import PG_TIMEOUT_MARGIN_S
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import rundir
from nanoddp.train.config import TrainConfig, validate_loop
from nanoddp.train.launcher import preflight
from nanoddp.train.ranks import broadcast_from_master

# Fields that describe nanoddp train's built-in model, data, optimizer and schedule: a user
# brings their own, so setting one of these is a mistake worth naming.
BUILTIN_ONLY = {
    "on_failure": "for a loop that survives a lost rank, use nanoddp.ft.FaultTolerant under "
    "`nanoddp run --on-failure continue` (docs/ft.md)",
    "model": "pass your model as the first argument",
    "preset": "pass your model as the first argument",
    "d_model": "pass your model as the first argument",
    "n_layers": "pass your model as the first argument",
    "n_heads": "pass your model as the first argument",
    "d_ff": "pass your model as the first argument",
    "grad_checkpoint": "enable checkpointing in your model",
    "data": "pass your dataset as train_dataset",
    "seq_len": "pass your dataset as train_dataset",
    "text_max_bytes": "pass your dataset as train_dataset",
    "val_fraction": "pass eval_dataset",
    "lr": "set it on your optimizer",
    "weight_decay": "set it on your optimizer",
    "warmup_steps": "pass lr_scheduler",
    "min_lr_ratio": "pass lr_scheduler",
}
# What a Trainer writes into its run directory before the first snapshot: a failed run that
# made the directory removes it while it holds only these (see `release_run_dir`).
SETUP_FILES = frozenset({"config.json", records.FILE_NAME})
_CREATED: dict[int, str] = {}  # lock fd -> the run directory claim_run_dir created for it
logger = logging.getLogger(__name__)


def options_config(options: dict[str, Any], model: torch.nn.Module, optimizer: Any, dataset: Any) -> TrainConfig:
    """`TrainConfig` from the Trainer's keyword options; unknown or built-in-only names refused."""
    from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(
            f"nanoddp.Trainer got unknown option(s) {unknown}; options are TrainConfig's fields: "
            f"{sorted(fields - set(BUILTIN_ONLY))}"
        )
    builtin = sorted(set(options) & set(BUILTIN_ONLY))
    if builtin:
        raise TypeError(
            "nanoddp.Trainer: "
            + "; ".join(f"{name} describes nanoddp train's built-in setup: {BUILTIN_ONLY[name]}" for name in builtin)
        )
    check_optimizer(model, optimizer)
    if options.get("engine") == "zero1" and not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ValueError(
            "engine 'zero1' shards the optimizer state: pass a nanoddp.ZeroRedundancyOptimizer as the optimizer"
        )
    return TrainConfig(
        # the whole eval set, and no clipping, unless asked: a plain torch loop (and Accelerate,
        # Lightning) leaves the gradients as they are; `nanoddp train` keeps its own 1.0
        **{"eval_samples": 0, "grad_clip": 0.0, **options},
        # recorded in config.json and the snapshot's fingerprint; TrainConfig.model's Literal lists
        # `nanoddp train`'s built-in --model choices, a user model's config holds its class name
        model=_class_name(model),  # type: ignore[arg-type]
        data=_class_name(dataset),
    )


def check_optimizer(model: torch.nn.Module, optimizer: Any) -> None:
    """The optimizer must step the model's own parameters (a subset is fine: a frozen layer).

    One built from another model (a copy, a model rebuilt in a notebook cell) trains nothing
    that is synchronised or saved, and the run still ends "successfully" with the untouched
    model; a foreign parameter among the model's is neither averaged across ranks nor saved.
    """
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for p in params)
    if foreign == len(params) and params:
        raise ValueError(
            f"nanoddp.Trainer: none of the optimizer's {len(params)} parameters are the model's, so "
            "training would change nothing that is saved; build the optimizer from this model, e.g. "
            f"{type(optimizer).__name__}(model.parameters(), ...), after any change to the model"
        )
    if foreign:
        raise ValueError(
            f"nanoddp.Trainer: {foreign} of the optimizer's {len(params)} parameters are not the model's: "
            "they would be neither averaged across ranks nor saved; make them part of the model, or "
            "leave them out of the optimizer"
        )


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def joined_env(config: TrainConfig) -> DistEnv:
    """This process's place in the job, joining torchrun's process group if the script has not.

    Under torchrun the hang watchdog is armed too (it is already, under `nanoddp run`), so a
    rank stuck in a collective is named within `collective_timeout` instead of hanging the job.
    """
    if dist.is_available() and dist.is_initialized():
        return DistEnv.from_process_group()
    env = DistEnv.from_environ()
    nd.init(env, timeout=timedelta(seconds=config.collective_timeout + PG_TIMEOUT_MARGIN_S))
    if env.torchrun:
        from nanoddp.comm.transport import watchdog

        if watchdog.active() is None:
            watchdog.enable(config.collective_timeout)
    return env


def configure_logging(env: DistEnv) -> None:
    """Rank 0 shows the trainer's progress lines when the script configured no logging; the
    other ranks stay quiet but for warnings (a script's own logging setup always wins)."""
    root = logging.getLogger()
    if root.handlers:
        return
    if env.is_master:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    else:
        root.setLevel(logging.WARNING)


def _default_out() -> str | None:
    """A run directory every restart of this torchrun job agrees on (its run id), else None."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return None if run_id == "none" else f"runs/run-{run_id[:12]}"


def claim_run_dir(config: TrainConfig, env: DistEnv) -> tuple[TrainConfig, int | None]:
    """Check the options on every rank, then let rank 0 pick, create and lock the run directory.

    Returns the config with `out` filled in and rank 0's lock descriptor (None elsewhere; hold
    it for the run, `release_run_dir` after). A refusal is the same error on every rank.
    """
    validate_loop(config, env.world_size)
    decision, fd = None, None
    if env.is_master:
        try:
            out = config.out or _default_out() or rundir.default_run_dir()
            created = not os.path.lexists(out)
            preflight.check_out_dir(out)
            fd = rundir.lock_run_dir(out)
            if created:
                _CREATED[fd] = out
            decision = ("ok", out)
        except (ValueError, rundir.RunDirBusy) as exc:
            decision = ("error", f"{type(exc).__name__}: {exc}")
    kind, value = broadcast_from_master(decision, env)
    if kind == "error":
        raise ValueError(value)
    return dataclasses.replace(config, out=value), fd


def release_run_dir(fd: int | None, failed: bool = False) -> None:
    """Give back the lock `claim_run_dir` took (the kernel does it too if the process dies).

    `failed`: the Trainer's construction or `fit()` raised. A run directory `claim_run_dir` made
    is then removed while it holds only the files setup writes (nothing to resume), so that the
    corrected retry in the same process (a notebook) leaves no litter behind. Either way the lock
    goes: an fd left open would make that retry's lock refuse, naming this very process.
    """
    if fd is None:
        return
    out = _CREATED.pop(fd, None)
    try:
        if failed and out is not None and rundir.remove_if_empty(out, also=SETUP_FILES):
            logger.info("removed run directory %s: the run failed before saving anything", out)
    finally:
        os.close(fd)
