"""Timelines: a Chrome-trace / Perfetto JSON per rank, made with the standard `torch.profiler`.

Horovod's timeline shows when each gradient bucket is reduced relative to backward, which is
the one picture that explains data-parallel speed. Here the same picture comes from
`torch.profiler`, plus three small helpers:

- `region(name)`: a named span (`record_function`) such as "forward", "backward",
  "optimizer step". The profiler puts every torch op inside it.
- `traced_comm_hook(hook)`: wraps a DDP comm hook (torch's contract; works on
  `nanoddp.DistributedDataParallel` and torch's) so that every bucket's all-reduce shows as a
  span "bucket <i> all-reduce" from launch (inside backward) to done (on the comm thread).
  The span is opened on the launching thread and closed on whichever thread completes the
  future; the profiler records it with the launch thread's id. Because such spans overlap the
  backward ops rather than nest in them, `TraceSession` moves each bucket onto a track of its
  own ("bucket 3 all-reduce") when it writes the file, so viewers draw them cleanly.
- `build_traced_engine(name, module, env)`: `nanoddp.train.engines.build_engine` with those bucket
  spans registered (DDP engines; via a comm hook, so a traced run reduces through
  `hooks.allreduce_hook`, the same math as the default path) and a "gradient sync" span around
  the manual engines' after-backward sync.
- `TraceSession(out_dir, rank)`: skips a few steps (start-up noise), records a few, and writes
  `out_dir/rank<r>.trace.json` atomically. With `out_dir=None` it does nothing, so training
  code calls it unconditionally.

Open a file in https://ui.perfetto.dev or chrome://tracing. The profiler is started with
`profile_all_threads` where torch offers it, so ops run by nanoddp's comm thread appear too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, record_function

from nanoddp.base.files import atomic_write_bytes
from nanoddp.env import DistEnv
from nanoddp.train.engines import Engine, build_engine

logger = logging.getLogger(__name__)

BUCKET_SPAN = "bucket {index} all-reduce"
_BUCKET_SPAN_RE = re.compile(r"^bucket (\d+) all-reduce$")
_BUCKET_TID_BASE = 1_000_000  # synthetic thread ids for the per-bucket tracks


def region(name: str) -> contextlib.AbstractContextManager:
    """A named span on the timeline; costs a few microseconds when no profiler is running."""
    return record_function(name)


def traced_comm_hook(hook: Callable) -> Callable:
    """`hook` (state, bucket) -> Future, plus a "bucket <i> all-reduce" span from launch to done.

    No return annotation on purpose: torch DDP rejects a hook whose annotation is anything but
    `Future[Tensor]`, and an absent one is accepted.
    """

    def traced(state, bucket):
        span = record_function(BUCKET_SPAN.format(index=bucket.index()))
        span.__enter__()
        try:
            future = hook(state, bucket)
        except BaseException:
            span.__exit__(None, None, None)
            raise

        def close(fut: torch.futures.Future):
            span.__exit__(None, None, None)  # runs on the thread that completed the collective
            return fut.value()

        return future.then(close)

    traced.__name__ = f"traced_{getattr(hook, '__name__', 'hook')}"
    return traced


def _traced_sync(sync: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    def traced(module: nn.Module) -> None:
        with record_function("gradient sync"):
            sync(module)

    return traced


def build_traced_engine(name: str, module: nn.Module, env: DistEnv) -> Engine:
    """`build_engine(name, module, env)`, drawing each bucket's reduction on the timeline.

    Each engine says how (`Engine.trace_comm`): the DDP engines reduce through
    `traced_comm_hook(hooks.allreduce_hook)`, timed; the manual engines get a "gradient sync"
    span around their after-backward sync.
    """
    engine = build_engine(name, module, env)
    engine.trace_comm(env, traced_comm_hook, _traced_sync)
    return engine


def _profiler_config() -> Any:
    """Profile every thread (nanoddp's comm worker included) where this torch supports it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # older torch: main-thread ops only
        return None


def split_bucket_tracks(trace: dict) -> dict:
    """Move each "bucket <i> all-reduce" span onto its own named track (returns `trace`).

    Spans of different buckets overlap each other and the backward ops on the launch thread;
    on separate tracks every span stays visible and the overlap with backward is plain to see.
    """
    events = trace.get("traceEvents", [])
    named: set[tuple[Any, int]] = set()
    for event in list(events):
        match = _BUCKET_SPAN_RE.match(str(event.get("name", "")))
        if match is None or event.get("ph") != "X":
            continue
        index = int(match.group(1))
        event["tid"] = _BUCKET_TID_BASE + index
        if (event.get("pid"), index) not in named:
            named.add((event.get("pid"), index))
            track = {"ph": "M", "pid": event.get("pid"), "tid": event["tid"], "name": "thread_name"}
            events.append({**track, "args": {"name": BUCKET_SPAN.format(index=index)}})
            events.append({**track, "name": "thread_sort_index", "args": {"sort_index": -1000 + index}})
    return trace


def _write_trace(profiler: torch.profiler.profile, path: Path) -> None:
    """Export, regroup the bucket spans, and replace `path` atomically."""
    with tempfile.TemporaryDirectory(prefix="nanoddp-trace-") as scratch:
        raw = os.path.join(scratch, "raw.json")  # torch writes its own format here first
        profiler.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
    atomic_write_bytes(path, json.dumps(split_bucket_tracks(trace)).encode())
    logger.info("wrote timeline %s", path)


class TraceSession:
    """Profile steps `skip+1 .. skip+steps` of a loop and write one trace file for this rank.

    Use as a context manager and call `step()` once per training step. Steps before `skip`
    are not recorded (compilation, bucket rebuild, allocator warm-up would dominate them).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike | None,
        rank: int,
        steps: int = 3,
        skip: int = 2,
        name: str = "rank{rank}.trace.json",
    ):
        if steps < 1 or skip < 0:
            raise ValueError(f"trace needs steps >= 1 and skip >= 0, got steps={steps}, skip={skip}")
        self.path = None if out_dir is None else Path(out_dir) / name.format(rank=rank)
        self._profiler: torch.profiler.profile | None = None
        self._skip, self._steps = skip, steps

    def __enter__(self) -> TraceSession:
        path = self.path
        if path is None:
            return self
        schedule = torch.profiler.schedule(
            wait=max(self._skip - 1, 0), warmup=min(self._skip, 1), active=self._steps, repeat=1
        )
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            experimental_config=_profiler_config(),
            on_trace_ready=lambda prof: _write_trace(prof, path),
        )
        self._profiler.__enter__()
        return self

    def step(self) -> None:
        """Mark the end of one training step."""
        if self._profiler is not None:
            self._profiler.step()

    def __exit__(self, *exc: object) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(*exc)
            self._profiler = None
            assert self.path is not None  # a profiler runs only with a path
            if not self.path.exists():
                logger.warning("no timeline written: the loop ended within the %d skipped steps", self._skip)
