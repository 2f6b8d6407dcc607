"""`nanoddp run`'s workers live and die with their launcher: SIGTERM and Ctrl-C stop them with one
line and exit 128 + signal, a SIGKILLed launcher takes them along (its temp dir is swept by the
next start), and a rank that finished while the others run on is named after a grace period.

Each test starts `python -m nanoddp.run` in its own session with a private TMPDIR (forked from the
tests' fork server, `run_training`'s `forked_child`; its workers are torchrun's fresh interpreters),
reads the workers' pids from the files the script writes, and kills every process it started in a
`finally`, whatever the outcome."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from nanoddp.bench.training_run import forked_child

START_TIMEOUT_S = 180  # two workers importing torch and joining the group, on a loaded machine
STOP_TIMEOUT_S = 60

LOOP = """
import os, sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
pid_dir = sys.argv[1]
open(os.path.join(pid_dir, f"rank{rank}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(pid_dir, f"rank{rank}.tmp"), os.path.join(pid_dir, f"rank{rank}.pid"))
mode = sys.argv[2] if len(sys.argv) > 2 else "loop"
if mode == "finish-rank-0" and rank == 0:
    sys.exit(0)  # leaves rank 1 running on alone
if mode == "finish-rank-0":
    time.sleep(3600)
value = torch.ones(1)
while True:
    dist.all_reduce(value)
    time.sleep(0.05)
"""


class Launch:
    """`python -m nanoddp.run --nproc 2 ARGS loop.py PIDDIR [MODE]`, its output (stdout and stderr:
    the script prints nothing) read line by line as it comes."""

    def __init__(self, tmp_path: Path, args: list[str], mode: str = "loop", name: str = "run"):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir(exist_ok=True)
        self.pid_dir = tmp_path / f"pids-{name}"
        self.pid_dir.mkdir()
        script = tmp_path / "loop.py"
        script.write_text(textwrap.dedent(LOOP))
        self.proc = forked_child(
            [sys.executable, "-m", "nanoddp.run", "--nproc", "2", *args, str(script), str(self.pid_dir), mode],
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp)},
        )
        self._lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.workers: list[psutil.Process] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._lines)

    def wait_for_workers(self) -> list[psutil.Process]:
        """Both workers' processes, once each has joined the group and written its pid."""
        deadline = time.monotonic() + START_TIMEOUT_S
        files = [self.pid_dir / f"rank{rank}.pid" for rank in (0, 1)]
        while not all(f.exists() for f in files):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                pytest.fail(f"launcher exited {code} before its workers started:\n{self.stderr[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"workers not started after {START_TIMEOUT_S}s:\n{self.stderr[-3000:]}")
            time.sleep(0.1)
        self.workers = [psutil.Process(int(f.read_text())) for f in files]
        return self.workers

    def wait_for_stderr(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            if time.monotonic() > deadline:
                pytest.fail(f"{text!r} not on stderr after {timeout}s:\n{self.stderr[-3000:]}")
            time.sleep(0.1)

    def kill_all(self) -> None:
        """SIGKILL the launcher and every worker still there (the test's own cleanup)."""
        for proc in self.workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def assert_gone(workers: list[psutil.Process], timeout: float = STOP_TIMEOUT_S) -> None:
    _, alive = psutil.wait_procs(workers, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"workers still running {timeout}s after their launcher stopped: {alive}"


def leftovers(tmp: Path) -> list[str]:
    # torchinductor_<user> is torch's per-user kernel cache, shared by all runs and meant to stay
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_workers_with_one_line_and_128_plus_signal(tmp_path, sig):
    run = Launch(tmp_path, [])
    try:
        workers = run.wait_for_workers()
        before = len(run.stderr.splitlines())  # the `nanoddp: torchrun ...` line
        run.proc.send_signal(sig)
        code = run.proc.wait(timeout=STOP_TIMEOUT_S)
        assert_gone(workers)
        lines = run.stderr.splitlines()[before:]
        assert lines == [f"nanoddp run: stopped by {sig.name}"], "\n".join(lines)[-3000:]
        assert code == 128 + sig, run.stderr[-3000:]
        assert leftovers(run.tmp) == []
    finally:
        run.kill_all()


@pytest.mark.timeout(600)
def test_sigkilled_launcher_takes_its_workers_and_its_dir_is_swept_next_start(tmp_path):
    run = Launch(tmp_path, [])
    live_dir = run.tmp / f"nanoddp-run-{os.getpid()}-live"  # a live process's dir: never touched
    live_dir.mkdir()
    try:
        workers = run.wait_for_workers()
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(timeout=STOP_TIMEOUT_S)
        assert_gone(workers)
        stale = [name for name in leftovers(run.tmp) if name.startswith(f"nanoddp-run-{run.proc.pid}-")]
        assert len(stale) == 1, leftovers(run.tmp)  # no finally ran: its dir stays, named by its pid
    finally:
        run.kill_all()
    second = Launch(tmp_path, [], name="second")
    try:
        second.wait_for_workers()
        names = leftovers(second.tmp)
        assert stale[0] not in names and live_dir.name in names, names
    finally:
        second.kill_all()


@pytest.mark.timeout(420)
def test_rank_that_finished_early_is_named_after_the_grace_period(tmp_path):
    run = Launch(tmp_path, ["--finished-grace", "2"], mode="finish-rank-0")
    try:
        workers = run.wait_for_workers()
        line = "nanoddp run: rank 0 finished (exit code 0) but rank 1 still running after 2s"
        run.wait_for_stderr(line, timeout=120)
        assert run.proc.poll() is None and workers[1].is_running()  # without --fail-on-early-exit it waits
        assert len([x for x in run.stderr.splitlines() if x.startswith("nanoddp run: ")]) == 1, run.stderr[-3000:]
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=STOP_TIMEOUT_S) == 128 + signal.SIGTERM
        assert_gone(workers)
    finally:
        run.kill_all()


@pytest.mark.timeout(420)
def test_fail_on_early_exit_stops_the_job(tmp_path):
    run = Launch(tmp_path, ["--finished-grace", "2", "--fail-on-early-exit"], mode="finish-rank-0")
    try:
        workers = run.wait_for_workers()
        code = run.proc.wait(timeout=120)
        assert_gone(workers)
        assert code == 1, run.stderr[-3000:]
        summary = [x for x in run.stderr.splitlines() if x.startswith("nanoddp run: ")]
        assert summary == [
            "nanoddp run: rank 0 finished (exit code 0) but rank 1 still running after 2s; "
            "stopping the job (--fail-on-early-exit)"
        ], run.stderr[-3000:]
        assert leftovers(run.tmp) == []
    finally:
        run.kill_all()
