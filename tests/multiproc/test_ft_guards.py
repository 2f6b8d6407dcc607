"""`--on-failure continue` never starts a run over, and keeps the restart path's guards.

Each test is one launch of a tiny GPT (`helpers.FT_TINY_GPT`) on 2 replicas, of a user's
loop, or none (the three `--on-nan` runs are launched together, as are the four bad-link ones):
- both replicas SIGKILLed at once after a snapshot: the replacements, which hold nothing, resume
  from the newest snapshot (one line, one record) and end bitwise equal to a replay of the
  uninterrupted run, with no step recorded twice;
- the only holder lost while its joiner waited to heal, no snapshot: one line, exit 3, no step
  run again;
- `--on-nan stop`: exit 3 before the update, the newest snapshot equal to the replay of the
  steps before the NaN; `--on-nan skip`: the NaN steps commit with no update, the newest finite
  snapshot is kept by pruning, and `model.pt` equals the replay that skips the same steps;
  `--engine localsgd --on-nan skip`: each replica skips its own NaN steps alone, with its own
  line, and each sync record counts them per replica;
- a snapshot write that fails on every replica, and a collective that fails the same way each
  try (a bad `NANODDP_LINK_BANDWIDTH` set inside the script): one line and exit 3, bounded;
- a replacement whose own collectives fail alike stops alone (3 replicas, `nanoddp run`): the
  holders finish and are never ended for it;
- a bad `NANODDP_LINK_*` in the launching shell: one line and exit 2 before any worker starts,
  in both modes, for `nanoddp train` and `nanoddp run`.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import FT_TINY_GPT, replay_continue_run, replica_pid, wait_for

from nanoddp.base.records import read_records
from nanoddp.bench.training_run import TrainingRun, run_training

pytest.importorskip("torchft")

STOPPED = 3  # nanoddp.ft.stopped.STOPPED_EXIT_CODE
RUN_TIMEOUT_S = 150


def _command(out: Path, steps: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", "2",
            "--steps", str(steps), "--eval-every", "0", "--out", str(out), *FT_TINY_GPT, *flags]  # fmt: skip


def _run(out: Path, steps: int, *flags: str) -> tuple[int, str]:
    run = run_training(_command(out, steps, *flags), out, timeout_s=RUN_TIMEOUT_S, forked=True)
    return run.returncode, run.output


def _records(out: Path) -> list[dict]:
    return read_records(out, missing_ok=True)


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in _records(out) if "event" not in r]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _killing(out: Path, command: list[str], act) -> tuple[int, str]:
    """Run `command`, call `act(launcher, stopped)` while it runs, and return its exit code and
    output; nothing is left running, and a replica `act` held (SIGSTOP, its pid in `stopped`)
    and did not get to kill runs again."""
    import psutil

    stopped: list[int] = []

    def during(proc) -> None:
        try:
            act(psutil.Process(proc.pid), stopped)
        finally:
            for pid in stopped:
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGCONT)

    run = run_training(command, out, timeout_s=RUN_TIMEOUT_S, during=during, forked=True)
    return run.returncode, run.output


def _both(launcher) -> list[int] | None:
    """both first replicas' pids"""
    pids = [replica_pid(launcher, 0, attempt=0), replica_pid(launcher, 1, attempt=0)]
    return None if None in pids else pids  # type: ignore[return-value]


def test_both_replicas_lost_resume_from_the_newest_snapshot_bitwise(tmp_path):
    """Both replicas SIGKILLed once a snapshot exists (held first, so they die together): the
    replacements start empty, so they resume from the newest snapshot; the records past it are
    dropped, as a resumed run drops them, so every step is recorded once, before or after one
    `resumed_from_snapshot` record, with the loss of a replay of the uninterrupted run, and
    `model.pt` equals that replay bitwise (a resume from a snapshot is exact). Before, the steps
    between the snapshot and the kill were recorded twice."""
    out, steps = tmp_path / "run", 40
    command = _command(out, steps, "--snapshot-every", "5", "--max-restarts", "1", "--no-warm-spare")
    command += ["--collective-timeout", "30"]

    recorded: list[int] = []  # the steps recorded when they were killed

    def past_a_snapshot() -> bool:  # a step past the newest snapshot is recorded (if none is being written)
        done = _steps(out)
        return bool(done) and done[-1] > 5 and done[-1] % 5 != 0

    def act(launcher, stopped):
        deadline = time.monotonic() + 90
        while True:
            pids = wait_for(lambda: past_a_snapshot() and _both(launcher), deadline)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            # A step may have ended on a snapshot between the look and the hold: go on a little.
            if past_a_snapshot():
                break
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
        recorded.extend(_steps(out))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    code, output = _killing(out, command, act)
    assert code == 0, output[-5000:]
    records = _records(out)
    resumed = [i for i, r in enumerate(records) if r.get("event") == "resumed_from_snapshot"]
    assert len(resumed) == 1, records
    event = records[resumed[0]]
    before = [r["step"] for r in records[: resumed[0]] if "event" not in r]
    after = [r["step"] for r in records[resumed[0] :] if "event" not in r]
    assert event["snapshot_step"] >= 5 and event["step"] == event["snapshot_step"] + 1, event
    assert recorded[-1] > event["snapshot_step"], recorded  # steps past the snapshot were recorded once
    assert before == list(range(1, event["snapshot_step"] + 1)), before  # and are dropped
    assert after == list(range(event["snapshot_step"] + 1, steps + 1)), after  # never from step 1 again
    assert output.count("resume from the snapshot of step") == 1, output[-5000:]
    losses: list[float] = []
    _assert_same(torch.load(out / "model.pt"), replay_continue_run([2] * steps, replicas=2, losses=losses))
    assert [r["loss"] for r in records if "event" not in r] == losses


