"""torchft's Manager as both fault-tolerant step loops make it: `nanoddp.ft.FaultTolerant` and
the torchft-DDP loop `nanoddp bench restarts` compares it with (`nanoddp.bench.torchft_ddp`).

Each process of a replica group has a Manager of its rank in the group: one process per replica
by default (rank 0 of a group of one), G with `--group-size G`, whose rank 0's Manager alone talks
to the quorum service for the group. Its store is the group's, on the replica's address
(`ReplicaEnv.address`: loopback on one node, the host's own address across hosts); what differs
between the two loops (the process group, the state, whether a replica heals before the step) is
passed in.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.hosts import url_host

STARTUP_WAIT_S = 120.0  # the first step waits this long for every replica of the run to start


def torchft_modules() -> Any:
    """torchft, its Manager and its PGTransport imported (a clear error without the `ft` extra),
    with the warnings that say nothing about a run on gloo filtered out."""
    try:
        import torchft
        import torchft.checkpointing.pg_transport
        import torchft.manager
        import torchft.process_group
    except ImportError as exc:
        raise ImportError("fault tolerance needs torchft: pip install 'nanoddp[ft]' (torchft==0.2.0)") from exc
    logging.getLogger("torchft.manager").addFilter(_quiet_manager_log)
    # torchft's PGTransport reads a pickle through a read-only buffer and uses a deprecated pytree
    # check: two warnings per transfer that say nothing about this run.
    warnings.filterwarnings("ignore", module=r"torchft\.checkpointing\.pg_transport")
    return torchft


@contextlib.contextmanager
def _manager_server_bound_to(torchft: Any, address: str) -> Iterator[None]:
    """While the Manager is made, its server binds `address` instead of every interface.

    [Note: only the address the run was given] torchft's Manager starts its server on `[::]`
    with no way to ask otherwise; a run must accept connections only where it was told to listen
    (loopback on one node, as `nanoddp run` and `nanoddp train` do; the host's own address across
    hosts), so the constructor it calls gets that address instead, only while this replica's
    Manager is built."""
    original = torchft.manager.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = kwargs["bind"].rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"{url_host(address)}:{port}"})

    torchft.manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft.manager.ManagerServer = original


def _quiet_manager_log(record: logging.LogRecord) -> bool:
    """torchft's Manager log as a replica shows it. Its warning at every rebuild that nccl's
    flight recorder cannot be reset is noise on gloo: dropped. A group rebuild that failed (a peer
    in the quorum died: its store is gone) is logged with a traceback and the C++ frames in the
    message; the replica says what it means at the step boundary ("no group across the
    replicas"), so the log keeps the message's first line only."""
    message = record.getMessage()
    first = message.splitlines()[0] if message else ""
    if PG_CONFIGURE_FAILED in first:
        message = first
        record.msg, record.args, record.exc_info, record.exc_text = first, (), None, None
    return "flight recorder" not in message


PG_CONFIGURE_FAILED = "got exception in pg configure"  # torchft.manager's words


def make_manager(
    torchft: Any,
    env: ReplicaEnv,
    pg: Any,
    state: tuple[Callable[[], Any], Callable[[Any], None]],
    store_port: int,
    *,
    init_sync: bool,
    use_async_quorum: bool,
    device: torch.device,
) -> Any:
    """This replica's Manager over `pg`: `state` is the (take, put) pair a joiner's healing
    calls on its source and on itself, moved over `pg` by torchft's PGTransport; `init_sync`:
    every replica takes replica rank 0's weights at step 0; `use_async_quorum`: False heals a
    replica before the step (and rebuilds the group while no collective runs); `device`: where
    the healing's tensors travel from and land (the group's: a GPU under nccl)."""
    timeout = timedelta(seconds=env.timeout_s)
    transport = torchft.checkpointing.pg_transport.PGTransport(pg, timeout, device)
    with _manager_server_bound_to(torchft, env.address):
        return torchft.Manager(
            pg=pg,
            load_state_dict=state[1],
            state_dict=state[0],
            # the quorum service forms no group below env.min_replicas; the Manager refuses a commit
            # below it too, except under an asynchronous quorum, whose healing replicas sit out
            # their first step (the torchft-DDP loop's: its floor stays the quorum service's)
            min_replica_size=1 if use_async_quorum else env.min_replicas,
            use_async_quorum=use_async_quorum,
            timeout=timeout,
            # a replica group's request is sent once all its members asked; one may be a collective
            # timeout late (`FaultTolerant._vote_wait`)
            quorum_timeout=max(2 * timeout, timedelta(seconds=STARTUP_WAIT_S)),
            connect_timeout=timeout,
            rank=env.group_rank,  # its replica group's members: one Manager each, one quorum for them all
            world_size=env.group_size,
            store_addr=env.address,  # the group store listens there (`FaultTolerant`)
            hostname=url_host(env.address),  # the address its server gives the others: where it listens
            store_port=store_port,
            lighthouse_addr=env.lighthouse,
            replica_id=f"replica_{env.replica}",  # torchft numbers members by the trailing digits
            init_sync=init_sync,
            checkpoint_transport=transport,
        )
