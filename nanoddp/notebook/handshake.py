"""The notebook pool's startup: who may connect, the workers' hellos, and its temp dir's lifetime.

The workers reach the kernel over a Unix socket in a private temp dir, authenticated with a
random key. Two things must not depend on the peer behaving: a connection that never answers
the challenge must not stall startup for everyone behind it, and a kernel killed before its
cleanup must not leave its dir behind forever.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from multiprocessing import AuthenticationError  # what multiprocessing.connection raises (the same class)
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
    wait,
)
from typing import cast

from nanoddp import tempdirs

logger = logging.getLogger(__name__)

POLL_S = 0.1
HANDSHAKE_TIMEOUT_S = 5.0  # a connection must authenticate and say hello within this
DIR_PREFIX = "nanoddp-nb-"


class PoolError(RuntimeError):
    """The pool cannot do what was asked (not started, a worker is dead, startup failed)."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows a one-line error, not our stack frames."""
        return [f"PoolError: {self}"]


def wait_connections(conns: Iterable[Connection], timeout: float) -> list[Connection]:
    """`multiprocessing.connection.wait` on connections: the ones ready to read (or at EOF).

    It returns some of the objects it was given, so only connections here; its stub widens
    its result to every kind of object it accepts (sockets, file descriptors)."""
    return cast("list[Connection]", wait(list(conns), timeout=timeout))


def authenticate(conn: Connection, authkey: bytes, accepted: queue.Queue) -> None:
    """The handshake `Listener(authkey=...)` does, plus the worker's hello, within a deadline.

    A connection that fails authentication, or sends nothing for HANDSHAKE_TIMEOUT_S (a local
    process poking at the socket), is hung up on and ignored; startup keeps waiting for the
    workers. Hanging up is a socket shutdown, which wakes the blocked read on this thread."""

    def hang_up() -> None:
        with suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(HANDSHAKE_TIMEOUT_S, hang_up)
    timer.start()
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        hello = conn.recv()
        if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello"):
            raise AuthenticationError(f"unexpected first message {hello!r:.80}")
    except (AuthenticationError, EOFError, OSError, ValueError) as exc:
        logger.warning("ignored a connection to the notebook socket: %s", exc or type(exc).__name__)
        conn.close()
        return
    finally:
        timer.cancel()
    accepted.put((conn, hello))


SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path on Linux (sun_path holds 108, NUL included)
SHORT_TEMP = "/tmp"


def socket_dir_parent() -> str:
    """Where the private socket dir goes: the temp dir, unless a socket path in it would be too
    long for a Unix socket (a deep TMPDIR), then /tmp; if neither will do, say how to fix it."""
    for parent in dict.fromkeys([tempfile.gettempdir(), SHORT_TEMP]):
        longest = os.path.join(parent, f"{DIR_PREFIX}{os.getpid()}-{'x' * 8}", "sock")  # mkdtemp adds 8
        if len(os.fsencode(longest)) <= SOCKET_PATH_MAX and os.access(parent, os.W_OK):
            return parent
    raise PoolError(
        f"the temp dir {tempfile.gettempdir()!r} is too long for a Unix socket path ({SOCKET_PATH_MAX} bytes) "
        f"and {SHORT_TEMP} is not writable; set TMPDIR to a short writable directory"
    )


def remove_stale_dirs() -> None:
    """Remove socket dirs left by notebook kernels that were killed (their pid is gone)."""
    for parent in dict.fromkeys([tempfile.gettempdir(), SHORT_TEMP]):
        tempdirs.remove_stale_dirs(DIR_PREFIX, parent)


def accept_workers(listener: Listener, address: str, authkey: bytes, workers: list, deadline: float) -> None:
    """Accept one authenticated connection per worker, noticing workers that die first."""
    accepted: queue.Queue = queue.Queue()
    stop = threading.Event()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()
            except OSError as exc:  # the listener closed under us
                accepted.put(exc)
                return
            if stop.is_set():  # the wake-up below, or a latecomer: every worker is in, so no handshake
                conn.close()
                return
            threading.Thread(target=authenticate, args=(conn, authkey, accepted), daemon=True).start()

    thread = threading.Thread(target=accept_loop, name="nanoddp-accept", daemon=True)
    thread.start()
    try:
        pending = set(range(len(workers)))
        while pending:
            check_started(workers, pending, deadline)
            try:
                conn = accepted.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(conn, Exception):
                raise PoolError(f"a worker failed to connect: {conn}")
            conn, (_, rank, pid) = conn  # ("hello", rank, pid), authenticated
            if rank not in pending or pid != workers[rank].process.pid:
                conn.close()  # not one of the workers we are waiting for
                continue
            workers[rank].conn = conn
            pending.discard(rank)
    finally:
        stop.set()
        if thread.is_alive():  # wake the blocked accept() so the thread can end
            with suppress(OSError):
                Client(address, family="AF_UNIX").close()
            thread.join(timeout=5.0)
        listener.close()  # every worker is in: stop listening at once


def check_started(workers: list, pending: set[int], deadline: float) -> None:
    for rank in pending:
        worker = workers[rank]
        if not worker.alive:
            raise PoolError(f"worker rank {rank} {worker.death} before connecting")
    if time.monotonic() > deadline:
        raise PoolError(f"workers {sorted(pending)} did not start in time")


def wait_ready(workers: list, deadline: float) -> None:
    """Wait for every rank's "ready" (process group joined) or its startup traceback."""
    pending = set(range(len(workers)))
    while pending:
        conns = {workers[r].conn: r for r in pending}
        for conn in wait_connections(conns, POLL_S):
            rank = conns[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                raise PoolError(f"worker rank {rank} died while joining the process group") from None
            if kind == "fatal":
                raise PoolError(f"worker rank {rank} failed to start:\n{payload}")
            workers[rank].device = payload["device"]
            pending.discard(rank)
        check_started(workers, pending, deadline)
