"""The notebook pool's socket: who may connect during startup, and its temp dir's lifetime.

The workers reach the kernel over a Unix socket in a private temp dir, authenticated with a
random key. Two things must not depend on the peer behaving: a connection that never answers
the challenge must not stall startup for everyone behind it, and a kernel killed before its
cleanup must not leave its dir behind forever.
"""

from __future__ import annotations

import getpass
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
from contextlib import suppress
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # a connection must authenticate and say hello within this
DIR_PREFIX = "nanoddp-nb-"


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


def remove_stale_dirs() -> None:
    """Remove socket dirs left by notebook kernels that were killed (their pid is gone)."""
    for path in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        pid = path.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)) and path.owner() == getpass.getuser():
            shutil.rmtree(path, ignore_errors=True)
