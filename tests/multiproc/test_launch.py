"""nanoddp.launch: results come back; any failure stops every rank and names the culprit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks

from nanoddp import LaunchError


def _rank_times_ten(env, offset):
    t = torch.tensor([env.rank * 10 + offset])
    dist.broadcast(t, src=0)
    return env.rank * 10 + offset, t.item(), env.world_size


@pytest.mark.parametrize("world_size", [1, 3])
def test_launch_returns_every_rank_result(world_size):
    results = run_on_ranks(_rank_times_ten, world_size, 5)
    assert results == [(r * 10 + 5, 5, world_size) for r in range(world_size)]


def _record_pid_then_fail(env, pid_dir, how):
    Path(pid_dir, str(env.rank)).write_text(str(os.getpid()))
    if env.rank == 1:
        time.sleep(0.5)  # let the others reach their blocking collective first
        if how == "raise":
            raise ValueError("bad batch on rank 1")
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the healthy ranks block here, as they would in a real job
    time.sleep(60)


@pytest.mark.parametrize(
    "how, message",
    [
        ("raise", "rank 1 failed: ValueError: bad batch on rank 1"),
        ("exit", "rank 1 failed: exited with code 3"),
        ("sigkill", "rank 1 failed: killed by SIGKILL"),
    ],
)
def test_failed_rank_stops_all_and_leaves_no_process(tmp_path, how, message):
    # The healthy ranks sleep 60 s past the barrier and the launch is bounded at 60 s, so a launcher
    # that waited for them instead of stopping them would raise TimeoutError, not LaunchError. No
    # wall-clock assertion beyond that: on a loaded 2-core machine start-up alone varies by tens of s.
    with pytest.raises(LaunchError) as info:
        run_on_ranks(_record_pid_then_fail, 3, str(tmp_path), how, timeout=60)
    assert message in str(info.value)
    assert info.value.rank == 1
    if how == "raise":
        assert "Traceback" in info.value.details and "_record_pid_then_fail" in info.value.details
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 3
    leftover = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert leftover == []


def _sleep_forever(env):
    time.sleep(600)


def test_launch_timeout_stops_children():
    with pytest.raises(TimeoutError, match=r"launch timed out after 3s; ranks \[0, 1\] still running"):
        run_on_ranks(_sleep_forever, 2, timeout=3)
    # the spawned ranks are python processes running multiprocessing's spawn entry point
    assert [c for c in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(c.cmdline())] == []


def test_launch_rejects_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        run_on_ranks(_sleep_forever, 0)
