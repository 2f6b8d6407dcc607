"""The worker's side of recovering a notebook pool after a collective was interrupted.

Why a rebuild: SIGINT lands in a worker's main thread between bytecodes, so a rank can leave a
collective half-way (receives still posted, a peer mid-message) or stay blocked inside one, in
C++, waiting for a peer that already left. Either way the group's connections now hold
messages nobody will pair correctly, and the next collective hangs or reads stale bytes.
Nothing in that group can be trusted again, so the pool abandons it:

1. abort (`abort_collectives`, run on the `Inbox` thread so it works while the main thread is
   blocked): shut down this worker's TCP connections to the other workers. gloo wakes up on
   both ends with "connection closed", so every pending send, receive or collective fails at
   once, on every rank, whether or not something else still holds the group. (gloo's own
   `abort()`/`shutdown()` do not wake a blocked wait, as of torch 2.13.)
2. rebuild (`rebuild_group`, on the main thread once the cell has ended): destroy the default
   group, drop nanoddp's per-group state, and join a fresh group through a new rendezvous file,
   so no key or byte of the old generation can be read.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import psutil

logger = logging.getLogger(__name__)

# Frames from these paths in an interrupted cell's traceback mean it stopped inside communication.
COMM_PATHS = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}nanoddp{os.sep}comm{os.sep}",
              f"{os.sep}nanoddp{os.sep}parallel{os.sep}")  # fmt: skip


def peer_sockets(peer_pids: Iterable[int]) -> list[int]:
    """File descriptors of this process's TCP connections to the other workers.

    These are the process groups' connections (the default group's, subgroups', p2p): a
    connection counts when its far end is a socket another worker of the pool owns. Anything
    else this process has open (a download, a Jupyter client) is left alone."""
    me = os.getpid()
    peer_ends: set[tuple[str, int]] = set()  # (ip, port) of the peers' own ends
    for pid in set(peer_pids) - {me}:
        with suppress(psutil.Error):
            peer_ends.update(c.laddr for c in _tcp_connections(psutil.Process(pid)) if c.raddr)
    return [c.fd for c in _tcp_connections(psutil.Process(me)) if c.raddr and c.raddr in peer_ends]


def _tcp_connections(process: psutil.Process) -> list:
    """`net_connections` (psutil >= 6) or its older name, `connections` (pyproject allows 5.9)."""
    method = getattr(process, "net_connections", None) or process.connections
    return method("tcp")


def abort_collectives(peer_pids: Iterable[int], backend: str) -> int:
    """Make every in-flight collective of this rank fail now; returns how many sockets were shut.

    Safe from any thread: a socket shutdown (on a dup of the fd, so gloo still owns and closes
    the original) wakes gloo's I/O loop, which fails the pending operations of that pair."""
    shut = 0
    for fd in peer_sockets(peer_pids):
        with suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
    if backend == "nccl":  # nccl's abort does wake its waits (untested here: no GPU in CI)
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not None:
            with suppress(Exception):
                group.abort()
    logger.debug("aborted collectives: %d peer sockets shut down", shut)
    return shut


def comm_in_flight(exc: BaseException | None) -> bool:
    """True when a failed cell may have left communication half-done on this rank: its exception
    came out of torch.distributed / nanoddp code, or nanoddp still has collectives pending."""
    from nanoddp.comm.transport.runner import pending_work

    if pending_work():
        return True
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if any(part in tb.tb_frame.f_code.co_filename for part in COMM_PATHS):
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


def rebuild_group(env: Any, init_method: str, timeout_s: float, peer_pids: Iterable[int]) -> None:
    """Leave the (aborted) default group and join a fresh one at `init_method`.

    nanoddp's per-group state goes too: the collective runners (their threads finish, failing,
    on the old group) and the hang watchdog's sequence numbers, restarted on the new group's
    store with the same settings. Objects holding the old group itself (a subgroup, torch's
    DDP) stay bound to it and must be created again; nanoddp's DDP on the default group looks
    the group up at each call, so it goes on working."""
    import torch.distributed as dist

    from nanoddp import env as nd
    from nanoddp.comm.transport import runner, watchdog

    abort_collectives(peer_pids, env.backend)  # again: connections made since the first abort
    active = watchdog.active()
    settings = None if active is None else (active.timeout_s, active.poll_s, active.exit_on_hang)
    watchdog.disable()
    if dist.is_initialized():
        dist.destroy_process_group()
    runner.forget_groups()
    nd.init(env, init_method=init_method, timeout=timedelta(seconds=timeout_s))
    if settings is not None:
        watchdog.enable(settings[0], poll_s=settings[1], exit_on_hang=settings[2])


class Inbox:
    """Reads the kernel connection on its own thread, so control messages act at once.

    "abort" (shut the peer connections) and "status" (answer from this thread) must work while
    the main thread is blocked in a collective; everything else is queued for the main thread.
    `get()` returns None once the kernel has gone away."""

    def __init__(self, conn: Connection, on_abort: Callable[[list[int]], None], on_status: Callable[[], None]) -> None:
        self._conn = conn
        self._on_abort = on_abort
        self._on_status = on_status
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name="nanoddp-inbox", daemon=True)

    def start(self) -> Inbox:
        self._thread.start()
        return self

    def get(self) -> tuple | None:
        return self._queue.get()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._queue.put(None)
                return
            try:
                if message[0] == "abort":
                    self._on_abort(message[1])
                elif message[0] == "status":
                    self._on_status()
                else:
                    self._queue.put(message)
            except Exception:  # a failed control action must not stop the worker from serving
                logger.exception("control message %r failed", message[0])
