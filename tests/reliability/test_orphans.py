"""Nothing outlives its launcher: SIGKILL the launcher of `nanoddp run`, `nanoddp train` or
`nanoddp.launch` and every process of its job goes too, the ranks' own children included, and so
do ranks that were still starting (importing torch) when the launcher died.

SIGKILL runs no cleanup in the launcher, so whatever ends the job has to be arranged beforehand.
Each test marks its job with a unique environment variable, which every process the job starts
inherits, and finds the job's processes by it among all processes of the machine (psutil): a
grandchild re-parented away from the launcher's tree is found too. Whatever is left is killed
at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from probes.orphans import LAUNCH_SCRIPT, RUN_SCRIPT, SITECUSTOMIZE, SPAWNING_LAUNCH_SCRIPT  # noqa: E402  (the probes' jobs, one copy)

MARK = "NANODDP_ORPHAN_TEST"
START_TIMEOUT_S = 90  # two ranks importing torch and joining the group, on a loaded 2-core machine
GONE_WITHIN_S = 15  # running ranks: the kernel's death signal, then their guards sweep
STARTING_GONE_WITHIN_S = 60  # ranks still importing torch notice the dead launcher once through

TINY_TRAIN = [
    "--nproc", "2", "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2",
    "--n-heads", "2", "--d-ff", "64", "--batch-size", "8", "--steps", "100000", "--warmup-steps", "1",
    "--log-every", "1", "--snapshot-every", "0", "--eval-every", "0", "--no-progress",
]  # fmt: skip


def _marked(token: str) -> list[psutil.Process]:
    """Every live process of the machine whose environment carries this job's mark."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or not ours to read
            if proc.environ().get(MARK) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    shown = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            shown.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:100]}")
    return shown


class Job:
    """A launcher in its own session, its output in a file, its job marked by a unique token."""

    def __init__(self, tmp_path: Path, argv: list[str], env: dict[str, str] | None = None):
        self.token = uuid.uuid4().hex
        self.ready_dir = tmp_path / "ready"
        self.ready_dir.mkdir()
        self.log = tmp_path / "launcher.log"
        scratch = tmp_path / "tmp"  # the temp dirs a SIGKILLed launcher leaves (the next start's to sweep)
        scratch.mkdir()
        environ = {**os.environ, **(env or {}), MARK: self.token, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environ
            )

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"{what} did not happen (launcher exit {self.proc.poll()}):\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.05)

    def ranks_ready(self) -> bool:
        return all((self.ready_dir / f"rank{rank}.pid").exists() for rank in (0, 1))

    def kill_launcher(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def left_after(self, within: float) -> list[str]:
        """What of the job is still running once `within` seconds have passed (sooner if nothing)."""
        deadline = time.monotonic() + within
        while (left := _marked(self.token)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return _describe(left)

    def kill_all(self) -> None:
        """The test's own cleanup: the launcher's session and every marked process."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for proc in _marked(self.token):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.proc.wait(timeout=30)


def _script(tmp_path: Path, text: str) -> list[str]:
    """The script `text` as a file, and the argument it takes: the directory for ready files."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return [str(path), str(tmp_path / "ready")]


def _sigkill_and_check(job: Job, within: float = GONE_WITHIN_S) -> None:
    before = _describe(_marked(job.token))
    job.kill_launcher()
    left = job.left_after(within)
    assert not left, f"{within:.0f} s after the launcher's SIGKILL still running: {left}; the job was: {before}"


@pytest.mark.timeout(240)
def test_sigkilled_nanoddp_run_takes_the_ranks_children_along(tmp_path):
    job = Job(tmp_path, [sys.executable, "-m", "nanoddp", "run", "--nproc", "2", *_script(tmp_path, RUN_SCRIPT)])
    try:
        job.wait_for(job.ranks_ready, "both ranks starting their child")
        _sigkill_and_check(job)
    finally:
        job.kill_all()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("on_failure", ["restart", "continue"])
def test_sigkilled_nanoddp_train_takes_the_workers_children_along(tmp_path, on_failure):
    """Both launch paths fork their ranks from a fork server (torchrun's workers, the replicas):
    the server, the ranks and what each rank started all go with the launcher."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "nanoddp", "train", *TINY_TRAIN, "--on-failure", on_failure, "--out", str(out)]
    job = Job(tmp_path, argv, env={"PYTHONPATH": pythonpath})
    log = out / "logs" / "rank0.log" if on_failure == "restart" else job.log

    def sleeping() -> list[psutil.Process]:
        return [p for p in _marked(job.token) if p.name() == "sleep"]

    try:
        job.wait_for(lambda: log.is_file() and "step " in log.read_text(), "a step")
        job.wait_for(lambda: len(sleeping()) == 2, "one child per rank", timeout=30)
        _sigkill_and_check(job)
    finally:
        job.kill_all()


@pytest.mark.timeout(240)
def test_sigkilled_launch_takes_the_ranks_children_along(tmp_path):
    job = Job(tmp_path, [sys.executable, *_script(tmp_path, LAUNCH_SCRIPT)])
    try:
        job.wait_for(job.ranks_ready, "both ranks starting their child")
        _sigkill_and_check(job)
    finally:
        job.kill_all()


def _spawned_ranks(job: Job) -> int:
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(job.proc.pid).children()
        return sum("spawn_main" in " ".join(child.cmdline()) for child in children)
    return 0


@pytest.mark.timeout(240)
def test_launch_killed_while_its_ranks_start_leaves_no_rank(tmp_path):
    job = Job(tmp_path, [sys.executable, *_script(tmp_path, SPAWNING_LAUNCH_SCRIPT)])
    try:
        job.wait_for(lambda: _spawned_ranks(job) == 2, "both ranks spawned")
        assert not any(job.ready_dir.iterdir())  # still starting: importing torch, no group yet
        _sigkill_and_check(job, within=STARTING_GONE_WITHIN_S)
    finally:
        job.kill_all()


GUARDED = """
import os, signal, sys, time
from nanoddp.base import processes
os.setsid()
signal.signal(signal.SIGINT, lambda *_: None)  # a handler, not SIG_IGN: exec resets it, so the guard gets no help
processes.take_descendants_along()
guard = processes._guards[os.getpid()]
os.killpg(0, signal.SIGINT)  # at once: the guard's interpreter is still starting
time.sleep(1.0)
print(guard.poll(), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_ctrl_c_sent_while_the_guard_starts_neither_kills_it_nor_prints():
    """Ctrl-C reaches a rank's whole group, its guard included; the stop is the rank's to handle."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GUARDED)], capture_output=True, text=True, timeout=50, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None"], proc.stdout  # the guard still runs
    assert proc.stderr == ""
