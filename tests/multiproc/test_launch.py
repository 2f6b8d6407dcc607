"""nanoddp.launch: results come back; any failure stops every rank and names the culprit, with
either start method (the suite's other tests fork their ranks from the fork server)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks, wait_for

import nanoddp
from nanoddp import LaunchError, fork_server
from nanoddp.launch import RANK_PRELOAD

START_METHODS = pytest.mark.parametrize("start_method", ["spawn", "forkserver"])


def _launch(fn, nprocs, *args, start_method, timeout):
    return nanoddp.launch(fn, nprocs, args=args, backend="gloo", timeout=timeout, start_method=start_method)


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


# How a rank fails is the launcher's to tell, whichever way the ranks started: each way under the
# fork server (no torch import per rank), and spawn's ranks once (its own start-up path).
@pytest.mark.parametrize(
    "how, message, start_method",
    [
        ("raise", "rank 1 failed: ValueError: bad batch on rank 1", "forkserver"),
        ("exit", "rank 1 failed: exited with code 3", "forkserver"),
        ("sigkill", "rank 1 failed: killed by SIGKILL", "forkserver"),
        ("sigkill", "rank 1 failed: killed by SIGKILL", "spawn"),
    ],
)
def test_failed_rank_stops_all_and_leaves_no_process(tmp_path, how, message, start_method):
    # The healthy ranks sleep 60 s past the barrier and the launch is bounded at 60 s, so a launcher
    # that waited for them instead of stopping them would raise TimeoutError, not LaunchError. No
    # wall-clock assertion beyond that: on a loaded 2-core machine start-up alone varies by tens of s.
    with pytest.raises(LaunchError) as info:
        _launch(_record_pid_then_fail, 3, str(tmp_path), how, start_method=start_method, timeout=60)
    assert message in str(info.value)
    assert info.value.rank == 1
    if how == "raise":
        assert "Traceback" in info.value.details and "_record_pid_then_fail" in info.value.details
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 3
    leftover = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert leftover == []


def _return_then_fail_leaving(env):
    import nanoddp.env as nd

    if env.rank == 1:
        leave = nd.cleanup

        def cleanup() -> None:
            leave()  # the barrier and the group's end, with rank 0
            raise RuntimeError("failed after leaving the group")

        nd.cleanup = cleanup  # what the launcher's rank calls after reporting its result
    return env.rank


def test_a_rank_that_returns_then_fails_leaving_the_group_is_named():
    """Every rank reported a result, but one then failed in the closing barrier: a LaunchError
    that says so, not a result list with a failed rank behind it (nor a crash of the launcher)."""
    with pytest.raises(LaunchError) as info:
        _launch(_return_then_fail_leaving, 2, start_method="forkserver", timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == 1
    assert "returned its result, then exited with code 1 while leaving the group" in str(info.value)


def _sleep_forever(env, pid_dir=None):
    if pid_dir is not None:
        Path(pid_dir, str(env.rank)).write_text(str(os.getpid()))
    time.sleep(600)


def test_launch_timeout_stops_children(tmp_path):
    # long enough for both (forked) ranks to record their pids on a loaded machine; the ranks then
    # sleep far past it. The timeout and the stop do not depend on how the ranks started.
    timeout = 6
    with pytest.raises(TimeoutError, match=rf"launch timed out after {timeout}s; ranks \[0, 1\] still running"):
        _launch(_sleep_forever, 2, str(tmp_path), start_method="forkserver", timeout=timeout)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"] == []


def _what_the_rank_sees(env):
    # One write per line: print() writes the text and its newline apart, and with unbuffered
    # streams the two ranks' writes interleave ("rank 0 on stdoutrank 1 on stdout") on a busy machine.
    sys.stdout.write(f"rank {env.rank} on stdout\n")
    sys.stdout.flush()
    sys.stderr.write(f"rank {env.rank} on stderr\n")
    sys.stderr.flush()
    return os.environ.get("NANODDP_TEST_SEEN"), os.getcwd(), torch.get_num_threads(), tempfile.gettempdir()


def test_a_forked_rank_sees_the_launchers_environment_directory_and_streams_of_now(tmp_path, capfd, monkeypatch):
    """The fork server started long before (with another test's environment, directory and
    captured streams); its ranks must still see the launcher's as they are at the call, exactly
    as spawned ranks do (TMPDIR included, though the server's tempfile has read it already), and
    take their thread count from OMP_NUM_THREADS as it is now (torch read it when the server
    imported torch)."""
    # The server as a session's first launch starts it, OMP_NUM_THREADS unset: torch's default
    # there is the cores (2 or more), which also cap the setting, so the ranks' 1 comes from here.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    fork_server.start(RANK_PRELOAD)  # one that runs already stays
    seen = {}
    for start_method in ("spawn", "forkserver"):
        work = tmp_path / start_method
        work.mkdir()
        monkeypatch.chdir(work)
        monkeypatch.setenv("NANODDP_TEST_SEEN", start_method)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("TMPDIR", str(work))  # tempfile read it in the server long ago (dynamo's import)
        seen[start_method] = _launch(_what_the_rank_sees, 2, start_method=start_method, timeout=120)
        assert seen[start_method] == [(start_method, str(work), 1, str(work))] * 2
        out, err = capfd.readouterr()
        assert sorted(out.splitlines()) == ["rank 0 on stdout", "rank 1 on stdout"], start_method
        assert sorted(line for line in err.splitlines() if line.startswith("rank")) == [
            "rank 0 on stderr",
            "rank 1 on stderr",
        ], start_method


def _torch_modules_an_optimizer_imports(env) -> list[str]:
    before = set(sys.modules)
    torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    return sorted(name for name in set(sys.modules) - before if name.startswith("torch"))


def test_a_forked_rank_builds_an_optimizer_without_importing_torch_modules():
    """torch imports dynamo at an optimizer's first parameter group: 2.5 s of CPU in every rank,
    restart and replacement, unless the fork server imported it first (every one does)."""
    assert run_on_ranks(_torch_modules_an_optimizer_imports, 1) == [[]]


def test_launch_rejects_bad_nprocs_and_start_methods():
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        run_on_ranks(_sleep_forever, 0)
    with pytest.raises(ValueError, match="start_method must be one of spawn, forkserver, got 'fork'"):
        nanoddp.launch(_sleep_forever, 2, start_method="fork")


LAUNCHER_SCRIPT = """
import os, sys, time
from pathlib import Path
import nanoddp

def rank(env, pid_dir):
    Path(pid_dir, str(env.rank)).write_text(str(os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    nanoddp.launch(rank, 2, args=(sys.argv[2],), backend="gloo", start_method=sys.argv[1])
"""


@START_METHODS
def test_the_ranks_end_with_a_sigkilled_launcher(tmp_path, start_method):
    """With the fork server the ranks' parent is the server, which outlives the launcher as long
    as its children do: the ranks must watch the launcher themselves."""
    script, pid_dir = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER_SCRIPT)
    pid_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, str(script), start_method, str(pid_dir)], start_new_session=True)
    pids: list[int] = []
    try:
        wait_for(lambda: len(list(pid_dir.iterdir())) == 2, deadline=time.monotonic() + 120, step_s=0.1)
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        server = [c.pid for c in psutil.Process(launcher.pid).children() if c.pid not in pids]
        launcher.kill()
        launcher.wait()

        def all_gone():
            return not [p for p in pids + server if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

        wait_for(all_gone, deadline=time.monotonic() + 30, step_s=0.1)
    finally:  # nothing of a failed run is left either
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SERVER_FORKED_FROM_HERE = """
import fcntl, json, multiprocessing, os, sys, tempfile, threading
import torch
import nanoddp
from multiprocessing import forkserver
from nanoddp import fork_server

def rank(env):
    torch.set_num_threads(2)  # an OpenMP pool of the rank's own
    big = torch.ones(256, 256)
    tempfile.tempdir = None  # the rank's temp dir is the default one, not the launcher's deep one
    with multiprocessing.Manager() as manager:  # its socket in multiprocessing's temp dir, as its Process recorded it
        first = dict(manager.dict({env.rank: 1}))
    fork_server.start()  # a fork server of the rank's own, and a Manager forked from it
    with multiprocessing.get_context("forkserver").Manager() as manager:
        return [(big @ big).sum().item(), torch.get_num_threads(), first, dict(manager.dict({env.rank: 2}))]

if __name__ == "__main__":
    lock = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held by this process: never by the server
    tempfile.tempdir = sys.argv[3]  # too deep for a socket's path
    if sys.argv[2] == "with-a-thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    fork_server.start_as_fork(["nanoddp.launch"])
    torch.set_num_threads(2)
    (torch.ones(512, 512) @ torch.ones(512, 512)).sum()  # this process's OpenMP pool, made after the fork
    results = nanoddp.launch(rank, 2, backend="gloo", start_method="forkserver", timeout=120)
    server = forkserver._forkserver._forkserver_pid
    held = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]
    print(json.dumps({"results": results, "server": open(f"/proc/{server}/cmdline").read(),
                      "launcher": open("/proc/self/cmdline").read(), "held": held}))
"""


def test_a_server_forked_from_its_launcher_runs_ranks_that_compute(tmp_path):
    """`fork_server.start_as_fork`: in a launcher that has run nothing yet, the server is a fork
    of it (no second torch import) holding none of its descriptors but its streams and the
    server's own; its ranks compute with OpenMP threads, though the launcher made its own pool
    after the fork, and start Managers and a fork server of their own: multiprocessing's record of
    its temp dir, which a rank's Process copies, names no descriptor of the launcher's (the
    server's socket dir is reached by one) and no dir too deep for a socket. With a thread running
    it starts a fresh interpreter instead, and the rest holds the same."""
    script = tmp_path / "launcher.py"
    script.write_text(SERVER_FORKED_FROM_HERE)
    lock, deep = tmp_path / "lock", tmp_path / ("d" * 80)
    deep.mkdir()
    for mode in ("clean", "with-a-thread"):
        done = subprocess.run([sys.executable, str(script), str(lock), mode, str(deep)], capture_output=True,
                              text=True, timeout=240, start_new_session=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["results"] == [[256.0**3, 2, {"0": 1}, {"0": 2}], [256.0**3, 2, {"1": 1}, {"1": 2}]], seen
        assert (seen["server"] == seen["launcher"]) == (mode == "clean"), seen
        assert str(lock) not in seen["held"], seen
