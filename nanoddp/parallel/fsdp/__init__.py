"""FSDP2 on our collectives, laid out as torch's `_fully_shard/`: the API, module, param, unit, state.

The public face is `nanoddp.fsdp` (torch's names); read this folder in the order
`fully_shard.py` → `module.py` → `param.py` → `unit.py` → `state.py`, then `state_dict.py`.
Nothing is imported here: ZeRO-2 and the snapshots use `state_dict.py` without FSDP's modules.
"""
