"""Hang watchdog: turn a stuck collective into a clear error and a non-zero exit.

A collective that one rank never joins blocks the others silently (for gloo, until the
process-group timeout; for nccl, possibly forever). Every collective nanoddp issues is
bracketed by `begin(...)`/`end(...)` on this process's watchdog. A background thread:

1. publishes this rank's progress (per group: the sequence number of the last collective it
   entered) to the c10d store every `poll_s` — off the hot path, so a tracked collective costs
   a dict update, not a store round trip;
2. checks the oldest in-flight collective; past `timeout_s` it reads every rank's progress from
   the store, logs which ranks have and have not arrived at that collective, and exits the
   process with `HANG_EXIT_CODE`, so torchrun (or `nanoddp.launch`) can tear down and restart
   the group.

Disabled (the default), `track`/`begin`/`end` are no-ops that cost one global lookup.

`nanoddp.comm` registers its own collectives; `TORCH_COLLECTIVES` gives torch.distributed's the
same protection, so the engines' `comm_backend="torch"` path is watched too.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nanoddp.comm.transport import link, transport
from nanoddp.comm.transport.membership import GroupKey, Unregistered, membership

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 86
STORE_PREFIX = "nanoddp/watchdog"


@dataclass
class InFlight:
    """A collective this rank has entered and not yet finished."""

    op: str
    seq: int
    numel: int
    group_key: GroupKey  # `Membership.watch_key`: member ranks, or an `Unregistered` group
    started: float


def _store_key(group_ranks: tuple[int, ...]) -> str:
    return "world" if group_ranks == tuple(range(dist.get_world_size())) else "-".join(map(str, group_ranks))


class CollectiveWatchdog:
    """Per-process monitor of in-flight collectives (see the module docstring)."""

    def __init__(
        self, timeout_s: float, store: dist.Store | None = None, poll_s: float = 1.0, exit_on_hang: bool = True
    ):
        if timeout_s <= 0:
            raise ValueError(f"collective timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.poll_s = min(poll_s, timeout_s / 4)
        self.exit_on_hang = exit_on_hang
        self.rank = dist.get_rank()
        # The default store is the one every rank already shares (file, TCP or torchrun's).
        self.store = store or dist.distributed_c10d._get_default_store()
        self._lock = threading.Lock()
        self._seq: dict[GroupKey, int] = {}  # group key -> last sequence number entered
        self._in_flight: dict[int, InFlight] = {}
        self._tokens = itertools.count()
        self._published: dict[GroupKey, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoddp-watchdog", daemon=True)
        self.last_report: str | None = None

    def start(self) -> CollectiveWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def begin(self, op: str, numel: int, group_key: GroupKey) -> int:
        """Record that this rank entered collective `op` on the group `group_key` names
        (`Membership.watch_key`); returns a token for `end`."""
        with self._lock:
            seq = self._seq.get(group_key, 0) + 1
            self._seq[group_key] = seq
            token = next(self._tokens)
            self._in_flight[token] = InFlight(op, seq, numel, group_key, time.monotonic())
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._in_flight.pop(token, None)

    def _publish_progress(self) -> None:
        with self._lock:
            # an unregistered group's members need not share our store: nothing to publish to them
            changed = {
                g: s for g, s in self._seq.items() if self._published.get(g) != s and not isinstance(g, Unregistered)
            }
        for group_ranks, seq in changed.items():
            self.store.set(f"{STORE_PREFIX}/{_store_key(group_ranks)}/{self.rank}", str(seq))
            self._published[group_ranks] = seq

    def _progress_of(self, group_ranks: tuple[int, ...]) -> dict[int, int]:
        """Last sequence number each member of the group published (0 if none yet)."""
        keys = [f"{STORE_PREFIX}/{_store_key(group_ranks)}/{r}" for r in group_ranks]
        progress = {}
        for rank, key in zip(group_ranks, keys, strict=True):
            progress[rank] = int(self.store.get(key)) if self.store.check([key]) else 0
        return progress

    def hang_report(self, stuck: InFlight) -> str:
        waited = time.monotonic() - stuck.started
        if isinstance(stuck.group_key, Unregistered):
            return (
                f"collective hang on rank {self.rank}: {stuck.op} #{stuck.seq} ({stuck.numel} elements, on a "
                f"group of {stuck.group_key.size} ranks torch's registry does not know, a fault-tolerance "
                f"manager's, say) has waited {waited:.0f}s > timeout {self.timeout_s:g}s; its members' "
                "progress is not in this rank's store, so which of them did not arrive is unknown. " + _likely_cause([])
            )
        progress = self._progress_of(stuck.group_key)
        arrived = sorted(r for r, s in progress.items() if s >= stuck.seq)
        missing = sorted(r for r, s in progress.items() if s < stuck.seq)
        behind = ", ".join(f"rank {r} at #{progress[r]}" for r in missing)
        return (
            f"collective hang on rank {self.rank}: {stuck.op} #{stuck.seq} ({stuck.numel} elements, "
            f"group {list(stuck.group_key)}) has waited {waited:.0f}s > timeout {self.timeout_s:g}s; "
            f"arrived: ranks {arrived}; not arrived: ranks {missing} ({behind or 'none'}). " + _likely_cause(missing)
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._publish_progress()
                with self._lock:
                    oldest = min(self._in_flight.values(), key=lambda f: f.started, default=None)
                if oldest is None or time.monotonic() - oldest.started <= self.timeout_s:
                    continue
                time.sleep(self.poll_s)  # give the others one more beat to publish
                self.last_report = self.hang_report(oldest)
            except Exception:  # a broken store must not kill training; log and keep watching
                logger.exception("watchdog poll failed")
                continue
            logger.error(self.last_report)
            if self.exit_on_hang:
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(HANG_EXIT_CODE)
            return


def _likely_cause(missing: list[int]) -> str:
    """Why the collective waits: this rank's simulated slow link when it still holds messages (the
    shaper knows), else the ranks that have not arrived, else the transport itself."""
    backlog, model = transport.link_backlog(), transport.link_model()
    if backlog is not None and model is not None and backlog.messages:
        return (
            f"The simulated slow link is the wait, not a rank: it still holds {backlog.messages} message(s) "
            f"({backlog.nbytes / 1e6:.3g} MB) of this rank, the last due in {backlog.due_in_s:.0f}s "
            f"({link.BANDWIDTH_VAR}/{link.LATENCY_VAR}: {model.describe()}); raise the collective timeout "
            "above that, or the link's bandwidth."
        )
    if missing:
        return "Those ranks are stuck elsewhere (a skipped collective, a data-dependent branch, a crash)."
    if model is not None:
        return (
            f"Every rank arrived: the data is in flight on a peer's simulated slow link ({model.describe()}); "
            "raise the collective timeout, or the link's bandwidth."
        )
    return "Every rank arrived: the collective is stuck inside (a rank that died in it, a lost connection)."


_active: CollectiveWatchdog | None = None


def enable(timeout_s: float, poll_s: float = 1.0, exit_on_hang: bool = True) -> CollectiveWatchdog:
    """Start this process's watchdog (call after the process group is initialised)."""
    global _active
    disable()
    _active = CollectiveWatchdog(timeout_s, poll_s=poll_s, exit_on_hang=exit_on_hang).start()
    return _active