def test_the_holder_lost_while_its_joiner_waits_stops_in_one_line(tmp_path):
    """Replica 1 SIGKILLed and replica 0, the only holder left, held (SIGSTOP) so that it cannot
    send its state; once replica 1's replacement is up, replica 0 is SIGKILLed too. No replica
    holds the state and there is no snapshot: the run stops with one line and exit 3, and no
    step is run again (before: the replacements trained the run again from step 1, exit 0)."""
    out = tmp_path / "run"
    command = _command(out, 200, "--snapshot-every", "0", "--max-restarts", "1", "--no-warm-spare")

    def act(launcher, stopped):
        deadline = time.monotonic() + 90
        pids = wait_for(lambda: len(_steps(out)) >= 3 and _both(launcher), deadline)
        os.kill(pids[0], signal.SIGSTOP)
        stopped.append(pids[0])
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: replica_pid(launcher, 1, attempt=1), deadline)
        os.kill(pids[0], signal.SIGKILL)

    code, output = _killing(out, command, act)
    assert code == STOPPED, output[-5000:]
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 200, steps  # none run twice
    assert output.count("no snapshot to resume from: stopped rather than start over") == 1, output[-5000:]
    assert "Traceback" not in output, output[-5000:]


# lr 1e30: step 1 is finite, its update makes every later loss NaN (the replay shows the same)
NAN_LR = ["--lr", "1e30", "--snapshot-every", "1", "--keep-snapshots", "1"]


def _snapshot(out: Path, step: int) -> dict:
    from nanoddp.train.checkpoint import snapshot

    return snapshot.load_checked(out / "snapshots" / f"step-{step:08d}.pt")


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """The `--on-nan stop` and `--on-nan skip` runs, and `skip` under localsgd, launched together
    (one wall time for three): {name: (out, exit code, output)}."""
    root = tmp_path_factory.mktemp("on-nan")
    rounds = ["--engine", "localsgd", "--sync-every", "2", "--snapshot-every", "2"]  # snapshots at syncs
    runs = {"stop": ["--on-nan", "stop"], "skip": ["--on-nan", "skip"], "rounds-skip": ["--on-nan", "skip", *rounds]}
    outs = {name: root / name / "run" for name in runs}

    def launch(name: str) -> TrainingRun:
        return run_training(_command(outs[name], 4, *NAN_LR, *runs[name]), outs[name], timeout_s=RUN_TIMEOUT_S,
                            forked=True)  # fmt: skip

    with ThreadPoolExecutor(len(runs)) as pool:
        done = dict(zip(runs, pool.map(launch, runs), strict=True))
    return {name: (outs[name], run.returncode, run.output) for name, run in done.items()}


def test_on_nan_stop_under_continue(nan_runs):
    """`--on-nan stop`: the restart path's line once, exit 3, no `model.pt`; the newest snapshot
    is step 1's, equal bitwise to a replay of that step (before: the NaN updates were applied,
    NaN snapshots pruned the finite one, `model.pt` was written with NaN, exit 0)."""
    out, code, output = nan_runs["stop"]
    assert code == STOPPED, output[-5000:]
    assert output.count("step 2: the loss is NaN or inf on rank(s) 0, 1; stopped before the optimizer step") == 1
    assert not (out / "model.pt").exists() and _steps(out) == [1]
    from nanoddp.train.checkpoint import snapshot

    assert [s for s, _ in snapshot.list_snapshots(out / "snapshots")] == [1]
    _assert_same(_snapshot(out, 1)["objects"]["model"]["state"], replay_continue_run([2], replicas=2, lr=1e30))


