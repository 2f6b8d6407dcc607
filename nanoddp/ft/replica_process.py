"""How the fault-tolerant launcher starts a replica's process, and copies its output.

A replica (or the warm spare) whose command is `python -m MODULE ...`, as every launcher of ours
gives, is forked from the launcher's fork server, which imported MODULE once
(`nanoddp.fork_server`): a replica, and a replacement after a failure, starts in milliseconds, not
after two seconds of CPU spent importing torch beside the survivors. Any other command is
started as it is. Either way the process leads a session of its own (the launcher signals its
whole group), reads the launcher's standard input (the spare: a pipe the launcher writes its
assignment to), and every line it prints is copied to the launcher's with the holder's prefix.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from nanoddp import fork_server

ReplicaProcess = subprocess.Popen | fork_server.ForkedModule


def start_fork_server(command: Sequence[str]) -> None:
    """The launcher's fork server, with the replicas' module imported (a command that is not
    `python -m MODULE` needs none)."""
    module = fork_server.python_module(command)
    if module is not None:
        fork_server.start([module])


def start_process(command: Sequence[str], environ: dict[str, str], stdin_pipe: bool) -> ReplicaProcess:
    """`command` in a session of its own with exactly `environ`; stdout and stderr piped, stdin
    piped with `stdin_pipe`, else the launcher's."""
    module = fork_server.python_module(command)
    if module is not None:
        return fork_server.ForkedModule(module, command[3:], environ, stdin_pipe)
    stdin = subprocess.PIPE if stdin_pipe else None
    return subprocess.Popen(
        list(command), env=environ, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip


def copy_output(proc: ReplicaProcess, prefix: list[str]) -> list[threading.Thread]:
    """Threads copying `proc`'s stdout and stderr to ours, each line prefixed with `prefix[0]`
    (read at each line: a spare's changes when it becomes a replica)."""
    copiers = [
        threading.Thread(target=_copy_prefixed, args=(stream, out, prefix), daemon=True)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    for copier in copiers:
        copier.start()
    return copiers


def _copy_prefixed(stream: IO[bytes], out: IO[str], prefix: list[str]) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix[0] + line.decode(errors="replace"))
        out.flush()
    stream.close()
