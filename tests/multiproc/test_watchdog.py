"""The hang watchdog names the stuck collective and the missing ranks, then exits."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import LaunchError, comm
from nanoddp.comm.transport import link, watchdog

TIMEOUT_S = 3.0


def _one_rank_skips_second_all_reduce(env, log_dir):
    logging.basicConfig(filename=str(Path(log_dir, f"rank{env.rank}.log")), level=logging.INFO, force=True)
    Path(log_dir, f"pid{env.rank}").write_text(str(__import__("os").getpid()))
    watchdog.enable(TIMEOUT_S, poll_s=0.2)
    t = torch.ones(10)
    with watchdog.track("all_reduce", t.numel()):
        dist.all_reduce(t)  # everyone joins: no report
    assert t[0].item() == env.world_size
    time.sleep(1.0)  # let progress #1 be published by every rank
    if env.rank == 1:
        time.sleep(120)  # the bug: rank 1 never joins the second all_reduce
    with watchdog.track("all_reduce", 1000):
        dist.all_reduce(torch.ones(1000))
    return "not reached"


def test_hang_is_reported_with_op_and_missing_rank(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_on_ranks(_one_rank_skips_second_all_reduce, 3, str(tmp_path), timeout=90)
    # The watchdog's exit code proves it ended the run: rank 1 sleeps 120 s, past the launch's
    # 90 s bound, so a missed hang would surface as a timeout instead. No wall-clock assertion:
    # on a loaded 2-core machine start-up alone can take tens of seconds.
    assert info.value.rank in (0, 2) and info.value.exitcode == watchdog.HANG_EXIT_CODE
    report = Path(tmp_path, f"rank{info.value.rank}.log").read_text()
    assert "all_reduce #2 (1000 elements, group [0, 1, 2])" in report
    assert "arrived: ranks [0, 2]; not arrived: ranks [1] (rank 1 at #1)" in report
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 3
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def _rank_1_skips_a_collective(env, log_dir, backend):
    """No explicit `track`: nanoddp.comm and the watched torch collectives register themselves."""
    from nanoddp.comm.api.backend import collectives_for

    collectives = collectives_for(backend)
    logging.basicConfig(filename=str(Path(log_dir, f"rank{env.rank}.log")), level=logging.INFO, force=True)
    watchdog.enable(TIMEOUT_S, poll_s=0.2)
    collectives.all_reduce(torch.ones(10))
    collectives.all_reduce(torch.ones(10), async_op=True).wait()  # async ones end at wait()
    time.sleep(1.0)
    if env.rank == 1:
        time.sleep(120)
    collectives.broadcast(torch.ones(70_000), src=0)
    return "not reached"


@pytest.mark.parametrize("backend", ["nanoddp", "torch"])
def test_engine_collectives_are_watched_without_explicit_tracking(tmp_path, backend):
    with pytest.raises(LaunchError) as info:
        run_on_ranks(_rank_1_skips_a_collective, 2, str(tmp_path), backend, timeout=90)
    assert info.value.rank == 0 and info.value.exitcode == watchdog.HANG_EXIT_CODE
    report = Path(tmp_path, "rank0.log").read_text()
    assert "broadcast #3 (70000 elements, group [0, 1])" in report, report
    assert "not arrived: ranks [1] (rank 1 at #2)" in report, report


def _all_reduce_over_a_slow_link(env, log_dir):
    """Both ranks join, but 1 MB over a 200 kbit/s simulated link takes 20 to 40 s (by the plan's path)."""
    logging.basicConfig(filename=str(Path(log_dir, f"rank{env.rank}.log")), level=logging.INFO, force=True)
    os.environ[link.BANDWIDTH_VAR] = "200kbit"  # read as a user's shell sets it: when the group is first used
    watchdog.enable(TIMEOUT_S, poll_s=0.2)
    comm.all_reduce(torch.ones(250_000))
    return "not reached"


def test_hang_on_a_slow_link_names_the_link(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_on_ranks(_all_reduce_over_a_slow_link, 2, str(tmp_path), timeout=90)
    assert info.value.exitcode == watchdog.HANG_EXIT_CODE
    report = Path(tmp_path, f"rank{info.value.rank}.log").read_text()
    assert "arrived: ranks [0, 1]; not arrived: ranks [] (none)." in report, report
    held = (
        r"The simulated slow link is the wait, not a rank: it still holds \d+ message\(s\) \((0\.5|1) MB\) of this rank"
    )
    assert re.search(
        held + r", the last due in \d+s \(NANODDP_LINK_BANDWIDTH/NANODDP_LINK_LATENCY: 0.2 Mbit/s, 0 ms\)", report
    )
    assert "stuck elsewhere" not in report, report


def test_watchdog_rejects_bad_timeout():
    with pytest.raises(ValueError, match="collective timeout must be > 0 seconds, got 0"):
        watchdog.CollectiveWatchdog(0, store=dist.HashStore())


def _async_all_reduce_finished_by_polling(env, log_dir):
    """torch's async all_reduce, finished by polling `is_completed()` and never waited on, must
    leave the watchdog's in-flight set: the job goes on past the timeout without a hang report."""
    watchdog.enable(TIMEOUT_S, poll_s=0.2)
    t = torch.ones(10)
    work = watchdog.TORCH_COLLECTIVES.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "all_reduce never completed"
        time.sleep(0.01)
    time.sleep(TIMEOUT_S + 2.0)  # a token still held would be reported (and the rank killed) by now
    in_flight = len(watchdog.active()._in_flight)
    watchdog.TORCH_COLLECTIVES.all_reduce(torch.ones(1))  # the ranks are still in step
    return t[0].item(), in_flight


def test_async_torch_collective_released_when_it_completes(tmp_path):
    results = run_on_ranks(_async_all_reduce_finished_by_polling, 2, str(tmp_path), timeout=90)
    assert results == [(2.0, 0), (2.0, 0)]
