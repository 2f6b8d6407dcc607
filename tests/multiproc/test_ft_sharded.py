"""`nanoddp train --on-failure continue` with snapshots, evaluation, resume and the sharded engines.

Every run here is 3 replicas of a tiny GPT (a step takes milliseconds; a launch costs seconds:
the quorum service and three processes that import torch), five launches in all. The references
are real runs and a replay:
- a continue run resumed from its own snapshot ends bitwise equal to the same run uninterrupted
  (both sum the same pieces in the same order from the same state);
- the restart path (`nanoddp train`, the Trainer) resumes from a continue run's snapshot with the
  same engine;
- zero1 ends bitwise equal to a single-process replay of the schedule (which engine nanoddp
  under continue equals in tests/multiproc/test_ft.py); zero2 over replica groups of 2 processes,
  one process of a group lost (the group fails whole) and the group regained (every group holds
  the whole state, so nothing is read from a snapshot and each joining process heals live from
  the process of a peer group that holds the same shard), to a replay of the schedule with the
  zero2 engine over one group's 2 ranks.
`--engine fsdp` is refused under continue (tests/multiproc/test_ft.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FT_TINY_GPT, replay_continue_run, replay_engine_run, replica_pid, run_on_ranks, wait_for

from nanoddp.base.records import events, read_records
from nanoddp.bench.training_run import TrainingRun, run_training

pytest.importorskip("torchft")

TINY_GPT = FT_TINY_GPT
STEPS, EVERY = 6, 3


def _train(out: Path, *flags: str, on_failure: str = "continue", nproc: int = 3) -> TrainingRun:
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", on_failure, "--nproc", str(nproc)]
    command += ["--steps", str(STEPS), "--snapshot-every", str(EVERY), "--eval-every", str(EVERY)]
    done = run_training([*command, "--out", str(out), *TINY_GPT, *flags], out, timeout_s=120, forked=True)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.output[-5000:]}"
    return done


def _records(out: Path) -> list[dict]:
    return read_records(out)


def _assert_same_model(got: Path, want: Path) -> None:
    a, b = torch.load(got), torch.load(want)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: {(a[name] - b[name]).abs().max()}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The uninterrupted continue run of engine zero1: snapshots at 3 and 6, evaluations there."""
    out = tmp_path_factory.mktemp("plain") / "run"
    _train(out, "--engine", "zero1")
    return out


def test_continue_writes_snapshots_and_evaluates(plain):
    from nanoddp.train.checkpoint import snapshot

    assert [step for step, _ in snapshot.list_snapshots(plain / "snapshots")] == [6, 3]
    state = snapshot.load_checked(plain / "snapshots" / "step-00000003.pt")
    assert sorted(state["objects"]) == ["model", "optimizer", "sampler", "scheduler", "train"]
    train = snapshot.train_state(state, "step 3")
    assert (train["step"], train["history"], train["config"]["on_failure"]) == (3, [3, 3, 3], "continue")
    # zero1's optimizer as the restart path's zero1 saves it: its own shard (here the whole state)
    assert state["objects"]["optimizer"]["kind"] == "zero1"
    evals = [(r["step"], r["world_size"]) for r in _records(plain) if r.get("event") == "eval"]
    assert evals == [(3, 3), (6, 3)]


def test_continue_resumed_from_its_snapshot_equals_the_uninterrupted_run_bitwise(plain, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(plain, out)  # as if the whole job had died after step 4: the newest snapshot is step 3
    (out / "snapshots" / "step-00000006.pt").unlink()
    (out / "model.pt").unlink()
    done = _train(out, "--engine", "zero1", "--resume", "auto")
    output = done.output
    assert "resumed from" in output and "(step 3)" in output, output[-3000:]
    _assert_same_model(out / "model.pt", plain / "model.pt")
    steps = [r["step"] for r in _records(out) if "event" not in r]
    assert steps == list(range(1, STEPS + 1)), steps  # the records after the snapshot were redone, once


def test_restart_resumes_from_a_continue_snapshot(plain, tmp_path):
    """The Trainer (the restart path's loop, here on one gloo rank) reads it with the same engine:
    model, ZeRO-1's AdamW, schedule, sampler position. One process sums the batch as one piece, the
    continue run as three weighted pieces (another order of float additions): the losses agree to
    float32 rounding, not bitwise."""
    from nanoddp.train.config import TrainConfig

    config = TrainConfig(
        engine="zero1", text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12,
        warmup_steps=2, seed=0, steps=STEPS, snapshot_every=EVERY, eval_every=EVERY, log_every=1, progress=False,
        out=str(tmp_path / "run"), resume=str(plain / "snapshots" / "step-00000003.pt"),
    )  # fmt: skip
    assert run_on_ranks(_resume_with_the_trainer, 1, config)[0] == (3, 3 * 12)  # step and sampler position
    want = {r["step"]: r for r in _records(plain) if "event" not in r}
    got = [r for r in _records(tmp_path / "run") if "event" not in r and "loss" in r]
    assert [r["step"] for r in got] == [4, 5, 6]
    for record in got:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)


