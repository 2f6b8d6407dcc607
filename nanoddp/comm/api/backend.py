"""The one switch between nanoddp's collectives and torch.distributed's.

Every user of collectives (DDP, the manual strategies, ZeRO, replica checks) asks this module
for a namespace with torch.distributed's names and signatures (`all_reduce`, `broadcast`,
`all_gather`, ..., `ReduceOp`), so engine code never branches on the backend. Both choices are
known to the hang watchdog. `nanoddp.comm` is imported lazily: importing a wrapper never
depends on it.
"""

from __future__ import annotations

import types

COMM_BACKENDS = ("nanoddp", "torch")
DEFAULT_COMM_BACKEND = "nanoddp"
# What `collectives_for` returns: the nanoddp.comm module, or a namespace of torch's watched functions.
Collectives = types.ModuleType | types.SimpleNamespace


def check_comm_backend(comm_backend: str) -> None:
    """Raise the one clear error for an unknown backend name."""
    if comm_backend not in COMM_BACKENDS:
        raise ValueError(f"comm_backend must be one of {COMM_BACKENDS}, got {comm_backend!r}")


def collectives_for(comm_backend: str = DEFAULT_COMM_BACKEND) -> Collectives:
    """`nanoddp.comm` (collectives over point-to-point) or torch.distributed's, watched."""
    check_comm_backend(comm_backend)
    if comm_backend == "torch":
        from nanoddp.comm.transport.watchdog import TORCH_COLLECTIVES

        return TORCH_COLLECTIVES
    from nanoddp import comm

    return comm
