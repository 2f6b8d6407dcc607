"""Workers forked from a server that imported torch once, instead of fresh interpreters.

[Note: workers forked from a server] A worker started as `python -m ...` spends a second or two
of CPU importing torch and nanoddp before its first step, and so does every restart's and every
replacement's. multiprocessing's fork server is a fresh interpreter, started once per launcher,
that imports the modules it is told to preload and then forks a child per request: a child
starts in milliseconds, its imports done. A launcher that has computed nothing and started no
thread yet can fork the server from itself instead (`start_as_fork`), and save that interpreter's
imports too; later, its threads (a rendezvous store's, a copier's) would be copied mid-state, and
libgomp's thread pool, made at the first parallel torch op, does not survive a fork.

What a forked child lacks, and gets here:

- the launcher's state at this start (`LauncherView`): a forked child would otherwise see the
  environment, working directory and standard streams the server started with, maybe long ago;
- its ties to the launcher (`base.processes.die_with_launcher`): its parent is the server, which
  outlives the launcher while any child lives;
- for `ForkedModule`, what `subprocess.Popen([python, -m, MODULE, ...], start_new_session=True)`
  gives: a session of its own (the launcher signals its whole group), pipes for its streams, an
  exit code in `poll()`/`wait()` (negative for a signal), and `MODULE.main(argv)` run as the
  program.

The server's socket lives in a temp dir of multiprocessing's, which `start` makes inside a private
dir named by this pid: removed at exit, swept by the next start after a SIGKILL (`tempdirs`). A
socket's path holds at most 107 bytes, which a deep TMPDIR (a test's, a CI job's) exceeds, so the
private dir is reached as /proc/self/fd/N, N a descriptor kept open for this process's life (only
this process connects to the server).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import forkserver, process, reduction, resource_tracker, util
from typing import IO, Any

from nanoddp.base.processes import POLL_S, WATCHER_PREFIX, die_with_launcher, die_with_parent
from nanoddp.tempdirs import make_private_dir

SCRATCH_PREFIX = "nanoddp-forkserver-"
SESSION_WAIT_S = 10.0  # a forked child makes its session first thing; this only bounds a dead one

# Every worker that builds a torch optimizer imports torch._dynamo right then (torch._compile wraps
# Optimizer.add_param_group to keep dynamo out of it): 2.5 s of CPU on a 2-core machine, in every
# rank, restart and replacement, unless the server imported it first. So every server does.
ALWAYS_PRELOAD = ("torch._dynamo",)

# every module asked for in this process, in order: the server imports them all
_preloads: list[str] = list(ALWAYS_PRELOAD)


def preload(modules: Sequence[str]) -> None:
    """Have this process's fork server import `modules` too, if it has not started yet (the
    server imports once, at its start: after that a child imports what it lacks itself)."""
    _preloads.extend(m for m in modules if m not in _preloads)


def start(modules: Sequence[str] = ()) -> None:
    """Start this process's fork server with `modules` imported, and every module `preload` was
    given; one that runs already stays, with what it imported."""
    with _starting:  # one thread at a time: tempfile.tempdir is the process's
        _start(modules)


_starting = threading.Lock()
_spawnv_passfds = util.spawnv_passfds  # how multiprocessing starts a server, which `start_as_fork` swaps


def start_as_fork(modules: Sequence[str] = ()) -> None:
    """`start`, with the server a fork of this process instead of a fresh interpreter: this
    process's imports (torch's included, seconds of CPU) are the server's too.

    Call it only while this process is as clean as a fresh server: before its first torch
    computation (libgomp's thread pool, made at the first parallel op, does not survive a fork,
    and the ranks would hang at theirs) and before it starts a thread (a fork copies another
    thread's locks, not the thread). With a thread running already it starts a fresh server,
    as `start` does (`die_with`'s watcher, which only waits in select, does not count). The
    server sees this process's environment at this call: set what the ranks must inherit first."""
    with _starting:
        others = [t for t in threading.enumerate() if t is not threading.current_thread()]
        if any(not t.name.startswith(WATCHER_PREFIX) for t in others):
            _start(modules)
            return
        resource_tracker.ensure_running()  # its own small interpreter, as with `start`
        util.spawnv_passfds = _fork_server_here
        try:
            _start(modules)
        finally:
            util.spawnv_passfds = _spawnv_passfds


def _fork_server_here(_path: str, _args: list[str], passfds: Sequence[int]) -> int:
    """In place of multiprocessing's spawn of `python -c "...forkserver import main; main(...)"`:
    fork, and run that `main` in the child with this process's imports, with the descriptors a
    spawned server would have (its standard streams and `passfds`, the listener and the
    liveness pipe)."""
    listener_fd, alive_r = passfds
    preloads = list(forkserver._forkserver._preload_modules)
    launcher = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        keep = {0, 1, 2, *passfds}
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        # What the start holds or swapped at the fork, copied: its locks held (a rank's own start
        # would wait forever), multiprocessing's spawn, tempfile's dir (read from TMPDIR at its
        # first use, as in a spawned server) and our private dir by a descriptor just closed.
        forkserver._forkserver._lock = threading.Lock()
        util.spawnv_passfds = _spawnv_passfds
        global _starting
        _starting = threading.Lock()
        tempfile.tempdir = None
        _private_socket_dir.cache_clear()
        die_with_parent(launcher)  # a spawned one waits for its liveness pipe, past a SIGKILLed launcher
        forkserver.main(listener_fd, alive_r, preloads)
    finally:
        os._exit(0)  # as a server ends: none of the launcher's exit handlers, which are not ours


def _start(modules: Sequence[str]) -> None:
    preload(modules)
    mp.set_forkserver_preload(list(_preloads))
    config = process.current_process()._config  # multiprocessing's record of its temp dir, "tempdir"
    if forkserver._forkserver._forkserver_pid is None:  # no server of ours yet: its dir is ours too,
        config.pop("tempdir", None)  # not one a Process of the process that forked us recorded
    previous, tempfile.tempdir = tempfile.tempdir, _private_socket_dir()
    try:
        forkserver.ensure_running()
    finally:
        tempfile.tempdir = previous
    # Forget the dir: recorded by the short path, it is this process's descriptor, and a Process
    # copies the record (in a child it named another descriptor or none: a rank's own
    # `multiprocessing.Manager()` or fork server failed, NotADirectoryError); by its real path it
    # can be too deep for a socket of the rank's. The next use makes one as multiprocessing does.
    if config.get("tempdir", "").startswith("/proc/self/fd/"):
        del config["tempdir"]


@functools.cache  # made at the first start, once per process
def _private_socket_dir() -> str:
    """The dir multiprocessing makes its own (and the server's socket) in: a private one named by
    this pid, reached by a short path (see the module's note)."""
    scratch = make_private_dir(SCRATCH_PREFIX)
    short = f"/proc/self/fd/{os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)}"
    # multiprocessing removes its own dir inside at exit, with priority -100: lower runs later
    util.Finalize(None, shutil.rmtree, args=(scratch,), kwargs={"ignore_errors": True}, exitpriority=-101)
    return short if os.path.isdir(short) else scratch


class LauncherView:
    """What a spawned child inherits from the launcher at its start and a child forked from the
    fork server would not: the environment variables, the working directory, and standard
    streams (fd -> the descriptor to put there). Pickled into the child; the descriptors travel
    as file descriptors that multiprocessing passes along with the process (`reduction.DupFd`)."""

    def __init__(self, environ: dict[str, str], cwd: str, streams: dict[int, Any]) -> None:
        self.environ, self.cwd, self.streams = environ, cwd, streams

    @classmethod
    def now(cls, environ: dict[str, str] | None = None, streams: dict[int, int] | None = None) -> LauncherView:
        """This process's view (stdout and stderr unless `streams` says otherwise)."""
        return cls(dict(os.environ) if environ is None else environ, os.getcwd(), streams or {1: 1, 2: 2})

    def __reduce__(self):
        streams = {target: reduction.DupFd(fd) for target, fd in self.streams.items()}
        return LauncherView, (self.environ, self.cwd, streams)

    def take_on(self) -> None:
        """Child side: become what a spawned child of the launcher would be."""
        os.environ.clear()
        os.environ.update(self.environ)
        tempfile.tempdir = None  # read from TMPDIR at its first use, maybe in the server long ago: again
        os.chdir(self.cwd)
        for target, stream in self.streams.items():
            fd = stream.detach()
            os.dup2(fd, target)
            os.close(fd)
        if 0 in self.streams:  # multiprocessing gave the child /dev/null as sys.stdin
            sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0 lives as long as the process)
        if isinstance(sys.stdout, io.TextIOWrapper):  # the server's: block-buffered into a pipe
            sys.stdout.reconfigure(line_buffering=True)


def _run_module(
    module: str, argv: list[str], view: LauncherView, launcher_pid: int, enter: Callable[[], None] | None
) -> None:
    """The forked child of `ForkedModule`: `python -m module *argv` in a session of its own."""
    os.setsid()
    die_with_launcher(launcher_pid)
    if enter is not None:
        enter()
    view.take_on()
    sys.argv = [module, *argv]
    sys.exit(importlib.import_module(module).main(argv) or 0)


class ForkedModule:
    """`subprocess.Popen([sys.executable, "-m", module, *argv], env=environ, stdin=PIPE or the
    launcher's, stdout=PIPE, stderr=PIPE or STDOUT, text=text, start_new_session=True)`, forked
    from the fork server: the same `pid`, `stdin`/`stdout`/`stderr`, `poll()`, `wait()`,
    `send_signal()`, `terminate()`, `kill()`, `communicate()` and `returncode`. `module` has a
    `main(argv) -> int | None`.

    `enter`, a picklable callable, is the child's first act after its session: what a command
    prefix such as `ip netns exec NAME` would have done before the program (`NetnsHosts.fork`).
    `output_pipes=False` is Popen's `stdout=None, stderr=None`: the child writes where this
    process writes, and `stdout` and `stderr` are None. The fork server starts here if none runs
    (`start`, `module` imported by it); one that runs already forks the child as it is."""

    def __init__(
        self,
        module: str,
        argv: Sequence[str],
        environ: dict[str, str],
        stdin_pipe: bool,
        *,
        stderr_to_stdout: bool = False,
        text: bool = False,
        enter: Callable[[], None] | None = None,
        output_pipes: bool = True,
    ) -> None:
        start([module])
        ours: list[int] = []  # the ends this process keeps
        theirs: dict[int, int] = {}  # the child's ends, by the stream they become
        made: set[int] = set()  # the pipes' child ends, closed here once the child has its copies
        if output_pipes:
            for target in (1,) if stderr_to_stdout else (1, 2):
                read, write = os.pipe()
                ours.append(read)
                theirs[target] = write
                made.add(write)
            if stderr_to_stdout:
                theirs[2] = theirs[1]
        else:  # Popen's stdout=None: where the launcher writes
            theirs.update({target: target for target in (1, 2) if _is_open(target)})
        stdin_write = None
        if stdin_pipe:
            theirs[0], stdin_write = os.pipe()
            made.add(theirs[0])
        elif _is_open(0):  # a replica reads what the launcher reads
            theirs[0] = 0
        try:
            self._process = mp.get_context("forkserver").Process(
                target=_run_module, args=(module, list(argv), LauncherView.now(environ, theirs), os.getpid(), enter),
                name=module, daemon=False,
            )  # fmt: skip
            self._process.start()
        finally:
            for fd in made:  # the child holds its copies (EOF comes with its exit)
                os.close(fd)
        self.pid: int = self._process.pid  # type: ignore[assignment]  (started)
        mode = "r" if text else "rb"
        self.stdout: IO[Any] | None = os.fdopen(ours[0], mode) if ours else None
        self.stderr: IO[Any] | None = os.fdopen(ours[1], mode) if len(ours) > 1 else None
        self._readers: dict[str, threading.Thread] = {}  # `communicate`'s, by stream
        self._read: dict[str, Any] = {}  # what they read
        self.stdin: IO[bytes] | None = None if stdin_write is None else os.fdopen(stdin_write, "wb")
        self._wait_for_its_session()

    def _wait_for_its_session(self) -> None:
        """Return once the child leads its session (its first act), so that a signal to its group
        from here on reaches it, as with Popen's start_new_session."""
        deadline = time.monotonic() + SESSION_WAIT_S
        while self.poll() is None and time.monotonic() < deadline:
            try:
                if os.getpgid(self.pid) == self.pid:
                    return
            except ProcessLookupError:
                return
            time.sleep(POLL_S / 10)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """As Popen's: `sig` to the child alone, if it has not exited."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """As Popen's: all of stdout and stderr (None for one not piped), once the child has
        exited; past `timeout`, TimeoutExpired, and a later call goes on where this one stopped."""
        if not self._readers:  # one reader per stream, so that neither pipe fills while we wait
            for name, stream in (("out", self.stdout), ("err", self.stderr)):
                if stream is not None:
                    reader = threading.Thread(target=lambda n=name, s=stream: self._read.update({n: s.read()}),
                                              daemon=True)  # fmt: skip
                    reader.start()
                    self._readers[name] = reader
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return self._read.get("out"), self._read.get("err")


def python_module(command: Sequence[str]) -> str | None:
    """MODULE for `[sys.executable, "-m", MODULE, ...]` (what `ForkedModule` can fork), else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2]
    return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
