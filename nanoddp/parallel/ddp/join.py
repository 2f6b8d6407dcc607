"""Uneven inputs for nanoddp's DDP: torch's `Join` protocol (`torch.distributed.algorithms.Join`).

When one rank runs out of batches before the others, the others' next backward waits for an
all-reduce the finished rank never issues: a hang until the collective timeout. Under
`with ddp.join():` (or `with Join([ddp, ...]):`) a finished ("joined") rank instead *shadows*
every iteration the others still run, issuing the same collectives in the same order:

    others' forward                      joined rank (`_DDPJoinHook.main_hook`)
    Join.notify_join_context (1)         Join's count of non-joined ranks (0)
    bucket rebuild broadcast, once       the same broadcast (rank 0's order)
    buffer broadcast (from the highest   the same (an all-reduce MAX picks
      rank still training)                the source, then the broadcast)
    "sync this backward?" all-reduce (1) the same all-reduce (0)
    others' backward
    one all-reduce per bucket            one per bucket, of zeros
    parameter-use all-reduce             the same (with find_unused_parameters, carrying the
                                           counts its previous one returned, as torch's does)

so the joined rank contributes zero gradient. With find_unused_parameters, torch's joined rank
re-sends the parameter-use counts its reducer last held (`_match_unused_params_allreduce`
all-reduces the reducer's device-side used map in place: after the rank's last real iteration
that holds the global counts, and each shadowed all-reduce adds the others' use to it), so a
parameter that was used in that iteration, or by anyone since, counts as used: it then gets a
zero gradient where nobody still training used it, where "unused everywhere" would leave its
`.grad` None. Optimizers treat the two differently (momentum, weight decay, Adam's moments), so
nanoddp re-sends its last counts the same way. The average divides by the initial world size
(`divide_by_initial_world_size=True`, torch's default: every sample weighs the same as before
anyone joined) or by the number of ranks still training. When all have joined, `post_hook`
broadcasts the last joiner's parameters (and buffers) so every replica ends identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.algorithms import Join, JoinHook

from nanoddp.parallel.ddp.buckets import Bucket
from nanoddp.parallel.replicas import broadcast_coalesced

if TYPE_CHECKING:
    from nanoddp.parallel.ddp.wrapper import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """What a joined rank does for one iteration of the others, and once all have joined."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        shadow_iteration(self.ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        sync_final_model(self.ddp, is_last_joiner)


def global_requires_sync(ddp: DistributedDataParallel, wants_sync: bool) -> bool:
    """All-reduce "this rank will synchronise its coming backward": joined ranks learn whether
    to shadow the bucket all-reduces (not for a no_sync or no-grad forward)."""
    flag = torch.tensor([1 if wants_sync else 0], dtype=torch.int32)  # (1,)
    ddp._collectives.all_reduce(flag, group=ddp.process_group)
    return bool(flag.item())


def common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The highest global rank among candidates: under join, buffers are broadcast from a rank
    still training (rank 0 may have joined with stale buffers); at the end, the last joiner."""
    rank = torch.tensor([dist.get_rank() if candidate else -1], dtype=torch.int64)  # (1,)
    ddp._collectives.all_reduce(rank, op=ReduceOp.MAX, group=ddp.process_group)
    return int(rank.item())


def shadow_iteration(ddp: DistributedDataParallel) -> None:
    """Issue, with zeros, every collective one forward+backward of a non-joined rank issues."""
    if ddp._world_size == 1:
        return
    ddp._prepare_for_forward(joined=True)
    if not global_requires_sync(ddp, False):
        return
    ddp._reset_sync_state()
    works = []
    for bucket in ddp._buckets:  # zero stand-ins: the real buffers may be the .grad views
        stand_in = Bucket(bucket.index, bucket.params, bucket.param_indices, bucket.buffer.dtype)
        ddp._launch(stand_in)
        works.append(stand_in.handle)
    for work in works:
        work.wait()
    ddp._global_use_counts(active=False)
    ddp._after_sync_iteration(use_counts=None, shadowed=True)


def sync_final_model(ddp: DistributedDataParallel, is_last_joiner: bool) -> None:
    """Broadcast the model from the last rank to join (ties: the highest rank), as torch does:
    the joined ranks stopped stepping, the last joiner holds the fully trained replica."""
    if ddp._world_size == 1:
        return
    src = common_rank(ddp, is_last_joiner)
    tensors = list(ddp.module.parameters())
    if ddp.broadcast_buffers:
        tensors += list(ddp.module.buffers())
    broadcast_coalesced(tensors, ddp._collectives, ddp.process_group, src)


class JoinableDDP:
    """The Joinable half of DistributedDataParallel: torch's join() API over the hook above."""

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for uneven inputs, as torch DDP's: ranks that run out of batches
        shadow the others' collectives with zero gradients until every rank is done.

        divide_by_initial_world_size: average over the initial world size (True, torch's
        default) or over the ranks still training. throw_on_early_termination: instead, raise on
        every rank as soon as one has run out of data.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self._delayed is not None:
            raise ValueError(
                "join() is not supported with delay_all_reduce_named_params: a joined rank cannot know where "
                "in the others' backward the delayed all-reduce falls (torch's join hook leaves it unmatched "
                "too); give every rank the same number of batches, or leave the parameters in the buckets"
            )
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device or (self._params[0].device if self._params else torch.device("cpu"))

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD
