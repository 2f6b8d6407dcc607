"""`nanoddp train` on torchrun's elastic agent: a SIGKILLed worker is restarted and the run ends
bitwise equal to an uninterrupted one; SIGTERM/SIGINT to the agent stop every rank at one step
with a snapshot, and rerunning ends bitwise equal too; a SIGKILLed agent leaves no worker; two
agents (`--nnodes 2`) train as one job; a crashing worker is summarised in one line per rank.
Loopback only, every launch bounded and killed on timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from nanoddp.bench.training_run import forked_child
from nanoddp.env import free_port
from nanoddp.fork_server import ForkedModule
from nanoddp.train.checkpoint import rundir, snapshot
from nanoddp.train.launcher.agent import train_workers

# GPT tiny on 32-byte windows: ~0.1 s a step on 2 busy cores, so a kill lands mid-run.
TRAIN_ARGS = [
    "--steps", "30", "--snapshot-every", "5", "--seq-len", "32", "--batch-size", "8",
    "--text-max-bytes", "200000", "--log-every", "5", "--eval-every", "0", "--no-progress",
]  # fmt: skip
RUN_TIMEOUT_S = 240


def _nanoddp_train(*args: str) -> ForkedModule:
    """The launcher in a session of its own, its output in one text pipe; forked from the fork
    server, as `run_training(forked=True)` forks it (its imports shared)."""
    return forked_child([sys.executable, "-m", "nanoddp", "train", *TRAIN_ARGS, *args])


def _finish(proc: subprocess.Popen | ForkedModule, timeout: float = RUN_TIMEOUT_S) -> str:
    """Wait for the launcher; on timeout kill its whole session (agent and workers) and fail."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"nanoddp train did not finish in {timeout}s:\n{output[-3000:]}")
    return output


def _finish_together(procs: list[ForkedModule], timeout: float = RUN_TIMEOUT_S) -> list[str]:
    """Wait for launchers that make one job: the moment one fails, or time runs out, kill every
    one's session and fail with all their outputs (waiting on them one by one would spend the whole
    timeout on a node left waiting for a peer that already exited, and hide that peer's output)."""
    outputs: list[str] = [""] * len(procs)

    def read(i: int) -> None:
        outputs[i] = procs[i].communicate()[0]

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    stuck = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in stuck:
        os.killpg(procs[i].pid, signal.SIGKILL)
    for reader in readers:
        reader.join(timeout=30)
    if stuck or any(p.returncode != 0 for p in procs):
        states = ["killed, still running" if i in stuck else f"exit {p.returncode}" for i, p in enumerate(procs)]
        report = "\n".join(f"--- launcher {i}: {state}\n{outputs[i][-3000:]}" for i, state in enumerate(states))
        pytest.fail(f"a launcher of the job failed or did not finish in {timeout}s:\n{report}")
    return outputs


def _workers(launcher: ForkedModule) -> list[psutil.Process]:
    return list(train_workers(psutil.Process(launcher.pid)).values())


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    proc = _nanoddp_train("--nproc", "2", "--out", str(out))
    output = _finish(proc)
    assert proc.returncode == 0, output[-3000:]
    return out


