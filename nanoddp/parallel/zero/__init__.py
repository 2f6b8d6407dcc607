"""ZeRO: stage 1 (ZeroRedundancyOptimizer, sharded optimizer state) and stage 2 (`zero2`, sharded gradients too)."""

from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer
from nanoddp.parallel.zero.stage2 import zero2

__all__ = ["ZeroRedundancyOptimizer", "zero2"]
