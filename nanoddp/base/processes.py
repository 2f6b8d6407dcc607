"""The life of nanoddp's processes, written once: start a child with a deadline, stop one, and
become a worker that ends with its parent.

Every launcher here (`nanoddp.launch`, the agent's workers, `nanoddp run`, the fault-tolerant
supervisor, the notebook's pool, a benchmark's child runs) must leave nothing behind, however it
ends. Each used to carry its own copy of these steps with its own wait; one copy means one rule:

- stopping is SIGTERM, one grace period (`limits.STOP_GRACE_S`) to save and exit, then SIGKILL,
  of the process or of its whole process group, and every process is reaped (no zombie);
- a child with a deadline (`child_run`, `finish`) leads a session of its own, so the SIGKILLs a
  trial sends inside it never reach us, and its whole tree ends when the block is left;
- a worker asks Linux to SIGKILL it when its parent dies (`die_with_parent`), and leaves a guard
  over its process group that kills what it started once it is gone (`take_descendants_along`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import psutil

from nanoddp.base.limits import STOP_GRACE_S

POLL_S = 0.05

# --- becoming a worker -----------------------------------------------------------------------


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent (thread) dies (no-op elsewhere).

    With `parent_pid`, a parent that died before the request (the child was already re-parented)
    ends this process at once, closing the window between fork and prctl."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)


WATCHER_PREFIX = "nanoddp-die-with-"  # `die_with`'s thread: blocked in select, it holds no lock


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` ends, whichever process is our parent.

    `die_with_parent` follows the parent only. A rank forked from multiprocessing's fork server
    has the server as its parent, and the server lives as long as any of its children hold its
    liveness pipe, which each child does: the launcher's death would end neither. So such a rank
    watches the launcher itself: a pidfd (Linux >= 5.3) becomes readable when that process
    ends, and a daemon thread blocked on it (no polling, no cost meanwhile) kills this one. A
    launcher already gone ends this process at once."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(128 + signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux, or too old: the parent's death signal only
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"{WATCHER_PREFIX}{pid}", daemon=True).start()


def name_this_process(name: str) -> None:
    """Show this process as `name` (at most 15 bytes) in ps, top and psutil's name(), which
    otherwise show every rank as `python` (no-op off Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_name = 15
    libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]))


def named_descendants(root: psutil.Process, prefix: str) -> dict[str, psutil.Process]:
    """`root`'s live descendants whose name (`name_this_process`) starts with `prefix`, by the rest
    of the name: how a launcher's workers are found from outside, since a forked one's command line
    and environment, as the system shows them, are its fork server's."""
    found: dict[str, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):  # root gone: none
        for proc in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # exited while we looked
                name = proc.name()
                if name.startswith(prefix) and proc.status() != psutil.STATUS_ZOMBIE:
                    found[name[len(prefix) :]] = proc
    return found


def die_with_launcher(launcher_pid: int | None) -> bool:
    """End this rank when its launcher ends, whether the launcher started it itself or a fork
    server it started forked it; return True for a forked rank (its parent is the server).

    Started by the launcher: the parent's death signal (`die_with_parent`), with the window before
    the request closed. Forked by the server: the server's death signal and the launcher's pidfd
    (`die_with`), since the server outlives the launcher while any of its children live. A
    launcher gone before this call ends the rank at once either way (its pid is no parent, and
    `die_with` finds it gone). No launcher's pid (None): the parent's death signal alone."""
    if launcher_pid is None or os.getppid() == launcher_pid:
        die_with_parent(launcher_pid)
        return False
    die_with_parent()
    die_with(launcher_pid)
    return True


# The guard of `take_descendants_along`: a fresh interpreter (-I -S: nothing of the rank's
# environment is imported) in the rank's process group, which it kills once the rank is gone.
_GUARD_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_GUARD_IGNORED_NUMBERS = tuple(int(stop) for stop in _GUARD_IGNORES)
_GUARD = f"""# nanoddp: the guard of a rank's process group
import signal
for stop in {_GUARD_IGNORED_NUMBERS}:
    signal.signal(stop, signal.SIG_IGN)  # a stop sent to the whole group is the rank's to handle
import ctypes, os, sys, time
rank_pid = int(sys.argv[1])
def sweep(*_):
    os.killpg(0, signal.SIGKILL)  # the rank's group: every descendant still in it, and this guard
signal.signal(signal.SIGUSR1, sweep)
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGUSR1)  # PR_SET_PDEATHSIG: told as the rank dies
except OSError:
    pass
while os.getppid() == rank_pid:  # also closes the window before prctl, and covers non-Linux
    time.sleep(1.0)
sweep()
"""
_guards: dict[int, subprocess.Popen] = {}  # by the pid of the process it guards (one each)


