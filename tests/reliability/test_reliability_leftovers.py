"""No leftovers: the notebook's socket dir, `launch`'s and the agent's temp dirs and namespace
hosts do not outlive a killed process for longer than the next start. (That `bench restarts` and
the runs it starts remove every temp dir, theirs and torchelastic's, is checked by
tests/multiproc/test_torchrun.py's kill trial.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from nanoddp import fork_server, launch, tempdirs
from nanoddp.notebook import handshake

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
    # launch removed its own; the fork server's dir, if this launch started it, is this process's
    # for its life (removed at exit, or swept by the next start after a kill)
    server_dir = f"{fork_server.SCRATCH_PREFIX}{os.getpid()}-"
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(server_dir))
    assert left == sorted([live.name, made.name])


WAN_TRAIN_ARGS = "--d-model 32 --n-layers 1 --n-heads 2 --d-ff 64 --text-max-bytes 20000 --batch-size 4 --seq-len 16"


@pytest.mark.timeout(300)
def test_sigterm_stops_bench_wan_with_one_line_and_no_process_namespace_or_temp_dir_left(tmp_path):
    """SIGTERM reaches `nanoddp bench wan --link netns` while its first training runs in two
    namespace hosts: it ends those runs, removes the hosts and its temp dir, says so in one line
    and exits 128 + SIGTERM (a scheduler's stop, not a crash)."""
    from nanoddp.bench.netns_hosts import NAME_PREFIX, shaping_unavailable_reason

    if shaping_unavailable_reason() is not None:
        pytest.skip(f"shaped namespace hosts: {shaping_unavailable_reason()}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "nanoddp", "bench", "wan", "--link", "netns", "--steps", "400", "--no-unshaped",
            "--train-args", WAN_TRAIN_ARGS, "--json", str(tmp_path / "wan.json")]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"})  # fmt: skip
    started: list[psutil.Process] = []
    try:
        me = psutil.Process(bench.pid)
        deadline = time.monotonic() + 200
        while not any("train" in " ".join(p.cmdline()) for p in _alive(started)):  # a run of it is training
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "bench wan started no training run in 200 s"
            time.sleep(0.2)
            started = me.children(recursive=True)
        ours = [name for name in _netns() if name.startswith(f"{NAME_PREFIX}{bench.pid}-")]
        assert len(ours) == 2, _netns()
        bench.send_signal(signal.SIGTERM)
        out, err = bench.communicate(timeout=120)
        assert err.splitlines()[-1:] == ["nanoddp bench wan: stopped by SIGTERM"], err[-2000:]
        assert bench.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert not set(ours) & set(_netns())
        assert _alive(started) == []
        assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []
        assert not (tmp_path / "wan.json").exists()  # no report of a run that did not finish
    finally:
        for proc in [*_alive(started), *([] if bench.poll() is not None else [psutil.Process(bench.pid)])]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        bench.wait(timeout=30)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _netns() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.split()]


@pytest.mark.timeout(120)
def test_namespace_hosts_left_by_a_killed_maker_are_removed_by_the_next_one():
    """A maker SIGKILLed mid-`close()` can leave a namespace named by its (dead) pid, or only its
    bridge (namespaces deleted, bridge not yet): the next `NetnsHosts()` removes both, and leaves
    a live maker's fabric alone."""
    from nanoddp.bench.netns_hosts import BRIDGE_PREFIX, NAME_PREFIX, NetnsHosts, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"namespace hosts: {unavailable_reason()}")
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale_netns = f"{NAME_PREFIX}{dead.pid}-d0d0d0-0"
    stale_bridge, orphan_bridge = f"{BRIDGE_PREFIX}d0d0d0", f"{BRIDGE_PREFIX}e1e1e1"
    subprocess.run(["ip", "netns", "add", stale_netns], check=True, timeout=30)
    try:
        for bridge in (stale_bridge, orphan_bridge):
            subprocess.run(["ip", "link", "add", "name", bridge, "type", "bridge"], check=True, timeout=30)
        with NetnsHosts(1) as live, NetnsHosts(1) as next_one:  # its start sweeps
            assert not {stale_netns} & set(_netns()) and live.names[0] in _netns()
            assert _bridges() & {stale_bridge, orphan_bridge, live.bridge, next_one.bridge} == {
                live.bridge,
                next_one.bridge,
            }
        assert live.bridge not in _bridges()
    finally:
        subprocess.run(["ip", "netns", "del", stale_netns], capture_output=True, timeout=30)
        for bridge in (stale_bridge, orphan_bridge):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def _bridges() -> set[str]:
    listed = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, timeout=30)
    return {line.split(":")[1].strip() for line in listed.stdout.splitlines()}
