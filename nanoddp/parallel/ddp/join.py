"""Uneven inputs for nanoddp's DDP: torch's `Join` protocol (`torch.distributed.algorithms.Join`).

When one rank runs out of batches before the others, the others' next backward waits for an
all-reduce the finished rank never issues: a hang until the collective timeout. Under
`with ddp.join():` (or `with Join([ddp, ...]):`) a finished ("joined") rank instead *shadows*
every iteration the others still run, issuing the same collectives in the same order:

    others' forward                      joined rank (`DDPJoinHook.main_hook`)
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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.algorithms import JoinHook

from nanoddp.parallel.ddp.buckets import Bucket
from nanoddp.parallel.ddp.ignored import synced_buffers, synced_parameters
from nanoddp.parallel.ddp.reducer import Reducer
from nanoddp.parallel.replicas import broadcast_coalesced


class DDPJoinHook(JoinHook):
    """What a joined rank does for one iteration of the others, and once all have joined.

    Built by `DistributedDataParallel.join_hook` from the wrapper's reducer, its module and its
    `broadcast_buffers` setting: everything a shadowed iteration touches.
    """

    def __init__(
        self,
        reducer: Reducer,
        module: nn.Module,
        ignored: frozenset[str],
        broadcast_buffers: bool,
        divide_by_initial_world_size: bool,
    ):
        self.reducer, self.module, self.broadcast_buffers = reducer, module, broadcast_buffers
        self.ignored = ignored  # left alone, as by the wrapper (nanoddp.parallel.ddp.ignored)
        reducer.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        shadow_iteration(self.reducer, self.module, self.ignored, self.broadcast_buffers)

    def post_hook(self, is_last_joiner: bool) -> None:
        sync_final_model(self.reducer, self.module, self.ignored, self.broadcast_buffers, is_last_joiner)


def global_requires_sync(reducer: Reducer, wants_sync: bool) -> bool:
    """All-reduce "this rank will synchronise its coming backward": joined ranks learn whether
    to shadow the bucket all-reduces (not for a no_sync or no-grad forward)."""
    flag = torch.tensor([1 if wants_sync else 0], dtype=torch.int32)  # (1,)
    reducer.collectives.all_reduce(flag, group=reducer.group)
    return bool(flag.item())


def common_rank(reducer: Reducer, candidate: bool) -> int:
    """The highest global rank among candidates: under join, buffers are broadcast from a rank
    still training (rank 0 may have joined with stale buffers); at the end, the last joiner."""
    rank = torch.tensor([dist.get_rank() if candidate else -1], dtype=torch.int64)  # (1,)
    reducer.collectives.all_reduce(rank, op=ReduceOp.MAX, group=reducer.group)
    return int(rank.item())


def broadcast_buffers_from_trainer(
    reducer: Reducer, module: nn.Module, ignored: frozenset[str], training: bool
) -> None:
    """The pre-forward buffer broadcast under a Join context, from a rank still training."""
    buffers = synced_buffers(module, ignored)
    if buffers:
        broadcast_coalesced(buffers, reducer.collectives, reducer.group, common_rank(reducer, training))


def shadow_iteration(reducer: Reducer, module: nn.Module, ignored: frozenset[str], broadcast_buffers: bool) -> None:
    """Issue, with zeros, every collective one forward+backward of a non-joined rank issues."""
    if reducer.world_size == 1:
        return
    reducer.begin_timeline()
    if reducer.rebuild_due:
        reducer.rebuild_buckets()
    if broadcast_buffers:
        broadcast_buffers_from_trainer(reducer, module, ignored, training=False)
    if not global_requires_sync(reducer, False):
        return
    reducer.reset()
    works = []
    for bucket in reducer.buckets:  # zero stand-ins: the real buffers may be the .grad views
        stand_in = Bucket(bucket.index, bucket.params, bucket.param_indices, bucket.buffer.dtype, bucket.sparse)
        reducer.launch(stand_in)
        works.append(stand_in.handle)
    for work in works:
        work.wait()
    reducer.global_use_counts(active=False)
    reducer.after_sync_iteration(use_counts=None, shadowed=True)


def sync_final_model(
    reducer: Reducer, module: nn.Module, ignored: frozenset[str], broadcast_buffers: bool, is_last_joiner: bool
) -> None:
    """Broadcast the model from the last rank to join (ties: the highest rank), as torch does:
    the joined ranks stopped stepping, the last joiner holds the fully trained replica."""
    if reducer.world_size == 1:
        return
    src = common_rank(reducer, is_last_joiner)
    tensors = synced_parameters(module, ignored)
    if broadcast_buffers:
        tensors += synced_buffers(module, ignored)
    broadcast_coalesced(tensors, reducer.collectives, reducer.group, src)