def _resume_with_the_trainer(env, config) -> tuple[int, int]:
    """On one rank: the restart path's Trainer from `config` (resumed per its `resume`), trained to
    the end; returns the step and sampler position it resumed at."""
    from nanoddp.train.trainer import Trainer

    trainer = Trainer.from_config(config, env)
    resumed_at = (trainer.step, trainer.sampler.position)
    trainer.train()
    return resumed_at


# ---- the sharded engines ------------------------------------------------------------------------


def test_zero1_without_a_failure_equals_the_replay_bitwise(plain):
    """zero1 under continue: each rank steps the whole parameters it owns (AdamW per tensor: the
    same bits as one process stepping all of them), so the model equals the replay, which
    engine nanoddp under continue equals too (tests/multiproc/test_ft.py)."""
    got, want = torch.load(plain / "model.pt"), replay_continue_run([3] * STEPS)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _start(out: Path, command: list[str]) -> subprocess.Popen:
    """Start `command` with its output in a file beside `out`: a pipe that nobody reads while the
    test waits would fill up and stall the run (the launcher blocks writing to it)."""
    with open(out.parent / "output.txt", "w") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _events(out: Path) -> list[str]:
    return [r["event"] for r in events(read_records(out, missing_ok=True))]


GROUP = 2  # processes per replica of the run that loses one (--group-size)


def _losing_run(engine: str, steps: int, out: Path) -> list[str]:
    """The command of a run of 3 replica groups of GROUP processes that `_lose_and_regain` loses a
    process of: a snapshot every 5 steps, one restart, started cold (--no-warm-spare), so the
    survivors step without it first."""
    nproc = str(3 * GROUP)
    return [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", nproc,
            "--group-size", str(GROUP), "--engine", engine,
            "--steps", str(steps), "--snapshot-every", "5", "--eval-every", "0", "--max-restarts", "1",
            "--no-warm-spare", "--out", str(out), *TINY_GPT, "--collective-timeout", "30"]  # fmt: skip


def _lose_and_regain(out: Path, command: list[str]) -> str:
    """Run `command`; SIGKILL replica 1's rank 1 (not the process the launcher started: the one
    that process forked) once a snapshot exists, which takes replica 1's group down; its
    replacement held back (the
    launcher's fork server stopped: a replacement forked from its warm imports could join the very
    quorum that leaves replica 1 out, and the run would never step at world size 2); once the two
    others have committed a step without it, hold them (SIGSTOP, every process of their groups) and
    let the replacement come,
    until it connects to the quorum service the launcher runs (its Manager is up; a socket it
    merely listens on says less: its own default group opens one first), so that it joins while
    the run has steps left whatever the machine's load; return the output of the run, which must
    end well."""
    import os
    import signal
    import time

    import psutil

    proc = _start(out, command)
    held: list[int] = []
    survivors: list[int] = []  # replica groups held: their rank 0s, each leading its session
    try:
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 90
        first = wait_for(lambda: _has_snapshot(out) and replica_pid(launcher, 1), deadline)
        server = psutil.Process(first).ppid()  # the launcher's fork server, which forks the replacement too
        assert server in [child.pid for child in launcher.children()], (server, launcher.children())
        member = wait_for(lambda: [c.pid for c in psutil.Process(first).children() if c.name() == "ft-replica1.0m1"],
                          deadline)[0]  # fmt: skip
        os.kill(server, signal.SIGSTOP)
        held = [server]
        os.kill(member, signal.SIGKILL)

        def a_step_at_world_size_2() -> bool:
            records = _records(out)
            lost = [i for i, r in enumerate(records) if r.get("event") == "rank_lost"]
            return bool(lost) and any(r.get("world_size") == 2 and "event" not in r for r in records[lost[0] :])

        wait_for(a_step_at_world_size_2, deadline)
        survivors = [pid for pid in (replica_pid(launcher, 0), replica_pid(launcher, 2)) if pid is not None]
        for pid in survivors:
            os.killpg(pid, signal.SIGSTOP)  # each leads its group's session
        os.kill(server, signal.SIGCONT)
        held.remove(server)

        quorum_ports = {c.laddr.port for c in launcher.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}

        def replacement_reaches_the_quorum_service() -> bool:
            """replica 1's replacement to connect to the quorum service (its Manager is up)"""
            pid = replica_pid(launcher, 1, attempt=1)
            try:
                conns = psutil.Process(pid).net_connections(kind="inet") if pid else []
            except psutil.Error:
                return False
            return any(c.raddr and c.raddr.port in quorum_ports for c in conns)

        wait_for(replacement_reaches_the_quorum_service, deadline, 0.05)
        for pid in survivors:
            os.killpg(pid, signal.SIGCONT)
        survivors = []
        proc.wait(timeout=120)
        output = (out.parent / "output.txt").read_text()
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        for pid in survivors:
            os.killpg(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-5000:]
    return output


