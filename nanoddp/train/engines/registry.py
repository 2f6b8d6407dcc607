"""The one engine registry: name -> engine class. `nanoddp train --engine` (choices and help),
TrainConfig's Literal, `bench train` and the traced engines all read it, so an engine added
here is an engine everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from nanoddp.env import DistEnv
from nanoddp.train.engines.base import Engine
from nanoddp.train.engines.ddp import NanoddpEngine, TorchDDPEngine, Zero1Engine
from nanoddp.train.engines.fsdp import FSDPEngine, HSDPEngine
from nanoddp.train.engines.lowcomm import DiLoCoEngine, LocalSGDEngine
from nanoddp.train.engines.manual import AllReduceEngine, ReduceScatterAllGatherEngine
from nanoddp.train.engines.single import SingleEngine
from nanoddp.train.engines.zero2 import Zero2Engine

_IN_HELP_ORDER: tuple[type[Engine], ...] = (
    NanoddpEngine,
    TorchDDPEngine,
    AllReduceEngine,
    ReduceScatterAllGatherEngine,
    SingleEngine,
    Zero1Engine,
    Zero2Engine,
    FSDPEngine,
    HSDPEngine,
    LocalSGDEngine,
    DiLoCoEngine,
)
ENGINE_REGISTRY: dict[str, type[Engine]] = {kind.name: kind for kind in _IN_HELP_ORDER}
ENGINES = tuple(ENGINE_REGISTRY)
if TYPE_CHECKING:  # the checker needs the names spelled out; keep them in ENGINE_REGISTRY's order
    EngineName = Literal[
        "nanoddp", "torch", "allreduce", "rs_ag", "single", "zero1", "zero2", "fsdp", "hsdp", "localsgd", "diloco"
    ]
else:
    EngineName = Literal[ENGINES]  # the type of TrainConfig.engine: its --engine choices


def engine_help() -> str:
    """One line per registry engine, `name  explanation`, for `--engine`'s help."""
    width = max(map(len, ENGINES))
    return "\n".join(f"  {name:<{width}}  {kind.help}" for name, kind in ENGINE_REGISTRY.items())


def _kind(name: str) -> type[Engine]:
    if name not in ENGINE_REGISTRY:
        raise ValueError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")
    return ENGINE_REGISTRY[name]


def build_engine(name: str, module: nn.Module, env: DistEnv) -> Engine:
    """Wrap `module` (already on `env.device`) for engine `name`."""
    return _kind(name).build(module, env)


def prepare_model(config: Any, module: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
    """The trainer's step before resume, for `config.engine`: every engine refuses a model
    sharded for another; fsdp and hsdp shard a plain model now and moves `optimizer` onto it."""
    _kind(config.engine).prepare(module, optimizer, env, config)
