"""The Trainer's `fsdp` engine: how a model becomes FSDP units, at which precision, and how the
optimizer built before that follows it.

Why apart from `engines.py`: the other engines wrap a model; this one replaces its parameters
(`nanoddp.fsdp.fully_shard` registers new DTensor parameters), so three things must happen
before resume and before the engine, in the trainer: every rank takes rank 0's values, the
model is sharded unit by unit (`parallel.fsdp.auto_wrap` picks the units, `--fsdp-wrap`
overrides), and the optimizer (built over the old parameters, possibly holding whole state from
a snapshot) is moved onto the new ones. Mixed precision is FSDP's own: the units all-gather and
compute in bf16/fp16 (`MixedPrecisionPolicy.param_dtype`) and reduce gradients in float32, so
the sharded parameters, gradients and optimizer stay float32.

A model the user sharded already is used as is with `engine="fsdp"` (and refused by every other
engine: `parallel.detect`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.parallel.detect import sharded_by

logger = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mp_policy(amp: str):
    """FSDP's mixed precision for `--amp`: compute in the half dtype, reduce in float32."""
    from nanoddp.parallel.fsdp.policies import MixedPrecisionPolicy

    if amp == "off":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=AMP_DTYPES[amp], reduce_dtype=torch.float32)


def shard_model(module: nn.Module, env: DistEnv, wrap: str = "", amp: str = "off") -> nn.Module:
    """Rank 0's values everywhere, then `fully_shard` on each unit `auto_wrap` picks, then the root."""
    from nanoddp.comm.backend import collectives_for
    from nanoddp.parallel.fsdp.auto_wrap import modules_to_shard
    from nanoddp.parallel.fsdp.fully_shard import fully_shard
    from nanoddp.parallel.replicas import broadcast_coalesced

    broadcast_coalesced([*module.parameters(), *module.buffers()], collectives_for())  # rank 0's start
    units = modules_to_shard(module, wrap)
    policy = mp_policy(amp)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    if env.is_master:
        logger.debug("fsdp: %d units (%s) and the root", len(units), sorted({type(u).__name__ for u in units}))
    return module


def prepare_model(config, module: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
    """The trainer's step before resume: refuse a model sharded for another engine; for fsdp,
    shard a plain model in place and move `optimizer` onto its new parameters."""
    from nanoddp.parallel.fsdp.state_dict import rebind_optimizer

    kind = sharded_by(module)
    if kind is not None and kind != config.engine:
        raise ValueError(
            f"the model is already sharded ({kind}): engine {config.engine!r} would treat each rank's pieces "
            f"as the whole model; use engine={kind!r} (--engine {kind}), or pass the model unsharded"
        )
    if config.engine != "fsdp":
        return
    if kind is None:
        names = {id(p): name for name, p in module.named_parameters()}
        shard_model(module, env, config.fsdp_wrap, config.amp)
        new = dict(module.named_parameters())
        rebind_optimizer(optimizer, {i: new[name] for i, name in names.items()})
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer holds parameters the sharded model does not have: build it over "
            "model.parameters() after fully_shard"
        )


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A snapshot's whole model into `module`, sharded (each rank keeps its rows) or not."""
    if sharded_by(module) == "fsdp":
        from nanoddp.parallel.fsdp.state_dict import load_full_state

        load_full_state(module, state)
    else:
        module.load_state_dict(state)
