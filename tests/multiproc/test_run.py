"""`nanoddp run SCRIPT`: user scripts on torchrun's agent, with rank prefixes, a failure summary,
restarts and the hang watchdog on torch.distributed's collectives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from nanoddp.bench.training_run import forked_child
from nanoddp.comm.transport.watchdog import HANG_EXIT_CODE
from nanoddp.run.command import main as run_main

PREAMBLE = """
import os, signal, sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
"""

SCRIPTS = {
    "all_reduce.py": """
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        expected = torch.tensor([float(sum(range(1, world_size + 1)))])
        reference = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(reference, torch.tensor([float(rank + 1)]))
        positional = torch.ones(1)
        dist.all_reduce(positional, dist.ReduceOp.SUM, None, False)  # group and async_op passed positionally
        print(f"all_reduce = {value.item():g}, sum of all_gather = {sum(reference).item():g}, argv {sys.argv[1:]}")
        print(f"positional all_reduce = {positional.item():g}")
    """,
    "crash.py": """
        dist.barrier()
        if rank == 1:
            raise ValueError("bad batch shape (3, 7) on purpose")
        time.sleep(120)  # rank 0 waits until the agent stops it
    """,
    "killed_once.py": """
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        print(f"attempt {attempt}: all_reduce = {value.item():g}")
        dist.destroy_process_group()
    """,
    "late_callback.py": """
        import nanoddp.comm
        from nanoddp.comm.transport.runner import EXIT_JOIN_S
        nanoddp.comm.all_reduce(torch.ones(4), async_op=True).wait()  # starts nanoddp's runner thread
        dist.barrier()
        def late(future):  # on gloo's worker thread, asleep past the script's end and the exit
            time.sleep(EXIT_JOIN_S + 3)  # hook's join bound (a runner that never ends can't hide)
            print("late callback done", flush=True)
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.get_future().then(late)
        del work
        dist.destroy_process_group()
        print("script done", flush=True)
    """,
    "skips_collective.py": """
        value = torch.ones(4)
        dist.all_reduce(value)  # #1: both ranks
        if rank != 1:
            dist.all_reduce(value)  # #2: rank 1 never arrives
        time.sleep(600)  # rank 1 is "stuck elsewhere"
    """,
}


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(PREAMBLE + textwrap.dedent(SCRIPTS[name]))
    return path


def nanoddp_run(args: list[str], timeout: float) -> tuple[int, str]:
    """`python -m nanoddp.run ARGS` in its own session, forked from the fork server (its imports
    shared); past `timeout`, kill every descendant."""
    proc = forked_child([sys.executable, "-m", "nanoddp.run", *args], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):  # torchrun's workers have own sessions
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"nanoddp run timed out after {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> str:
    """One `nanoddp run` of a script that ends well: all_reduce.py, then late_callback.py."""
    path = _write(tmp_path_factory.mktemp("clean_run"), "all_reduce.py")
    path.write_text(path.read_text() + textwrap.dedent(SCRIPTS["late_callback.py"]))
    code, out = nanoddp_run(["--nproc", "2", str(path), "--lr", "3e-4"], timeout=220)
    assert code == 0, out[-3000:]
    return out


@pytest.mark.timeout(240)
def test_all_reduce_script_with_rank_prefixes(clean_run):
    out = clean_run
    for rank in (0, 1):  # torch's own all_gather is the reference for the sum
        assert f"[rank {rank}] all_reduce = 3, sum of all_gather = 3, argv ['--lr', '3e-4']" in out, out[-3000:]
        assert f"[rank {rank}] positional all_reduce = 2" in out


@pytest.mark.timeout(240)
def test_crash_on_rank_1_is_summarised(tmp_path):
    code, out = nanoddp_run(["--nproc", "2", str(_write(tmp_path, "crash.py"))], timeout=220)
    assert code == 1, out[-3000:]
    summary = [line for line in out.splitlines() if line.startswith("nanoddp run: ")]
    assert len(summary) == 1, out[-3000:]
    assert "crash.py failed on rank 1 (exit code 1): ValueError: bad batch shape (3, 7) on purpose" in summary[0]
    assert "[rank 1] ValueError: bad batch shape" in out  # the traceback, prefixed


@pytest.mark.timeout(300)
def test_sigkilled_worker_restarts_and_finishes(tmp_path):
    script = str(_write(tmp_path, "killed_once.py"))
    code, out = nanoddp_run(["--nproc", "2", "--max-restarts", "1", script], timeout=280)
    assert code == 0, out[-3000:]
    assert "[rank 0] attempt 1: all_reduce = 2" in out and "[rank 1] attempt 1: all_reduce = 2" in out, out[-3000:]
    assert "attempt 0: all_reduce" not in out  # rank 1 died first, so rank 0 waited in all_reduce
    code, out = nanoddp_run(["--nproc", "2", script], timeout=220)  # no restarts allowed: the kill is reported
    assert code == 1 and "killed_once.py failed on rank 1 (exit code -9): killed by SIGKILL" in out, out[-3000:]


@pytest.mark.timeout(240)
def test_gloo_thread_taking_the_gil_after_the_script_ends_does_not_abort(clean_run):
    """nanoddp's runner thread used to keep the destroyed group, and so gloo's threads, alive
    into interpreter finalization, where a gloo thread taking the GIL is killed mid-C++ and the
    process aborts ("terminate called without an active exception", exit -6), 2 of 2 runs. The
    group must be freed, gloo's threads joined, while Python is still alive, as torch alone does.
    (The run is shared with the all-reduce test: its script ends with late_callback.py.)"""
    out = clean_run
    assert "terminate called" not in out, out[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] script done" in out and f"[rank {rank}] late callback done" in out, out[-3000:]


@pytest.mark.timeout(240)
def test_watchdog_names_the_rank_that_skipped_a_collective(tmp_path):
    script = str(_write(tmp_path, "skips_collective.py"))
    code, out = nanoddp_run(["--nproc", "2", "--collective-timeout", "4", script], timeout=220)  # rank 1 sleeps 600 s
    assert code == 1, out[-3000:]
    assert "[rank 0] collective hang on rank 0: all_reduce #2" in out, out[-3000:]
    assert "not arrived: ranks [1] (rank 1 at #1)" in out
    summary = next(line for line in out.splitlines() if line.startswith("nanoddp run: "))
    assert f"failed on rank 0 (exit code {HANG_EXIT_CODE}): CollectiveHang: collective hang on rank 0" in summary
    assert "timeout 4s" in summary


def test_bad_input_fails_before_launch(tmp_path, capsys):
    """In this process (`python -m nanoddp.run` is this `main`; the tests above run it as a
    command, whose exit code is its return value): each refusal is exit code 2 and its message."""

    def refused(args: list[str]) -> str:
        assert run_main(args) == 2, args
        return capsys.readouterr().err

    assert "--nproc must be >= 1, got 0" in refused(["--nproc", "0", str(_write(tmp_path, "crash.py"))])
    out = refused([str(tmp_path / "missing.py")])
    assert "script" in out and "missing.py' not found" in out
    out = refused(["--collective-timeout", "0", str(_write(tmp_path, "crash.py"))])
    assert "--collective-timeout must be > 0 seconds, got 0.0" in out