def test_on_nan_skip_under_continue(nan_runs):
    """`--on-nan skip`: steps 2 to 4 commit without an update (one line and one record each);
    pruning keeps step 1's snapshot, the newest finite one, beside the newest; `model.pt` equals
    bitwise the replay that skips the same steps, which is step 1's state."""
    out, code, output = nan_runs["skip"]
    assert code == 0, output[-5000:]
    skipped = [r["step"] for r in _records(out) if r.get("event") == "nonfinite_loss"]
    assert skipped == [2, 3, 4] and output.count("update skipped on every rank") == 3, output[-3000:]
    from nanoddp.train.checkpoint import snapshot

    assert [s for s, _ in snapshot.list_snapshots(out / "snapshots")] == [4, 1]
    finite = [snapshot.train_state(_snapshot(out, s), s)["loss_finite"] for s in (1, 4)]
    assert finite == [True, False]
    want = replay_continue_run([2] * 4, replicas=2, lr=1e30)
    _assert_same(torch.load(out / "model.pt"), want)
    _assert_same(_snapshot(out, 1)["objects"]["model"]["state"], want)


def test_on_nan_skip_under_continue_with_localsgd_is_each_replicas_own(nan_runs):
    """localsgd (a sync every 2 steps): a replica steps alone between syncs, so a NaN loss skips
    its own update alone: one line per replica and step (steps 2 to 4 on both), and each sync
    record counts them per replica (before: no line and no record named the skipping replica)."""
    out, code, output = nan_runs["rounds-skip"]
    assert code == 0, output[-5000:]
    for replica in (0, 1):
        lines = [f"step {step}: the loss is NaN or inf on rank(s) {replica}; update skipped on this replica alone"
                 for step in (2, 3, 4)]  # fmt: skip
        assert [output.count(line) for line in lines] == [1, 1, 1], output[-3000:]
    syncs = [(r["step"], r["replicas"], r["nonfinite_steps"]) for r in _records(out) if r.get("event") == "sync"]
    assert syncs == [(2, [0, 1], [1, 1]), (4, [0, 1], [2, 2])], syncs


def test_a_snapshot_write_that_fails_everywhere_stops_in_one_line(tmp_path):
    """`snapshots` is a file, so every replica's write fails: a few tries, then one line and exit 3
    (before: six tracebacks and the run again from step 1, for minutes)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "snapshots").write_text("not a directory")
    code, output = _run(out, 4, "--snapshot-every", "2", "--max-restarts", "1")
    assert code == STOPPED, output[-5000:]
    assert output.count("the boundary after step 2 (snapshot, evaluation) failed 3 times in a row") == 1, output
    assert "Traceback" not in output and "replacement" not in output, output[-5000:]
    assert _steps(out) == [1, 2]
    assert (out / "snapshots").read_text() == "not a directory"


def test_a_collective_that_fails_the_same_way_stops_in_one_line(tmp_path):
    """A user's loop (`nanoddp run`) whose every collective fails alike: a link setting set in the
    script, past the launcher's check. Three tries, one line, exit 3 (before: retried forever)."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import os\n"
        "import torch\n"
        "from nanoddp.ft import FaultTolerant\n"
        "os.environ['NANODDP_LINK_BANDWIDTH'] = 'fast'\n"
        "model = torch.nn.Linear(4, 1)\n"
        "ft = FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_len=8, batch_size=4)\n"
        "for step in ft.steps(3):\n"
        "    model(torch.ones(len(ft.batch_for(step)), 4)).mean().backward()\n"
        "    ft.average_gradients(model.weight.sum())\n"
        "    ft.commit()\n"
        "ft.close()\n"
    )
    command = [sys.executable, "-m", "nanoddp", "run", "--on-failure", "continue", "--nproc", "2",
               "--max-restarts", "1", "--collective-timeout", "10", str(script)]  # fmt: skip
    done = run_training(command, tmp_path / "none", timeout_s=RUN_TIMEOUT_S, forked=True)
    output = done.output
    assert done.returncode == STOPPED, output[-5000:]
    assert output.count("step 1 failed 3 times in a row the same way, with no replica lost") == 1, output[-5000:]
    assert "NANODDP_LINK_BANDWIDTH must be a number and a unit" in output and "Traceback" not in output


