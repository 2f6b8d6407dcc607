"""Asynchronous execution for `nanoddp.comm`: the `Work` handle and one worker per group.

Each process group gets one `GroupRunner`; it runs that group's collectives one at a time in
submission (FIFO) order, on a worker thread for `async_op=True` and inline for blocking calls
when nothing is queued. See `nanoddp.comm` for the threading model this gives callers.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanoddp.comm.transport import watchdog
from nanoddp.comm.transport.membership import membership
from nanoddp.comm.transport.transport import Peers

logger = logging.getLogger(__name__)


class Work:
    """Handle of a collective, like torch's `Work`: `wait()`, `is_completed()`, `get_future()`."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result = result
        # Made on first `get_future()` (DDP comm hooks ask; a blocking call never does).
        self._future: torch.futures.Future | None = None
        self._future_lock = threading.Lock()
        self._watch_token: int | None = None  # this collective's entry in the hang watchdog

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        with self._future_lock:
            self._done.set()
            if self._future is not None:
                self._settle(self._future)

    def _settle(self, future: torch.futures.Future) -> None:
        error = self._error
        if error is None:
            future.set_result(self._result)
        elif isinstance(error, Exception):
            future.set_exception(error)
        else:  # a torch Future holds Exceptions only; `wait()` still raises the original
            wrapped = RuntimeError(f"collective interrupted by {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            future.set_exception(wrapped)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; re-raise the collective's error (same on every rank) if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"collective not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future resolving to the output tensors (what DDP comm hooks return)."""
        with self._future_lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done.is_set():
                    self._settle(self._future)
            return self._future


class GroupRunner:
    """Runs one group's collectives strictly one after another, in submission order."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.peers = Peers(group)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._mutex = threading.Lock()  # guards _pending and thread start
        self._running = threading.Lock()  # held while a collective runs
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(
        self, name: str, numel: int, body: Callable[[], None], result: list[torch.Tensor], async_op: bool
    ) -> Work | None:
        """Run `body` (collective `name` over `numel` elements) in FIFO order; see `nanoddp.comm`.

        The hang watchdog sees the collective from submission (the moment this rank entered
        it, as far as its peers can tell) until its body finishes."""
        if torch.compiler.is_compiling():
            return _submit_eagerly(self, name, numel, body, result, async_op)
        token = watchdog.begin(name, numel, self.peers.watch_key)
        with self._mutex:
            inline = not async_op and self._pending == 0
            self._pending += 1
            if not inline:
                work = Work(result)
                work._watch_token = token
                self._start_thread()
                self._queue.put((body, work))
        if inline:  # nothing queued ahead of us: run it here, no thread hand-off and no handle
            self._run_inline(body, token)
            return None
        if async_op:
            return work
        work.wait()
        return None

    def _start_thread(self) -> None:
        if self._thread is None:
            name = f"nanoddp-comm-rank{self.peers.rank}of{self.peers.size}"
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return  # `close()` asked: the thread ends, and with it its hold on the group
            body, work = item
            self._execute(body, work)

    def close(self) -> threading.Thread | None:
        """Let the worker thread end once what is queued has run; returns it (None if none ran).

        The thread holds this runner, hence the group, hence gloo's C++ threads: while it lives,
        `destroy_process_group()` cannot free the group (see `release_groups_at_exit`). A later
        `submit` starts a new thread."""
        with self._mutex:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        return thread

    def _run_inline(self, body: Callable[[], None], token: int | None) -> None:
        """A blocking call with nothing queued ahead: its errors reach the caller directly."""
        try:
            with self._running:
                body()
        finally:
            self._leave(token)

    def _execute(self, body: Callable[[], None], work: Work) -> None:
        """Run one body; whatever it raises, even a BaseException such as KeyboardInterrupt, goes
        to its waiter (`Work.wait()` re-raises it as itself), never kills the worker thread."""
        error = None
        try:
            with self._running:
                try:
                    body()
                except BaseException as exc:  # handed to the waiter, raised by Work.wait()
                    error = exc
        finally:  # bookkeeping survives an interrupt landing here too, so the runner stays usable
            self._leave(work._watch_token)
            work._finish(error)

    def _leave(self, token: int | None) -> None:
        """A body ended, however it ended: one fewer pending, and the watchdog stops watching it."""
        with self._mutex:
            self._pending -= 1
        watchdog.end(token)


# [Note: torch.compile] Never traced (a compiled DDP forward reaches collectives): a collective is
# I/O on shared buffers (its header slots are written through numpy views, which dynamo would turn
# into writes on copies), so under a trace `submit` hands itself to a disabled copy and dynamo
# breaks the graph around it. Only then: decorating `submit` itself would make every eager call
# pay the wrapper's cost (about 10 µs, on both ranks' critical path). The copy is made on first
# use, not at import: `torch.compiler.disable` imports dynamo, a second of start-up for every
# process that never compiles.
_eager_submit: Callable[..., Work | None] | None = None


def _submit_eagerly(*args) -> Work | None:
    global _eager_submit
    if _eager_submit is None:
        _eager_submit = torch.compiler.disable(GroupRunner.submit)
    return _eager_submit(*args)


_RUNNERS: dict[dist.ProcessGroup, GroupRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def runner_for(group: dist.ProcessGroup | None, op: str = "collective") -> GroupRunner | None:
    """This group's runner; None on a rank outside the group (warning as torch does, naming
    `op`, torch's name for the call). With no default group (never initialised, or destroyed):
    torch's ValueError, raised rather than asserted so that `python -O` raises it too."""
    if group is None or group is dist.GroupMember.WORLD:
        if not dist.is_initialized():  # also drops the stale runner of a destroyed default group
            raise ValueError(NOT_INITIALIZED)
        group = dist.group.WORLD
        assert group is not None  # initialised: checked above (narrows the type only)
        runner = _RUNNERS.get(group)  # the hot path: initialised, checked just above
        if runner is not None:
            return runner
    runner = _RUNNERS.get(group)  # a runner exists only for a group this rank is in
    if runner is not None and dist.is_initialized():
        return runner
    # a group torch's registry does not know (a torchft group's) answers for itself
    if not dist.is_initialized() or membership(group).rank < 0:
        _warn_not_in_group(op)
        return None
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(group)
        if runner is None:
            runner = _RUNNERS[group] = GroupRunner(group)
    return runner


# torch.distributed's words, so that code written for it (and its tests) sees the same thing.
NOT_INITIALIZED = "Default process group has not been initialized, please make sure to call init_process_group."


def _warn_not_in_group(op: str) -> None:
    """torch's warning for a collective on a group this rank is not in (the call then returns None)."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    warnings.warn(f"Running {op} on global rank {rank} which does not belong to the given group.", stacklevel=4)


def pending_work() -> int:
    """Collectives submitted and not yet finished, over all groups (0: nothing can be mid-message)."""
    with _RUNNERS_LOCK:
        return sum(runner._pending for runner in _RUNNERS.values())


def forget_group(group: dist.ProcessGroup) -> None:
    """Drop `group`'s runner only (a group replaced by another, as a fault-tolerant quorum's is);
    its thread ends, and the group is freed once nothing else holds it."""
    with _RUNNERS_LOCK:
        runner = _RUNNERS.pop(group, None)
    if runner is not None:
        runner.close()


def forget_groups() -> list[tuple[GroupRunner, threading.Thread]]:
    """Drop every group's runner, after the groups were destroyed (notebook recovery, exit);
    returns the runners whose threads were told to end, with those threads.

    A runner's thread may still be finishing a collective on the dead group; it fails there,
    its waiter gets the error, and the thread ends. The next collective gets a fresh runner on
    the new group."""
    with _RUNNERS_LOCK:
        runners = list(_RUNNERS.values())
        _RUNNERS.clear()
    closing = [(runner, runner.close()) for runner in runners]
    return [(runner, thread) for runner, thread in closing if thread is not None]


EXIT_JOIN_S = 5.0  # an idle runner's thread ends at once; this bound only guards the exit


def release_groups_at_exit() -> None:
    """Free the process groups nanoddp still holds while Python is fully alive (an atexit hook).

    Why: a runner's thread would otherwise keep its group, and so gloo's worker threads, alive
    into interpreter finalization, even after `destroy_process_group()`. A gloo thread that then
    takes the GIL (a future callback that finishes late, say, or dropping the last reference to
    a tensor whose Python object is gone) is ended by Python with `pthread_exit` in the middle
    of C++, and the process aborts: "terminate called without an active exception".
    torch itself frees a destroyed group at once, joining gloo's threads with the GIL released;
    here that happens before finalization too. Runners still busy (a collective stuck at exit)
    are left alone: joining them could hang the exit."""
    idle = [thread for runner, thread in forget_groups() if runner._pending == 0]
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in idle:
        thread.join(max(deadline - time.monotonic(), 0.0))
    gc.collect()  # a group kept only by reference cycles (an engine and its hooks) goes now too


atexit.register(release_groups_at_exit)