def take_descendants_along(new_group: bool = False) -> None:
    """Kill this process's descendants as soon as it dies, however it dies (SIGKILL included).

    `die_with_parent` ends a rank with its launcher, but what the rank started (a subprocess, a
    data service) would live on. So the rank leads a process group of its own, which its
    children join by default, and a small guard process in that group kills the whole group
    when the rank is gone. A process already leading a session (torchrun starts each worker in
    one) is guarded as it is; with `new_group` the process first leaves its parent's group for a
    new one (launch's ranks). Anything else is left alone: its group may hold unrelated processes
    (a shell pipeline's). What leaves the group on purpose (setsid) is not followed."""
    if os.getpid() in _guards:
        return
    if new_group:
        os.setpgid(0, 0)
    elif os.getsid(0) != os.getpid():
        return
    # The guard starts with the stops blocked (a child inherits its thread's signal mask through
    # fork and exec) and ignores them first thing: a Ctrl-C sent to the group while the guard's
    # interpreter still starts would otherwise print its KeyboardInterrupt beside the rank's line.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _GUARD_IGNORES)
    try:
        _guards[os.getpid()] = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# --- stopping --------------------------------------------------------------------------------


class Polled(Protocol):
    """A child as subprocess.Popen shows one (also `nanoddp.fork_server.ForkedModule`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Stoppable = Polled | mp.process.BaseProcess


def _running(proc: Stoppable) -> bool:
    return proc.is_alive() if isinstance(proc, mp.process.BaseProcess) else proc.poll() is None


def _signal(proc: Stoppable, sig: signal.Signals, whole_group: bool) -> None:
    assert proc.pid is not None  # started
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if whole_group:
            os.killpg(proc.pid, sig)  # it leads its group (start_new_session, or a guarded rank)
        else:
            os.kill(proc.pid, sig)


def signal_group(proc: Stoppable, sig: signal.Signals) -> None:
    """Send `sig` to the process group `proc` leads (started with `start_new_session`): it and
    whatever it started; a group already gone is no error."""
    _signal(proc, sig, whole_group=True)


def stop(
    procs: Sequence[Stoppable],
    *,
    whole_group: bool = False,
    first: signal.Signals = signal.SIGTERM,
    grace_s: float = STOP_GRACE_S,
) -> None:
    """Stop every running process of `procs` and reap it: `first` (SIGTERM: save and exit), up
    to `grace_s` for all of them together, then SIGKILL whoever is still there. `whole_group`
    signals each one's process group (it leads one), and SIGKILLs the group even when its
    leader left in time: what it started goes too."""
    running = [p for p in procs if _running(p)]
    for proc in running:
        _signal(proc, first, whole_group)
    if first != signal.SIGKILL:
        deadline = time.monotonic() + grace_s
        while any(_running(p) for p in running) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for proc in running:
            if whole_group or _running(proc):
                _signal(proc, signal.SIGKILL, whole_group)
    for proc in running:
        if isinstance(proc, mp.process.BaseProcess):
            proc.join()
        else:
            proc.wait()


def end_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, every descendant it has (torchrun's workers lead sessions of their own) and
    whatever is left in its process group, then reap it."""
    family = []
    if proc.returncode is None:  # not reaped yet, so its pid is still its own
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(proc.pid)
            family = [parent, *parent.children(recursive=True)]
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    # its group: what its tree lost by re-parenting (Linux keeps a group's id while it has members)
    signal_group(proc, signal.SIGKILL)
    proc.wait()


# --- a child with a deadline -----------------------------------------------------------------


def _popen(argv: Sequence[str], env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


@contextlib.contextmanager
def child_run(
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    start: Callable[[Sequence[str], dict[str, str] | None], Any] | None = None,
) -> Iterator[Any]:
    """Start `argv` in a session of its own, its stdout and stderr in one text pipe; on leaving
    the block, however it is left, end it and everything it started (a no-op for a child that
    finished cleanly). Nothing else ends it: Ctrl-C in the terminal reaches only us. `start`, if
    given, makes the child in place of that Popen: one with Popen's `pid`, `poll`, `wait`,
    `communicate` and `stdout`, started as the Popen would be (`nanoddp.fork_server.ForkedModule`)."""
    proc = (start or _popen)(argv, env)
    try:
        yield proc
    finally:
        end_tree(proc)
        if proc.stdout:
            proc.stdout.close()


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for `proc` to exit and return its output; past `timeout_s`, end its tree first."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        end_tree(proc)
        return proc.communicate()[0] + f"\n(killed after {timeout_s:g}s)"
