"""A replica group of several processes: its members, their store, and how they end together.

With `--group-size G` (under `--on-failure continue`) one replica of the run is G processes: an
HSDP replica sharded over them, or DDP/ZeRO inside them, replicated across the replica groups.
The launcher starts and replaces the replica as one process (`nanoddp.ft.supervisor`: its
replica, its session, its step marks), and that process, group rank 0, forks the other G-1
members here, before it builds anything (one import of torch, no thread yet). So the unit the
launcher supervises, the quorum counts and torchft heals is the group, as torchrun's agent
supervises a node's workers: a member that fails takes its whole group down (`_watch`), and the
launcher's replacement is a new group of G joiners, each healed live from the member of a peer
group that holds the same shard (torchft's Manager: rank g heals from rank g).

Why the group fails whole: its members' collectives (FSDP's all-gathers, DDP's buckets) wait on
each other, so a group missing a member can do no step; and a member started alone would find its
group's default process group gone. Ending the rest at once lets the others' quorum leave the
group out at the next step, not after the collective timeout.

The members meet on a TCPStore that rank 0 serves on the replica's own address (loopback on one
node, the host's address across hosts): its port reaches each member through a pipe made before
the fork, so nothing is written to disk and nothing listens elsewhere. The same store holds the
group's default process group (a prefix of its own) and torchft's Manager's address book.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from nanoddp.base.processes import die_with_launcher, name_this_process
from nanoddp.env import bound_store
from nanoddp.ft.replica_env import PROCESS_NAME, ReplicaEnv
from nanoddp.ft.stopped import STOPPED_EXIT_CODE

MEMBER_FAILED_EXIT_CODE = 1  # rank 0's exit when another member failed: the launcher replaces the group
_kept: dict[str, dist.TCPStore] = {}  # this process's store (rank 0: the server, kept alive for the group)
_watchers: list[threading.Thread] = []  # rank 0's, one per other member


def start_members(env: ReplicaEnv, group_size: int) -> ReplicaEnv:
    """Become the replica group of `group_size` processes: rank 0 (this process) forks ranks
    1..G-1 and returns its own `env` with `group_rank` 0; each fork returns with its own rank.
    Call first in a replica's process, before any thread or process group exists. G = 1: `env`."""
    if group_size == 1:
        return env
    leader = os.getpid()
    pipes = [os.pipe() for _ in range(group_size - 1)]
    members: dict[int, int] = {}
    for rank in range(1, group_size):
        pid = os.fork()
        if pid == 0:
            return _become_member(env, group_size, rank, pipes, leader)
        members[pid] = rank
    timeout = timedelta(seconds=env.timeout_s)
    store = bound_store(env.address, 0, rank=0, world_size=group_size, timeout=timeout)
    _kept["store"] = store
    for read_end, write_end in pipes:
        os.close(read_end)
        os.write(write_end, f"{store.port}\n".encode())
        os.close(write_end)
    for pid, rank in members.items():
        _watchers.append(threading.Thread(target=_watch, args=(pid, rank, env), daemon=True, name=f"member-{rank}"))
        _watchers[-1].start()
    return dataclasses.replace(env, group_rank=0, group_size=group_size, store_port=store.port)


def _become_member(
    env: ReplicaEnv, group_size: int, rank: int, pipes: list[tuple[int, int]], leader: int
) -> ReplicaEnv:
    """In a fork: member `rank` of the group led by `leader` (rank 0), which it dies with."""
    die_with_launcher(leader)
    name_this_process(f"{PROCESS_NAME}{env.replica}.{env.attempt}m{rank}")  # not a replica's name
    read_end = pipes[rank - 1][0]
    for index, (other_read, write_end) in enumerate(pipes):
        os.close(write_end)
        if index != rank - 1:
            os.close(other_read)
    with os.fdopen(read_end) as pipe:
        line = pipe.readline().strip()
    if not line:  # rank 0 died before serving the store: nothing to join
        os._exit(MEMBER_FAILED_EXIT_CODE)
    return dataclasses.replace(env, group_rank=rank, group_size=group_size, store_port=int(line))


def _watch(pid: int, rank: int, env: ReplicaEnv) -> None:
    """Rank 0's watch over member `rank`: a member that ends other than by finishing (0), by the
    run's stop (which every member reaches with rank 0) or by the launcher's SIGTERM (sent to the
    whole group, rank 0 included: no line for that) takes the group down."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code in (0, STOPPED_EXIT_CODE, -signal.SIGTERM):
        return
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    print(
        f"{env.who}: its group's rank {rank} failed ({how}): the group's processes end together "
        "and the launcher replaces the group",
        file=sys.stderr,
        flush=True,
    )
    os._exit(MEMBER_FAILED_EXIT_CODE)


def group_store(env: ReplicaEnv) -> dist.TCPStore:
    """The replica group's store (G > 1): rank 0's server, made by `start_members`, or a client of it."""
    if "store" not in _kept:
        timeout = timedelta(seconds=env.timeout_s)
        _kept["store"] = bound_store(env.address, env.store_port, env.group_rank, env.group_size, timeout)
    return _kept["store"]


def wait_for_members(timeout_s: float) -> None:
    """Rank 0, at its end: give the other members `timeout_s` to end too (they reach the end with
    it); those still running then die with it."""
    deadline = time.monotonic() + timeout_s
    for watcher in _watchers:
        watcher.join(timeout=max(0.0, deadline - time.monotonic()))
