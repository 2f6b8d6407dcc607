"""`nanoddp.fsdp`: torch.distributed.fsdp's FSDP2 names, on nanoddp's sharding.

Why a face of its own: FSDP2 code should run with one changed import,
`from nanoddp.fsdp import fully_shard, MixedPrecisionPolicy, ...`. Everything here has
torch's name, signature and meaning; `settings` holds nanoddp's extra knobs (collectives
backend, learned prefetch), read by each `fully_shard` call. Our `FSDPModule` derives from
torch's, so `isinstance(m, torch.distributed.fsdp.FSDPModule)` holds for our modules too.
"""

from nanoddp.parallel.fsdp.fully_shard import FSDPSettings, fully_shard, settings
from nanoddp.parallel.fsdp.module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from nanoddp.parallel.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "FSDPSettings",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "settings",
]
