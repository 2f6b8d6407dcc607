"""`nanoddp.bench.training_run.run_training`: a child training past its deadline is ended with
everything it started, and what it recorded before is still handed back.

The child here is a stand-in for `nanoddp train` (one step record, a grandchild, then a sleep
past the deadline), so the check costs a second, not a training."""

from __future__ import annotations

import signal
import sys

import psutil

from nanoddp.base.records import STEP_FIELDS, read_records
from nanoddp.bench.training_run import run_training

CHILD = """
import subprocess, sys, time
from nanoddp.base.records import RecordWriter, STEP_FIELDS
RecordWriter(sys.argv[1]).write({**dict.fromkeys(STEP_FIELDS), "step": 1, "loss": 2.0, "world_size": 1})
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", grandchild.pid, flush=True)
time.sleep(600)
"""


def test_past_its_deadline_the_tree_is_ended_and_its_records_read(tmp_path):
    def first_line_pid(proc) -> int:
        return int(proc.stdout.readline().split()[1])  # the grandchild, once it runs

    run = run_training([sys.executable, "-c", CHILD, str(tmp_path)], tmp_path, timeout_s=3, during=first_line_pid)
    assert run.returncode == -signal.SIGKILL and "(killed after 3s)" in run.output, run.output
    assert run.records == read_records(tmp_path) == [{**dict.fromkeys(STEP_FIELDS), "step": 1, "loss": 2.0,
                                                      "world_size": 1}]  # fmt: skip
    assert not psutil.pid_exists(run.acted) or psutil.Process(run.acted).status() == psutil.STATUS_ZOMBIE


def test_forked_from_the_fork_server_the_same(tmp_path, monkeypatch):
    """`forked=True` (the tests' launches): the child forked from this process's fork server, and
    everything above holds as for a fresh interpreter."""
    (tmp_path / "stand_in_training.py").write_text(f"import sys\n\ndef main(argv):\n    exec({CHILD!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # where the forked child finds the module

    def first_line_pid(proc) -> int:
        return int(proc.stdout.readline().split()[1])

    command = [sys.executable, "-m", "stand_in_training", str(tmp_path)]
    run = run_training(command, tmp_path, timeout_s=3, during=first_line_pid, forked=True)
    assert run.returncode == -signal.SIGKILL and "(killed after 3s)" in run.output, run.output
    assert run.records == [{**dict.fromkeys(STEP_FIELDS), "step": 1, "loss": 2.0, "world_size": 1}]
    assert not psutil.pid_exists(run.acted) or psutil.Process(run.acted).status() == psutil.STATUS_ZOMBIE
