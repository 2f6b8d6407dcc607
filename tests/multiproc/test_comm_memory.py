"""Nothing a collective sent outlives it: once the caller drops its tensors, their memory is freed.

Bulk paths hand their sends to a background thread (`transport.post_send`). That thread used to
keep the last message it posted in a loop variable while it waited for the next one, and with it
the whole storage the message was a view of: after `shard_model`'s start-up broadcast, rank 0 (the
root, the only sender) held a second copy of the model for the rest of the run, 13 MB of a 14 MB
GPT in `bench train`. Each case here runs one bulk collective, drops the tensors and checks, with
torch's own storage weak reference, that their storage is gone.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import run_on_ranks
from torch.multiprocessing.reductions import StorageWeakRef

from nanoddp import comm
from nanoddp.comm.plan import plan

NUMEL = 2**20 + 3  # float32, 4 MB + 12 bytes: past the frames, so the bulk paths and their pieces run


def _freed_after_each_collective(env) -> list[str]:
    r, n = env.rank, env.world_size
    share = NUMEL // n
    cases = {
        "broadcast from rank 0": lambda x: comm.broadcast(x, src=0),
        "broadcast from the last rank": lambda x: comm.broadcast(x, src=n - 1),
        "all_reduce": lambda x: comm.all_reduce(x),
        "all_gather_into_tensor": lambda x: comm.all_gather_into_tensor(torch.empty(n * x.numel()), x),
        "reduce_scatter_tensor": lambda x: comm.reduce_scatter_tensor(torch.empty(share), x[: share * n]),
    }
    assert plan.plan("broadcast", NUMEL * 4, n, "gloo") not in (plan.Path.PAIR, plan.Path.STAR, plan.Path.IN_FRAMES)
    kept = []
    for name, run in cases.items():
        x = torch.full((NUMEL,), float(r + 1))
        run(x)
        storage = StorageWeakRef(x.untyped_storage())
        del x
        gc.collect()
        if not storage.expired():
            kept.append(name)
    comm.barrier()  # every rank's sends are done before any rank's process ends
    return kept


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_tensor_outlives_its_collective(world_size):
    kept = run_on_ranks(_freed_after_each_collective, world_size, timeout=180)
    assert kept == [[] for _ in range(world_size)], f"storages still alive after their collective, by rank: {kept}"
