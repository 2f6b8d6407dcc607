"""One subprocess of a probe, watched: its output collected, every descendant recorded.

torchrun's workers run in sessions of their own, so killing the launcher's session is not
enough to leave nothing behind; recording each descendant while the run lasts lets a probe
count the workers it started and kill every one of them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

import psutil

from nanoddp.train.launcher.agent import WORKER_NAME


class Watched:
    """A subprocess in its own session: stdout and stderr collected in the background, and every
    descendant recorded (with its latest command line) while it runs."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.argv = argv
        self.started = time.monotonic()
        self.ended: float | None = None
        self.timed_out = False
        self.seen: dict[int, tuple[psutil.Process, str]] = {}
        self._out: list[str] = []
        self._err: list[str] = []
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self._err), daemon=True),
        ]
        for thread in [*self._readers, threading.Thread(target=self._watch, daemon=True)]:
            thread.start()

    @staticmethod
    def _read(stream: IO[str], lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def _watch(self) -> None:
        while True:
            self.record()
            if self.popen.poll() is not None:
                self.ended = time.monotonic()
                return
            time.sleep(0.1)

    def record(self) -> None:
        """Add the current descendants to `seen` (refreshing their command lines)."""
        try:
            children = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            proc = self.seen.get(child.pid, (child, ""))[0]
            try:  # the name first: a forked worker's command line is its fork server's
                self.seen[child.pid] = (proc, f"{child.name()} {' '.join(child.cmdline())}")
            except psutil.Error:
                self.seen.setdefault(child.pid, (proc, "?"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def done(self) -> bool:
        return self.popen.poll() is not None

    @property
    def rc(self) -> int | None:
        return self.popen.returncode

    @property
    def out(self) -> str:
        return "".join(self._out)

    @property
    def err(self) -> str:
        return "".join(self._err)

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def descendants(self) -> list[psutil.Process]:
        return [proc for proc, _ in self.seen.values()]

    def workers(self) -> list[psutil.Process]:
        return [proc for proc, cmd in self.seen.values() if cmd.startswith(WORKER_NAME)]

    def wait(self, timeout: float) -> int | None:
        """Wait for the exit (killing everything on timeout) and for the output to be read."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
        self.ended = self.ended or time.monotonic()
        for reader in self._readers:
            reader.join(timeout=5)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the session (while its leader is unreaped its id cannot be reused) and every
        descendant seen (psutil checks each one's identity before sending)."""
        self.record()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        for proc in self.descendants():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