# Steps enough that a test process slowed by a loaded machine still acts before the run ends (a
# step takes 10 to 50 ms here); steps after the failure cost little.
ZERO2_STEPS = 120


def test_zero2_loses_a_replica_heals_it_live_and_regains_it(tmp_path):
    """zero2 over replica groups of 2 processes, replica 1's rank 1 SIGKILLed once a snapshot
    exists (every 5 steps): its group fails whole (its rank 0 says so and ends) and the launcher's
    replacement group joins later. The engine shards only inside a group, so the survivors lose no
    state, nothing is read from the snapshot (no record, no line says so), each process of the
    joining group takes its shard from the process of a peer group that holds the same, and the run
    ends equal, bitwise, to a replay of its schedule with the zero2 engine over one group's 2 ranks
    (`helpers.replay_engine_run`)."""
    out = tmp_path / "run"
    output = _lose_and_regain(out, _losing_run("zero2", ZERO2_STEPS, out))
    records = _records(out)
    history = [r["world_size"] for r in records if "event" not in r]
    changes = [r for r in records if r.get("event") not in (None, "eval")]
    # [Note: more changes] A survivor held by the test may resume a moment after the other: the
    # quorum service can then form a majority without it, and it is lost and rejoins too (more
    # records, each applied by the replay as well): the run is right either way.
    assert changes[0]["event"] == "rank_lost" and changes[0]["replicas"] == [1], changes
    assert any(r["event"] == "rank_joined" and 1 in r["replicas"] for r in changes[1:]), changes
    assert {r["event"] for r in changes} == {"rank_lost", "rank_joined"}, changes  # no snapshot read
    assert "snapshot of step" not in output, output[-3000:]
    assert "replica 1: its group's rank 1 failed (killed by signal 9): the group's processes end together" in output
    assert "nanoddp train: replica 1 failed (exit code 1); starting replacement 1" in output, output[-3000:]
    assert history[0] == 3 and 2 in history and history[-1] == 3, history  # lost, then regained
    got = torch.load(out / "model.pt")
    want = run_on_ranks(replay_engine_run, GROUP, history, "zero2", 3, timeout=240)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _has_snapshot(out: Path) -> bool:
    """Any snapshot, not one by name: a test process slowed by the machine's load may look only
    after the first snapshot has been pruned."""
    return any((out / "snapshots").glob("step-*.pt")) if (out / "snapshots").is_dir() else False


FSDP_STEPS = 60


def test_fsdp_says_it_shards_nowhere_else_and_a_lost_process_resumes_from_the_newest_snapshot(tmp_path):
    """fsdp under continue on one node: its processes are one replica (the start-up line says a lost
    process takes shards that exist nowhere else). One of them SIGKILLed after a snapshot takes the
    replica down; the launcher's replacement finds nobody holding the state and resumes from the
    newest snapshot (one record, one line), redoes the steps after it, recorded once, and ends
    bitwise equal to the same run uninterrupted."""
    import os
    import signal
    import time

    import psutil

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", "2",
                "--engine", "fsdp", "--steps", str(FSDP_STEPS), "--snapshot-every", "5", "--eval-every", "0",
                "--max-restarts", "1", "--no-warm-spare", "--out", str(out), *TINY_GPT]  # fmt: skip

    clean = run_training(command(tmp_path / "clean"), tmp_path / "clean", timeout_s=120, forked=True)
    assert clean.returncode == 0, clean.output[-3000:]
    assert "fsdp shards the model over all 2 processes of the one replica: a lost process takes shards" in clean.output
    out = tmp_path / "run"
    proc = _start(out, command(out))
    try:
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 90
        first = wait_for(lambda: _has_snapshot(out) and replica_pid(launcher, 0), deadline)
        member = wait_for(lambda: [c.pid for c in psutil.Process(first).children() if c.name() == "ft-replica0.0m1"],
                          deadline)[0]  # fmt: skip
        os.kill(member, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (out.parent / "output.txt").read_text()
    assert proc.returncode == 0, output[-5000:]
    resumed = [r for r in _records(out) if r.get("event") == "resumed_from_snapshot"]
    assert len(resumed) == 1 and resumed[0]["snapshot_step"] % 5 == 0, resumed
    assert "resume from the snapshot of step" in output, output[-3000:]
    steps = [r["step"] for r in _records(out) if "event" not in r]
    assert steps == list(range(1, FSDP_STEPS + 1)), steps
    _assert_same_model(out / "model.pt", tmp_path / "clean" / "model.pt")
