"""nanoddp: small, readable, fast data-parallel training for PyTorch.

The public API is re-exported here; see DESIGN.md for the contract.
"""

from nanoddp import hooks
from nanoddp.ddp import DistributedDataParallel
from nanoddp.dist import DistEnv, cleanup, init, seed_everything
from nanoddp.dp import DataParallel
from nanoddp.launch import LaunchError, launch
from nanoddp.replicas import verify_replicas
from nanoddp.strategies import SimpleDDP
from nanoddp.zero import ZeroRedundancyOptimizer

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
    "hooks",
    "init",
    "launch",
    "seed_everything",
    "verify_replicas",
]