def test_a_replacement_that_stops_alone_ends_no_holder(tmp_path):
    """3 replicas of a user's loop (`nanoddp run`); replica 2 SIGKILLs itself at step 3 and its
    replacement sets a bad `NANODDP_LINK_BANDWIDTH`, so its every collective fails alike and it
    raises the same-failure stop, alone: replicas 0 and 1, which hold the state, go on without
    it. The launcher then treats it as a failed replica (one line; no restarts left) and the
    holders finish, exit 0 (before: the lone stop ended the run, and the launcher killed both
    holders after the collective timeout, exit 3 with no line saying why)."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import os, signal, time\n"
        "import torch\n"
        "from nanoddp.ft import FaultTolerant\n"
        "replica, attempt = os.environ['NANODDP_FT_REPLICA'], os.environ['NANODDP_FT_ATTEMPT']\n"
        "if (replica, attempt) == ('2', '1'):\n"
        "    os.environ['NANODDP_LINK_BANDWIDTH'] = 'fast'\n"
        "model = torch.nn.Linear(4, 1)\n"
        "ft = FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_len=24, batch_size=6)\n"
        "joined, committed = False, 0\n"
        "for step in ft.steps(600):\n"
        "    if step == 3 and (replica, attempt) == ('2', '0'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    joined = joined or (step > 3 and ft.world_size == 3)\n"
        "    if not (joined and ft.world_size == 2):\n"
        "        time.sleep(0.1)  # slow until the replacement has joined and is gone: then fast to the end\n"
        "    model(torch.ones(len(ft.batch_for(step)), 4)).mean().backward()\n"
        "    ft.average_gradients(model.weight.sum())\n"
        "    committed += ft.commit()\n"
        "print('committed', committed, 'of', ft.manager.current_step())\n"
        "ft.close()\n"
    )
    command = [sys.executable, "-m", "nanoddp", "run", "--on-failure", "continue", "--nproc", "3",
               "--max-restarts", "1", "--no-warm-spare", "--collective-timeout", "10", str(script)]  # fmt: skip
    done = run_training(command, tmp_path / "none", timeout_s=RUN_TIMEOUT_S, forked=True)
    output = done.output
    assert done.returncode == 0, output[-5000:]
    assert output.count("replica 2 stopped the run while the others went on without it; no restarts left") == 1
    assert "did not finish with the others" not in output, output[-5000:]
    for replica in (0, 1):  # the holders ran to the end
        assert re.search(rf"^\[replica {replica}\] committed \d+ of 600$", output, re.M), output[-5000:]


BAD_LINK_LAUNCHES = {
    "train-continue": ["train", "--on-failure", "continue"],
    "train-restart": ["train", "--on-failure", "restart"],
    "run-continue": ["run", "--on-failure", "continue", "SCRIPT"],
    "run-restart": ["run", "SCRIPT"],
}


def test_a_bad_link_setting_is_refused_before_any_worker(tmp_path):
    """The launcher parses `NANODDP_LINK_*` with the comm layer's parser: one line, exit 2, no run
    directory, no worker (before, under continue: each replica retried it forever). Checked for
    `nanoddp train` and `nanoddp run` in both modes, the four launched at once (one wall time)."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    environ = {**os.environ, "NANODDP_LINK_BANDWIDTH": "100mbit", "NANODDP_LINK_LATENCY": "20 parsecs"}
    outs = {name: tmp_path / name for name in BAD_LINK_LAUNCHES}

    def launch(name: str) -> TrainingRun:
        argv = [str(script) if a == "SCRIPT" else a for a in BAD_LINK_LAUNCHES[name]]
        extra = ["--out", str(outs[name])] if argv[0] == "train" else []
        command = [sys.executable, "-m", "nanoddp", *argv[:-1], *extra, argv[-1]] if argv[0] == "run" else None
        command = command or [sys.executable, "-m", "nanoddp", *argv, "--nproc", "2", *extra, *FT_TINY_GPT]
        return run_training(command, outs[name], timeout_s=120, env=environ, forked=True)

    with ThreadPoolExecutor(len(BAD_LINK_LAUNCHES)) as pool:
        said = dict(zip(BAD_LINK_LAUNCHES, pool.map(launch, BAD_LINK_LAUNCHES), strict=True))
    for name, run in said.items():  # stdout and stderr together: the one line is all there is
        lines = [line for line in run.output.splitlines() if line.strip()]
        assert run.returncode == 2, (name, run.output[-3000:])
        assert len(lines) == 1 and lines[0].startswith("nanoddp: error: NANODDP_LINK_LATENCY must be"), (name, lines)
        assert not outs[name].exists() and "a worker started" not in run.output, name
