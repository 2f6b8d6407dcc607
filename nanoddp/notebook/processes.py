"""The notebook pool's process plumbing: start a worker, stop one, and hold SIGINT while the
kernel waits on its workers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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


def spawn_worker(settings: dict[str, Any]) -> subprocess.Popen:
    """`python -m nanoddp.notebook.worker` in its own session, settings (and key) on stdin."""
    process = subprocess.Popen(
        [sys.executable, "-m", "nanoddp.notebook.worker"],
        stdin=subprocess.PIPE,
        start_new_session=True,  # the kernel's SIGINT to its process group must not hit us
    )
    process.stdin.write(json.dumps(settings).encode())
    process.stdin.close()
    return process


def terminate(process: subprocess.Popen, grace_s: float = 2.0) -> None:
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
