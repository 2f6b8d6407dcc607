"""nanoddp: small, readable, fast data-parallel training for PyTorch.

The public API is re-exported here; docs/architecture.md describes the layout and the contract.
`fully_shard` loads on first use: it brings DTensor ([Note: DTensor on first use]).
"""

import importlib
from typing import TYPE_CHECKING, Any

from nanoddp.env import DistEnv, cleanup, init, seed_everything
from nanoddp.launch import LaunchError, launch, notebook_launch
from nanoddp.parallel.clip import clip_grad_norm_
from nanoddp.parallel.ddp import comm_hooks as hooks
from nanoddp.parallel.ddp.wrapper import DistributedDataParallel
from nanoddp.parallel.dp.data_parallel import DataParallel
from nanoddp.parallel.lowcomm import DiLoCo, LocalSGD
from nanoddp.parallel.manual import SimpleDDP
from nanoddp.parallel.replicas import verify_replicas
from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer
from nanoddp.train.checkpoint.user_state import load_state, save_state
from nanoddp.train.gather import gather_for_metrics
from nanoddp.train.trainer import Trainer

__version__ = "0.1.0"

if TYPE_CHECKING:
    from nanoddp.fsdp import fully_shard


def __getattr__(name: str) -> Any:  # PEP 562: called for names not found above
    if name == "fully_shard":
        globals()[name] = value = importlib.import_module("nanoddp.fsdp").fully_shard  # asked once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataParallel",
    "DiLoCo",
    "DistEnv",
    "DistributedDataParallel",
    "LaunchError",
    "LocalSGD",
    "SimpleDDP",
    "Trainer",
    "ZeroRedundancyOptimizer",
    "__version__",
    "cleanup",
    "clip_grad_norm_",
    "fully_shard",
    "gather_for_metrics",
    "hooks",
    "init",
    "launch",
    "load_state",
    "notebook_launch",
    "save_state",
    "seed_everything",
    "verify_replicas",
]
