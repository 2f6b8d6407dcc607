"""DistributedDataParallel: the wrapper, its bucket reducer, comm hooks, Join, and the torch-2.13 extras."""

from nanoddp.parallel.ddp.wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
