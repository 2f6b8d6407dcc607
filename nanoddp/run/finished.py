"""Ranks that finished while others run on: named after a grace period, or the job stopped.

torchrun's agent fails the job when a worker exits non-zero, but one that exits 0 early is just
"done": if a peer then waits forever (for a collective the finished rank will never join, or in
its own loop), the job hangs with no word. The agent's monitor sees it, though: its worker group
stays HEALTHY while some of the workers' processes are gone (a worker that exited non-zero would
have failed the group). So `nanoddp run` runs torchrun's `LocalElasticAgent` with this check
added to each monitor pass: once some ranks have been finished and others running for
`grace_s`, one line names both; with `fail=True` the job is stopped instead (`EarlyExit`, the
agent's own shutdown stops the workers).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator

import psutil
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from nanoddp.train.launcher.agent import AgentStop

DEFAULT_FINISHED_GRACE_S = 60.0


class EarlyExit(AgentStop):
    """Some ranks finished and others were still running after the grace period (`--fail-on-early-exit`)."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class FinishedRanksWatch:
    """The check, fed one worker group per monitor pass (a restart brings new worker pids)."""

    def __init__(self, grace_s: float, fail: bool):
        self.grace_s = grace_s
        self.fail = fail
        self._pids: dict[int, int] = {}  # global rank -> its worker's pid, this round
        self._procs: dict[int, psutil.Process | None] = {}  # None: gone before the first look
        self._since: float | None = None  # when a finished rank was first seen next to running ones
        self._reported = False

    def check(self, worker_group: WorkerGroup) -> None:
        """Called while the group is HEALTHY: any worker process that is gone exited 0."""
        pids = {worker.global_rank: worker.id for worker in worker_group.workers}
        if None in pids.values():  # not started yet (psutil.Process(None) would be this process)
            return
        if pids != self._pids:  # first pass or a restart
            self._pids, self._procs, self._since, self._reported = pids, {}, None, False
            for rank, pid in pids.items():
                try:
                    self._procs[rank] = psutil.Process(pid)  # is_running() then also rules out pid reuse
                except psutil.Error:
                    self._procs[rank] = None
        finished = sorted(rank for rank, proc in self._procs.items() if proc is None or not _alive(proc))
        if not finished or len(finished) == len(self._procs):
            return
        if self._since is None:
            self._since = time.monotonic()
        if self._reported or time.monotonic() - self._since < self.grace_s:
            return
        running = sorted(set(self._procs) - set(finished))
        line = f"nanoddp run: {_ranks(finished)} finished (exit code 0) but {_ranks(running)} still running"
        line += f" after {self.grace_s:g}s"
        self._reported = True
        if self.fail:
            raise EarlyExit(f"{line}; stopping the job (--fail-on-early-exit)")
        print(f"{line}; waiting for them (--fail-on-early-exit would stop the job)", file=sys.stderr, flush=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class WatchedAgent(LocalElasticAgent):
    """torchrun's local agent, with `FinishedRanksWatch` on every monitor pass that found the group healthy."""

    def __init__(self, *args, watch: FinishedRanksWatch, **kwargs):
        super().__init__(*args, **kwargs)
        self._watch = watch

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            self._watch.check(worker_group)
        return result


@contextlib.contextmanager
def watched_agent(grace_s: float, fail: bool) -> Iterator[None]:
    """Within this block, torchrun's `launch_agent` (what `torch.distributed.run.run` calls)
    builds a `WatchedAgent`; it names its agent class in one place, its module's global."""
    from torch.distributed.launcher import api

    # Replaced through the module's dict: the global is a class to the checker, and a factory of
    # `WatchedAgent`s takes its place here (launch_agent only calls it).
    module_globals = vars(api)
    original = module_globals["LocalElasticAgent"]
    module_globals["LocalElasticAgent"] = functools.partial(WatchedAgent, watch=FinishedRanksWatch(grace_s, fail))
    try:
        yield
    finally:
        module_globals["LocalElasticAgent"] = original
