"""nanoddp: small, readable, fast data-parallel training for PyTorch.

The public API is re-exported here; docs/architecture.md describes the layout and the contract.
"""

from nanoddp.env import DistEnv, cleanup, init, seed_everything
from nanoddp.launch import LaunchError, launch
from nanoddp.parallel import hooks
from nanoddp.parallel.ddp import DistributedDataParallel
from nanoddp.parallel.dp import DataParallel
from nanoddp.parallel.fsdp import fully_shard
from nanoddp.parallel.manual import SimpleDDP
from nanoddp.parallel.replicas import verify_replicas
from nanoddp.parallel.zero import ZeroRedundancyOptimizer

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistEnv",
    "DistributedDataParallel",
    "LaunchError",
    "SimpleDDP",
    "ZeroRedundancyOptimizer",
    "__version__",
    "cleanup",
    "fully_shard",
    "hooks",
    "init",
    "launch",
    "seed_everything",
    "verify_replicas",
]
