"""No leftovers: `bench restarts` and the runs it starts remove every temp dir (theirs and
torchelastic's), and the notebook's socket dir, `launch`'s and the agent's temp dirs do not
outlive a killed process for longer than the next start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from nanoddp import launch, tempdirs
from nanoddp.notebook import handshake


@pytest.mark.timeout(900)
def test_bench_restarts_leaves_an_empty_temp_dir(tmp_path):
    """One kill trial (a reference run, a killed and restarted run) with a private TMPDIR: every
    temp dir the bench, the agents (torchelastic's log dirs) and the workers made is gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nanoddp", "bench", "restarts", "--trials", "1", "--cost-trials", "0",
         "--max-delay", "0.5", "--json", str(report)],
        capture_output=True, text=True, timeout=850, env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads(report.read_text())["passed"] == 1
    # torchinductor_<user> is torch's per-user kernel cache, shared by all runs and meant to stay
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], left


KERNEL = """
import sys
from nanoddp.notebook.pool import WorkerPool
pool = WorkerPool(1, "gloo", ["cpu"], num_threads=1, pg_timeout_s=60)
pool.start(timeout_s=120)
print(pool._dir, *pool.pids(), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.timeout(240)
def test_socket_dir_of_a_killed_kernel_is_removed_by_the_next_start(tmp_path, monkeypatch):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    try:
        socket_dir, worker_pid = kernel.stdout.readline().split()
        assert Path(socket_dir).parent == tmp_path and Path(socket_dir).is_dir()
        kernel.send_signal(signal.SIGKILL)  # no atexit, no cleanup: the dir stays behind
        kernel.wait(timeout=30)
        psutil.wait_procs([psutil.Process(int(worker_pid))], timeout=10)  # dies with its parent
        assert Path(socket_dir).is_dir()
        live = Path(tempfile.mkdtemp(prefix=f"{handshake.DIR_PREFIX}{os.getpid()}-", dir=tmp_path))
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        handshake.remove_stale_dirs()  # what WorkerPool.start does first
        assert not Path(socket_dir).exists()
        assert live.is_dir()  # a live kernel's dir is left alone
    finally:
        kernel.kill()
        kernel.wait()


DEEP_KERNEL = """
import os
from nanoddp.notebook.pool import WorkerPool
pool = WorkerPool(2, "gloo", ["cpu", "cpu"], num_threads=1, pg_timeout_s=60)
pool.start(timeout_s=120)
socket_dir = pool._dir
print(socket_dir, flush=True)
pool.shutdown()
print(os.path.exists(socket_dir), flush=True)
"""


@pytest.mark.timeout(240)
def test_a_temp_dir_too_deep_for_a_unix_socket_still_starts_the_pool(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # a socket path under it would pass Linux's 107 bytes
    deep.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", DEEP_KERNEL], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "TMPDIR": str(deep)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    socket_dir, exists_after = proc.stdout.split()
    assert Path(socket_dir).parent == Path(handshake.SHORT_TEMP)  # the short fallback, not the deep dir
    assert exists_after == "False"  # and it is removed at shutdown


def _noop(env) -> int:
    return env.rank


@pytest.mark.timeout(120)
def test_dirs_of_killed_runs_are_removed_by_the_next_one(tmp_path, monkeypatch):
    """SIGKILL skips a run's own cleanup: `nanoddp.launch` and the `nanoddp train` agent name their
    temp dirs by pid, and the next one removes those whose process is gone (a live one's stays)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = [tmp_path / f"{prefix}{dead.pid}-abcd1234" for prefix in ("nanoddp-rdzv-", "nanoddp-torchrun-")]
    live = tmp_path / f"nanoddp-torchrun-{os.getpid()}-live0000"
    for path in [*stale, live]:
        path.mkdir()
    assert launch(_noop, 2) == [0, 1]  # runs in the same temp dir
    assert not stale[0].exists() and stale[1].exists()
    made = Path(tempdirs.make_private_dir("nanoddp-torchrun-"))  # what the agent does at start
    assert not stale[1].exists() and live.is_dir()
    assert made.name.startswith(f"nanoddp-torchrun-{os.getpid()}-") and made.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, made.name])  # launch removed its own
