"""torch.distributed's collectives, registered with the hang watchdog.

`nanoddp.comm` registers its own collectives; this module gives the engines' `comm_backend=
"torch"` path the same protection: each call is bracketed by `watchdog.begin`/`end` (an async
call ends when its `Work.wait()` returns). With the watchdog disabled every function is just
torch's, plus one global lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401  (re-exported: engines read collectives.ReduceOp)

from nanoddp.comm import watchdog

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "gather",
    "reduce", "reduce_scatter_tensor", "scatter",
]  # fmt: skip


class _WatchedWork:
    """torch's Work, plus the watchdog token it must release when the caller waits."""

    def __init__(self, work: dist.Work, token: int) -> None:
        self._work, self._token = work, token

    def wait(self, *args: Any) -> bool:
        try:
            return self._work.wait(*args)
        finally:
            watchdog.end(self._token)

    def get_future(self) -> torch.futures.Future:
        """torch's future, releasing the token once it completes (comm hooks never call wait)."""

        def release(done: torch.futures.Future) -> Any:
            watchdog.end(self._token)
            return done.value()

        return self._work.get_future().then(release)

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
        if watchdog.active() is None:
            return fn(*args, group=group, async_op=async_op, **kwargs)
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        token = watchdog.begin(name, _numel(args[tensor_arg]) if len(args) > tensor_arg else 0, ranks)
        try:
            work = fn(*args, group=group, async_op=async_op, **kwargs)
        except BaseException:
            watchdog.end(token)
            raise
        if not async_op:
            watchdog.end(token)
            return work
        return _WatchedWork(work, token)

    return call


all_reduce = _watched(dist.all_reduce, "all_reduce", 0)
reduce = _watched(dist.reduce, "reduce", 0)
broadcast = _watched(dist.broadcast, "broadcast", 0)
all_gather = _watched(dist.all_gather, "all_gather", 1)
all_gather_into_tensor = _watched(dist.all_gather_into_tensor, "all_gather_into_tensor", 1)
reduce_scatter_tensor = _watched(dist.reduce_scatter_tensor, "reduce_scatter_tensor", 1)
scatter = _watched(dist.scatter, "scatter", 0)
gather = _watched(dist.gather, "gather", 0)