@pytest.mark.timeout(600)
def test_sigkilled_worker_is_restarted_bitwise_and_leaves_no_temp_dir(tmp_path):
    """`nanoddp bench restarts`, one kill trial, on this file's job (`restarts.TRAIN_ARGS` is
    `TRAIN_ARGS` at 2 ranks): a reference run, then the same command under `--max-restarts 3` with
    one worker SIGKILLed after the first snapshot; torchrun's agent restarts the group, the
    trainer resumes from the newest snapshot ("restart 1: resumed from" in its output) and every
    parameter equals the reference's bitwise (the trial's `restarted` and `bit_identical`). With
    a private TMPDIR: every temp dir the bench, the agents (torchelastic's log dirs) and the
    workers made is gone afterwards."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "nanoddp", "bench", "restarts", "--trials", "1", "--cost-trials", "0",
               "--max-delay", "0.5", "--json", str(report)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S,
                          env={**os.environ, "TMPDIR": str(tmp)})  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(report.read_text())
    assert (result["train_args"], result["passed"]) == (["--nproc", "2", *TRAIN_ARGS], 1), result
    trial = result["results"][0]
    assert (trial["returncode"], trial["restarted"], trial["bit_identical"]) == (0, True, True), trial
    # torchinductor_<user> is torch's per-user kernel cache, shared by all runs and meant to stay
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], left


def _wait_for_snapshot(proc: ForkedModule, path: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before the signal"
        time.sleep(0.05)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_agent_snapshots_the_step_and_rerun_is_bit_identical(reference_run, tmp_path, sig):
    """Preemption (SIGTERM) or Ctrl-C (SIGINT): every rank finishes the step, one snapshot at that
    step, one line, exit 128 + signal; the same command again ends bitwise where no stop would
    (rerun after SIGTERM only: past the handler both signals take the one stop path, so a second
    rerun would check the same snapshot code again for a launch's time)."""
    proc = _nanoddp_train("--nproc", "2", "--out", str(tmp_path))
    _wait_for_snapshot(proc, tmp_path / "snapshots" / "step-00000005.pt")
    proc.send_signal(sig)  # the agent only: its workers run in their own sessions
    output = _finish(proc)
    assert proc.returncode == 128 + sig, output[-3000:]
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(
        r"nanoddp: interrupted at step (\d+); snapshot saved; rerun the same command to continue", last
    )
    assert match, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    step = int(match.group(1))
    assert 5 <= step < 30
    path = snapshot.snapshot_path(tmp_path / "snapshots", step)
    assert snapshot.train_state(snapshot.load(path), path)["interrupted"] == sig
    if sig != signal.SIGTERM:
        return
    rerun = _nanoddp_train("--nproc", "2", "--out", str(tmp_path))
    output = _finish(rerun)
    assert rerun.returncode == 0, output[-3000:]
    assert f"resumed from {tmp_path / 'snapshots' / f'step-{step:08d}.pt'}" in output, output[-3000:]
    expected, got = _params(reference_run), _params(tmp_path)
    assert all(torch.equal(value, got[name]) for name, value in expected.items())


@pytest.mark.timeout(300)
def test_sigkilled_agent_leaves_no_worker_alive_and_sockets_are_private(tmp_path):
    proc, workers = _nanoddp_train("--nproc", "2", "--out", str(tmp_path)), []
    try:
        _wait_for_snapshot(proc, tmp_path / "snapshots" / "step-00000005.pt")
        workers = _workers(proc)
        assert len(workers) == 2, workers
        # private by default: the agent's rendezvous store and the workers' store and gloo
        # sockets listen on loopback only, never on *:port
        listening = {c.laddr.ip for p in [psutil.Process(proc.pid), *workers] for c in p.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}  # fmt: skip
        assert listening == {"127.0.0.1"}, listening
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=10)  # PR_SET_PDEATHSIG: the kernel kills them
        assert not alive, alive
        os.close(rundir.lock_run_dir(tmp_path))  # and the directory's lock went with the agent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for worker in workers:
            if worker.is_running():
                worker.kill()


@pytest.mark.timeout(600)
def test_two_agents_with_nnodes_2_train_like_one(reference_run, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _nanoddp_train("--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                       "--rdzv-id", "two-node-test", "--out", str(tmp_path))
        for node in (0, 1)
    ]  # fmt: skip
    _finish_together(nodes)
    # one process per node, two nodes: the same math as one node with two processes, bit for bit
    # (the per-rank thread count depends on the world size only, not on the launch layout)
    expected, got = _params(reference_run), _params(tmp_path)
    assert all(torch.equal(value, got[name]) for name, value in expected.items())


@pytest.mark.timeout(300)
def test_crash_without_restarts_is_one_line_per_rank_with_its_log(reference_run, tmp_path):
    """A failure only the workers can see (this snapshot passes the launcher's checks: header,
    configuration, model shapes; its optimizer state does not load): one line per failed rank
    with the exception and the path of that rank's full log, which holds the traceback."""
    state = snapshot.load(snapshot.snapshot_path(reference_run / "snapshots", 30))
    state["objects"]["optimizer"]["state"] = {"state": {}, "param_groups": []}
    bad = snapshot.save(tmp_path / "bad.pt", state)
    out = tmp_path / "run"
    proc = _nanoddp_train("--nproc", "2", "--max-restarts", "0", "--out", str(out), "--resume", str(bad))
    output = _finish(proc)
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "Root Cause" not in output, output[-3000:]
    failed = re.findall(r"^nanoddp: rank (\d) failed: (.*) \(full log: (.*)\)$", output, flags=re.M)
    assert failed and len(failed) == len({rank for rank, _, _ in failed}) <= 2, output[-3000:]
    rank, message, log = next(f for f in failed if f[1].startswith("ValueError"))
    assert "parameter groups" in message and log == str(out / "logs" / f"rank{rank}.log")
    assert "Traceback" in Path(log).read_text() and "parameter groups" in Path(log).read_text()


@pytest.mark.timeout(300)
def test_plain_torchrun_runs_the_same_job(reference_run, tmp_path):
    """The documented `torchrun ... -m nanoddp.train` equals `nanoddp train` bit for bit."""
    flags = [*TRAIN_ARGS, "--out", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(tmp_path / "torchrun-logs"),  # else torchelastic leaves one in /tmp
         "-m", "nanoddp.train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    output = _finish(proc)
    assert proc.returncode == 0, output[-3000:]
    expected, got = _params(reference_run), _params(tmp_path)
    assert all(torch.equal(value, got[name]) for name, value in expected.items())
