"""Notebook mode's face: the package `%load_ext nanoddp.notebook` loads; re-exports only.

IPython magics that run cells on N distributed worker processes:

    %load_ext nanoddp.notebook
    %dist_init --num-processes 2
    %%distributed

IPython calls this package's `load_ipython_extension` / `unload_ipython_extension`. The magics
and what they promise are in `nanoddp.notebook.magics`, the worker pool in `pool`, the worker
process in `worker`.
"""

from nanoddp.notebook.display import CellInterrupted, CellRenderer, DistributedCellError, format_status
from nanoddp.notebook.handshake import PoolError
from nanoddp.notebook.magic_options import DEFAULT_PG_TIMEOUT_S, check_devices, parse_ranks, placement
from nanoddp.notebook.magics import (
    COLLECTIVE_CALL,
    DistributedMagics,
    current_pool,
    load_ipython_extension,
    unload_ipython_extension,
)
from nanoddp.notebook.outcome import CellOutcome
from nanoddp.notebook.pool import WorkerPool

__all__ = [
    "COLLECTIVE_CALL",
    "DEFAULT_PG_TIMEOUT_S",
    "CellInterrupted",
    "CellOutcome",
    "CellRenderer",
    "DistributedCellError",
    "DistributedMagics",
    "PoolError",
    "WorkerPool",
    "check_devices",
    "current_pool",
    "format_status",
    "load_ipython_extension",
    "parse_ranks",
    "placement",
    "unload_ipython_extension",
]
