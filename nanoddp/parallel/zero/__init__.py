"""ZeRO-1: ZeroRedundancyOptimizer, its element-wise partition, and its Join hook."""

from nanoddp.parallel.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
