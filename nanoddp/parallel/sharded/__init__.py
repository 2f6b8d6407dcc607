"""Sharded parameters: ZeRO-2 on flat storage, FSDP (`fully_shard`, DTensor) on our collectives."""

from nanoddp.parallel.sharded.fsdp_init import fully_shard
from nanoddp.parallel.sharded.zero2 import zero2

__all__ = ["fully_shard", "zero2"]
