"""Single-process DataParallel: scatter, replicate, parallel_apply, gather."""

from nanoddp.parallel.dp.data_parallel import DataParallel, parallel_apply, replicate
from nanoddp.parallel.dp.scatter_gather import gather, scatter

__all__ = ["DataParallel", "gather", "parallel_apply", "replicate", "scatter"]