def disable() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def active() -> CollectiveWatchdog | None:
    return _active


def begin(op: str, numel: int, group_key: GroupKey) -> int | None:
    """Mark the start of a collective (async ones end when their Work completes); None when disabled."""
    return None if _active is None else _active.begin(op, numel, group_key)


def end(token: int | None) -> None:
    if token is not None and _active is not None:
        _active.end(token)


@contextlib.contextmanager
def track(op: str, numel: int, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Bracket a blocking collective: `with watchdog.track("all_reduce", t.numel()): ...`."""
    if _active is None:
        yield
        return
    token = _active.begin(op, numel, membership(group).watch_key)
    try:
        yield
    finally:
        _active.end(token)


def _release_on_completion(work: dist.Work, token: int | None) -> dist.Work | _ReleasedAtWait:
    """Release `token` when `work` completes, however the caller learns of it: `wait()`, polling
    `is_completed()`, or a future callback (DDP comm hooks never call wait). A Work without a
    future (rare, backend-specific) is released at its `wait()` instead."""
    try:
        future = work.get_future()
    except RuntimeError:  # this backend's Work has no future: wait() is the only completion signal
        return _ReleasedAtWait(work, token)
    future.add_done_callback(lambda _: end(token))
    return work


class _ReleasedAtWait:
    """torch's Work, releasing the watchdog token when the caller waits."""

    def __init__(self, work: dist.Work, token: int | None) -> None:
        self._work, self._token = work, token

    def wait(self, *args: Any) -> bool:
        try:
            return self._work.wait(*args)
        finally:
            end(self._token)

    def __getattr__(self, name: str) -> Any:  # is_completed, is_success, ...
        return getattr(self._work, name)


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _watched(fn: Callable[..., Any], name: str, tensor_arg: int) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, group: dist.ProcessGroup | None = None, async_op: bool = False, **kwargs: Any) -> Any:
        if active() is None:
            return fn(*args, group=group, async_op=async_op, **kwargs)
        key = membership(group).watch_key
        token = begin(name, _numel(args[tensor_arg]) if len(args) > tensor_arg else 0, key)
        try:
            work = fn(*args, group=group, async_op=async_op, **kwargs)
        except BaseException:
            end(token)
            raise
        if not async_op:
            end(token)
            return work
        return _release_on_completion(work, token)

    return call


# torch.distributed's collectives, each bracketed by begin/end (an async call ends when its
# Work completes, whether or not anyone waits on it). The torch side of `nanoddp.comm.api.backend`.
TORCH_COLLECTIVES = types.SimpleNamespace(
    ReduceOp=dist.ReduceOp,
    all_reduce=_watched(dist.all_reduce, "all_reduce", 0),
    reduce=_watched(dist.reduce, "reduce", 0),
    broadcast=_watched(dist.broadcast, "broadcast", 0),
    all_gather=_watched(dist.all_gather, "all_gather", 1),
    all_gather_into_tensor=_watched(dist.all_gather_into_tensor, "all_gather_into_tensor", 1),
    reduce_scatter_tensor=_watched(dist.reduce_scatter_tensor, "reduce_scatter_tensor", 1),
    scatter=_watched(dist.scatter, "scatter", 0),
    gather=_watched(dist.gather, "gather", 0),
)
