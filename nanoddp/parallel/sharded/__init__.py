"""Sharded parameters: flat storage, ZeRO-2 and FSDP (fully_shard) on our collectives."""

from nanoddp.parallel.sharded.fsdp import fully_shard
from nanoddp.parallel.sharded.zero2 import zero2

__all__ = ["fully_shard", "zero2"]
