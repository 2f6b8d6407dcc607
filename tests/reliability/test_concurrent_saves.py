"""Two jobs saving sharded state to one path: the second writer is refused, nobody's files vanish.

Each sharded save removes the shard files of its path that its new manifest does not list (the
replaced manifest's, a killed save's). Without a lock, two jobs saving to one path removed each
other's fresh shard files and both reported success for checkpoints that no longer loaded. Here
"the other job" is a lock holder with shard files of its own, made by rank 0 in the same
process (a second open file description's `flock` conflicts like another process's does).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import run_on_ranks

import nanoddp
from nanoddp.env import DistEnv

OTHER_JOB_FILES = ("state.pt.beef0000.rank0-of-2", "state.pt.beef0000.rank1-of-2")
KILLED_SAVE_FILES = ("state.pt.dead0000.rank1-of-2", ".state.pt.dead0000.rank0-of-2.tmp-999999999-0123abcd")


def _zero1(seed: int) -> tuple[nn.Module, nanoddp.ZeroRedundancyOptimizer]:
    torch.manual_seed(seed)
    net = nn.Linear(6, 4)
    optimizer = nanoddp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    net(torch.randn(3, 6)).square().mean().backward()
    optimizer.step()
    return net, optimizer


def _saved_state(path: Path) -> dict[str, torch.Tensor]:
    """What `path` holds, loaded into fresh objects: the model and this rank's optimizer shard."""
    net, optimizer = _zero1(seed=99)  # other values: the load must overwrite them all
    nanoddp.load_state(path, model=net, optimizer=optimizer)
    state = optimizer.sharded_state_dict()["state"]
    optim = {f"{i} {k}": v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}
    return {**{k: v.clone() for k, v in net.state_dict().items()}, **optim}


def _worker(env: DistEnv, tmp: str) -> dict:
    directory = Path(tmp)
    target = directory / "state.pt"
    net, optimizer = _zero1(seed=0)
    nanoddp.save_state(target, model=net, optimizer=optimizer)
    first = _saved_state(target)
    other_lock = None
    if env.rank == 0:  # the other job, mid-save: its lock held, its fresh shard files written
        for name in OTHER_JOB_FILES:
            (directory / name).write_bytes(b"the other job's shard")
        other_lock = os.open(directory / ".state.pt.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(other_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    torch.distributed.barrier()
    net.weight.data.add_(1.0)  # a second save would change what state.pt holds
    try:
        nanoddp.save_state(target, model=net, optimizer=optimizer)
        refusal = None
    except Exception as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    torch.distributed.barrier()
    others_intact = all(
        (directory / name).is_file() and (directory / name).read_bytes() == b"the other job's shard"
        for name in OTHER_JOB_FILES
    )
    still = _saved_state(target)
    torch.distributed.barrier()
    if env.rank == 0:  # the other job ends (its files are left unlisted); a killed save left two
        assert other_lock is not None
        os.close(other_lock)
        for name in KILLED_SAVE_FILES:
            (directory / name).write_bytes(b"left by a SIGKILLed save")
    torch.distributed.barrier()
    nanoddp.save_state(target, model=net, optimizer=optimizer)
    after = sorted(p.name for p in directory.iterdir())
    return {"refusal": refusal, "others_intact": others_intact, "first": first, "still": still, "after": after}


@pytest.mark.timeout(180)
def test_a_second_sharded_writer_is_refused_and_leftovers_go_with_the_next_save(tmp_path):
    got = run_on_ranks(_worker, 2, str(tmp_path), timeout=150)
    refusals = [r["refusal"] for r in got]
    assert refusals[0] == refusals[1], refusals  # the same error on every rank
    assert refusals[0] is not None
    assert refusals[0].startswith(f"SaveInProgress: another save to {tmp_path / 'state.pt'} is in progress (pid ")
    assert "wait for it, or save to another path" in refusals[0]
    for rank in got:
        assert rank["others_intact"], "the refused save removed the other job's shard files"
        for key, value in rank["first"].items():  # the refused save changed nothing on disk
            assert torch.equal(rank["still"][key], value), key
    shards = [name for name in got[0]["after"] if ".rank" in name]
    assert len(shards) == 2 and not set(shards) & set(OTHER_JOB_FILES + KILLED_SAVE_FILES), got[0]["after"]
    assert got[0]["after"] == sorted([".state.pt.lock", "state.pt", *shards])
