"""Collectives built from scratch on point-to-point send/recv, with torch.distributed's API.

This module is the face only: every name below takes the same arguments as its
`torch.distributed` namesake (src/dst are *global* ranks, `group` may be a subgroup) and gives
the same results, but every byte moves through `isend`/`irecv`. The layers beneath are its
folders, top first, each importing only the ones below it: `api/` (`collectives`: all_reduce,
all_gather, reduce_scatter, each check -> plan -> run; `rooted`: broadcast, reduce, scatter,
gather; `alltoall`: all_to_all, barriers, batched p2p; `objects`: pickled objects, trusted ranks
only; `backend`: the switch to torch's); `protocol/` (`wire`, `header_round`, `settle`, `checks`:
the check every call starts with; `cached_rounds`: the optional prepared rounds); `algorithms/`
(`ring`, `chain`, `exchange`, ...); `plan/` (which path, one table); `transport/` (`transport`,
`runner`, `watchdog`). The threading model is in `api/collectives`.
"""

from torch.distributed import ReduceOp

from nanoddp.comm.api.alltoall import all_to_all, all_to_all_single, barrier, batch_isend_irecv, monitored_barrier
from nanoddp.comm.api.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from nanoddp.comm.api.objects import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
from nanoddp.comm.api.rooted import broadcast, gather, reduce, scatter
from nanoddp.comm.plan.plan import INLINE_MAX_BYTES, INLINE_SEND_BYTES  # values at import; set them in `plan.plan`
from nanoddp.comm.transport.runner import Work
from nanoddp.comm.transport.runner import runner_for as runner_for  # not torch's: the group's runner (tests, bench)

__all__ = [
    "INLINE_MAX_BYTES", "INLINE_SEND_BYTES", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
    "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "all_gather_single", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
]  # fmt: skip
