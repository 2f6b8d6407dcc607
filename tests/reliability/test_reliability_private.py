"""Private by default: a local rendezvous listens on loopback only, and the notebook's startup
cannot be stalled or broken by a local process poking at its socket.
(`nanoddp train`'s agent and workers: see test_torchrun's SIGKILL test, which checks them.)"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from nanoddp.notebook.pool import WorkerPool

LISTENING = """
import psutil, torch, nanoddp
nanoddp.init()  # one process, no MASTER_ADDR
torch.distributed.all_reduce(torch.ones(1))
print(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}))
nanoddp.cleanup()
"""


@pytest.mark.timeout(120)
def test_init_without_master_address_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", LISTENING], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['127.0.0.1']", proc.stdout  # the store (and gloo): nothing on *:port


def _connect_when_listening(pattern: str, stop: threading.Event) -> socket.socket | None:
    """A connection to the pool's socket as soon as it listens. The file exists from bind(), a
    moment before listen(): a connect in between is refused (a CI run failed on it), so retry."""
    while not stop.is_set():
        found = glob.glob(pattern)
        if found:
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(found[0])
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
        time.sleep(0.005)
    return None


def _intrude(stop: threading.Event, connections: list) -> None:
    """As soon as the pool's socket listens: one connection that never says a word, one that
    answers the challenge with garbage."""
    pattern = os.path.join(tempfile.gettempdir(), f"nanoddp-nb-{os.getpid()}-*", "sock")
    for payload in (None, b"\0\0\0\x04junk"):
        sock = _connect_when_listening(pattern, stop)
        if sock is None:
            return
        if payload:
            sock.sendall(payload)
        connections.append(sock)


@pytest.mark.timeout(240)
def test_notebook_startup_ignores_silent_and_unauthenticated_connections():
    stop, connections = threading.Event(), []
    intruder = threading.Thread(target=_intrude, args=(stop, connections), daemon=True)
    intruder.start()
    pool = WorkerPool(2, "gloo", ["cpu", "cpu"], num_threads=1, pg_timeout_s=60)
    try:
        pool.start(timeout_s=120)  # before: blocked behind the silent one, or PoolError on the bad one
        assert len(connections) == 2, "the intruder never found the socket"
        assert [w.alive for w in pool.workers] == [True, True]
        assert all(w.conn is not None for w in pool.workers)
    finally:
        stop.set()
        pool.shutdown()
        for sock in connections:
            sock.close()
