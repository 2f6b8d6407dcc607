"""DistEnv parsing, seeding and subgroups."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import env as nd
from nanoddp import groups

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_RUN_ID": "job",
}


def test_from_environ_reads_torchrun_layout():
    env = nd.DistEnv.from_environ(TORCHRUN_ENV, backend="gloo")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (3, 1, 4, 2, 1)
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.1", 29400, 2)
    assert env.device == torch.device("cpu") and env.backend == "gloo"
    assert env.torchrun and not env.is_master


def test_from_environ_without_vars_is_single_process():
    env = nd.DistEnv.from_environ({}, backend="gloo")
    assert (env.rank, env.world_size, env.is_master, env.torchrun) == (0, 1, True, False)


def test_nccl_backend_maps_local_rank_to_gpu():
    env = nd.DistEnv.from_environ(TORCHRUN_ENV, backend="nccl")
    assert env.device == torch.device("cuda", 1)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"WORLD_SIZE": None}, "RANK set but WORLD_SIZE missing"),
        ({"RANK": None}, "WORLD_SIZE set but RANK missing"),
        ({"RANK": "two"}, "RANK must be an integer, got 'two'"),
        ({"WORLD_SIZE": "-1"}, "WORLD_SIZE must be >= 0, got -1"),
        ({"RANK": "4"}, "rank must be in [0, 4), got 4"),
        ({"LOCAL_RANK": "2"}, "local_rank must be in [0, local_world_size=2), got 2"),
        ({"MASTER_PORT": None}, "MASTER_PORT not set"),
        ({"MASTER_ADDR": None, "MASTER_PORT": None}, "MASTER_ADDR, MASTER_PORT not set"),
    ],
)
def test_from_environ_rejects_bad_env(changes, message):
    environ = dict(TORCHRUN_ENV)
    for key, value in changes.items():
        if value is None:
            environ.pop(key)
        else:
            environ[key] = value
    with pytest.raises(ValueError) as info:
        nd.DistEnv.from_environ(environ, backend="gloo")
    assert message in str(info.value)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'tcp'"):
        nd.DistEnv.from_environ({}, backend="tcp")


def _draw_all_rngs() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_seed_everything_is_reproducible_and_per_rank():
    nd.seed_everything(7, rank=0)
    first = _draw_all_rngs()
    nd.seed_everything(7, rank=0)
    again = _draw_all_rngs()
    nd.seed_everything(7, rank=1)
    other_rank = _draw_all_rngs()
    used = nd.seed_everything(7, rank=1, same_across_ranks=True)
    shared = _draw_all_rngs()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    assert first[0] != other_rank[0] and first[1] != other_rank[1]
    assert not torch.equal(first[2], other_rank[2])
    assert used == 7 and shared[:2] == first[:2] and torch.equal(shared[2], first[2])


def _subgroup_sums(env):
    even = groups.even_ranks_group()
    parity = groups.subgroups_by(lambda r: r % 2)
    alone = groups.new_group([2])
    value = torch.tensor([float(env.rank + 1)])
    even_sum = None
    if even is not None:
        t = value.clone()
        dist.all_reduce(t, group=even)
        even_sum = t.item()
    t = value.clone()
    dist.all_reduce(t, group=parity)
    parity_sum = t.item()
    alone_sum = None
    if alone is not None:
        t = value.clone()
        dist.all_reduce(t, group=alone)
        alone_sum = t.item()
    return even_sum, parity_sum, alone_sum, groups.group_ranks(parity)


def test_subgroups_reduce_only_their_members():
    results = run_on_ranks(_subgroup_sums, 4)
    # values are rank+1: even ranks {0,2} -> 1+3, odd ranks {1,3} -> 2+4
    assert [r[0] for r in results] == [4.0, None, 4.0, None]
    assert [r[1] for r in results] == [4.0, 6.0, 4.0, 6.0]
    assert [r[2] for r in results] == [None, None, 3.0, None]
    assert [r[3] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _bad_new_group(env):
    with pytest.raises(ValueError, match=r"ranks \[5\] are outside the world \[0, 2\)"):
        groups.new_group([0, 5])
    with pytest.raises(ValueError, match="at least one rank"):
        groups.new_group([])
    return True


def test_new_group_rejects_bad_ranks_on_every_rank():
    assert run_on_ranks(_bad_new_group, 2) == [True, True]


def test_cleanup_is_safe_twice_and_without_init(monkeypatch):
    # init pins gloo to loopback in this process's environment; undone after the test, so that the
    # suite's later children (the namespace hosts) do not inherit it
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", nd.loopback_interface())
    nd.cleanup()
    env = nd.init(nd.DistEnv.single_process("gloo"))
    assert dist.is_initialized() and dist.get_world_size() == env.world_size == 1
    nd.cleanup()
    nd.cleanup()
    assert not dist.is_initialized()
