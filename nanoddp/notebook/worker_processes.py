"""The notebook pool's process plumbing: the kernel's handle on a worker, starting and stopping
one, and holding SIGINT while the kernel waits on its workers."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from nanoddp.fork_server import ForkedModule
from nanoddp.notebook.handshake import PoolError


@dataclass
class WorkerHandle:
    """The kernel's view of one worker process."""

    rank: int
    process: ForkedModule
    conn: Connection | None = None
    device: str = "?"
    busy: bool = False  # the kernel's protocol view (a request is out); %dist_status asks the worker
    generation: int = 1  # of its default process group, as confirmed by its last rebuild
    death: str | None = None  # why it is dead, once it is

    @property
    def connection(self) -> Connection:
        """`conn`, once the worker has connected (every worker of a started pool has)."""
        if self.conn is None:
            raise PoolError(f"worker rank {self.rank} has not connected")
        return self.conn

    @property
    def alive(self) -> bool:
        if self.death is None and self.process.poll() is not None:
            self.death = f"exited with code {self.process.returncode}"
        return self.death is None


class SigintFlag:
    """Counts SIGINTs while installed (main thread only), instead of raising KeyboardInterrupt.

    A KeyboardInterrupt raised in the middle of `Connection.recv` would tear a message; with
    this handler the wait loop notices the interrupt between messages and forwards it.
    """

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1


@contextmanager
def catch_sigint() -> Iterator[SigintFlag]:
    flag = SigintFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals only reach the main thread; nothing to catch here
        return
    previous = signal.signal(signal.SIGINT, flag)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


WORKER_MODULE = "nanoddp.notebook.worker"


def start_worker(settings: dict[str, Any]) -> ForkedModule:
    """`python -m nanoddp.notebook.worker`, forked from the kernel's fork server: a fresh
    interpreter started at the first pool's start, that imported torch and the worker once, so no
    worker of this or a later pool imports torch itself. In a session of its own (the kernel's
    SIGINT to its process group must not hit it), dying with the kernel, its settings (and key)
    on stdin, writing where the kernel writes."""
    process = ForkedModule(WORKER_MODULE, [], dict(os.environ), stdin_pipe=True, output_pipes=False)
    assert process.stdin is not None  # stdin_pipe
    process.stdin.write(json.dumps(settings).encode())
    process.stdin.close()
    return process
