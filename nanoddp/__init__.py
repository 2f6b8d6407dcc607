"""nanoddp: small, readable, fast data-parallel training for PyTorch.

The public API is re-exported here; see DESIGN.md for the contract.
"""

from nanoddp.dist import DistEnv, cleanup, init, seed_everything
from nanoddp.dp import DataParallel
from nanoddp.launch import LaunchError, launch

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistEnv",
    "LaunchError",
    "__version__",
    "cleanup",
    "init",
    "launch",
    "seed_everything",
]
