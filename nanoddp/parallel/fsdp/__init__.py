"""FSDP2 on our collectives, laid out as torch's `_fully_shard/`: the API, module, param, unit, state.

The public face is `nanoddp.fsdp` (torch's names); read this folder in the order
`fully_shard.py` → `module.py` → `param.py` → `unit.py` → `state.py`, then `state_dict.py`.
"""

from nanoddp.parallel.fsdp.fully_shard import fully_shard

__all__ = ["fully_shard"]
