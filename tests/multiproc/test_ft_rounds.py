"""`nanoddp train --on-failure continue --engine localsgd|diloco`: replicas lost and joined at syncs.

One launch per engine: 3 replicas of a tiny GPT, a sync every 3 steps, 12 steps. Replica 2 is
SIGKILLed from outside after step 4 (between the syncs of steps 3 and 6): the two others step on
alone and the next sync averages over their samples (replica 2's since the sync of step 3 are
lost); there its replacement heals from a peer (last-synced weights, outer state, inner AdamW and
step count) and trains the rounds after it. A second launch (diloco) loses replica 2 during a
sync's all-reduce: the survivors retry it among themselves and go on at world size 2. References:
- the `sync` records (who was present, the samples each trained since the last sync, whom a
  joiner healed from) make the schedule described above, and the step records' world sizes are
  the quorum of each round's start;
- `model.pt` equals, bitwise, `helpers.replay_rounds_run` of that schedule: one model per
  replica in one process, without `nanoddp.ft`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
import torch
from helpers import FT_TINY_GPT, replay_rounds_run, replica_pid, run_on_ranks, wait_for

from nanoddp.bench.training_run import run_training

pytest.importorskip("torchft")

REPLICAS, SYNC_EVERY, STEPS, KILL_AFTER = 3, 3, 12, 4


@pytest.fixture(scope="module", params=["localsgd", "diloco"])
def launched(request, tmp_path_factory):
    """The run of one engine; `--min-replicas 3` makes the survivors' next sync wait for the
    replacement (its start takes seconds on a loaded machine), so it joins there."""
    engine, out = request.param, tmp_path_factory.mktemp(request.param) / "run"
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(REPLICAS),
               "--engine", engine, "--sync-every", str(SYNC_EVERY), "--steps", str(STEPS), "--max-restarts", "1",
               "--min-replicas", str(REPLICAS), "--no-warm-spare", "--snapshot-every", "0", "--eval-every", "0",
               "--out", str(out), *FT_TINY_GPT, "--log-every", str(STEPS)]  # fmt: skip

    def kill_replica_2(proc) -> bool:
        """SIGKILL replica 2 once step KILL_AFTER is recorded (held first: it dies between the
        syncs of steps 3 and 6, or in the second at the latest, which retries the same)."""
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        pid = wait_for(lambda: proc.poll() is None and replica_pid(launcher, 2), deadline)
        if not _wait_for_record(proc, out, deadline, lambda r: "event" not in r and r["step"] >= KILL_AFTER):
            return False
        os.kill(pid, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        return True

    run = run_training(command, out, timeout_s=180, during=kill_replica_2)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return engine, out, run


def _wait_for_record(proc, out, deadline: float, wanted) -> bool:
    while proc.poll() is None and time.monotonic() < deadline:
        if any(wanted(r) for r in _records(out)):
            return True
        time.sleep(0.002)
    return False


def _records(out) -> list[dict]:
    from nanoddp.base.records import read_records

    return read_records(out, missing_ok=True)


def _replay(env, syncs, engine):
    return replay_rounds_run(env, syncs, engine, replicas=REPLICAS, steps=STEPS, sync_every=SYNC_EVERY)


def test_a_lost_replica_and_its_joiner_equal_the_replay_bitwise(launched):
    engine, out, run = launched
    records = run.records
    syncs = [r for r in records if r.get("event") == "sync"]
    got_schedule = [(s["step"], s["replicas"], s["samples"], s["healed_from"]) for s in syncs]
    assert got_schedule[:2] == [
        (3, [0, 1, 2], [12, 12, 12], [-1, -1, -1]),
        # replica 2's round is lost: the survivors' samples alone; its replacement healed from a peer
        (6, [0, 1, 2], [12, 12, 0], [-1, -1, syncs[1]["healed_from"][2]]),
    ], got_schedule
    assert syncs[1]["healed_from"][2] in (0, 1), got_schedule
    assert got_schedule[2:] == [(step, [0, 1, 2], [12, 12, 12], [-1, -1, -1]) for step in (9, 12)], got_schedule
    assert [r["world_size"] for r in records if "event" not in r] == [REPLICAS] * STEPS
    changes = [
        (r["event"], r["step"], r["replicas"]) for r in records if r.get("event") in ("rank_lost", "rank_joined")
    ]
    assert changes == [("rank_lost", 7, [2]), ("rank_joined", 7, [2])], changes
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay, 1, syncs, engine, timeout=240)[0]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{engine} {name}: {(got[name] - want[name]).abs().max()}"


# ---- lost during a sync: after the sync's quorum, in its all-reduce ------------------------------
DURING_STEPS, DURING_SYNC = 9, 6  # replica 2 dies in the sync of step 6


@pytest.fixture(scope="module")
def lost_during_a_sync(tmp_path_factory):
    """diloco, 3 replicas, no replacement: replica 2 SIGKILLed once it has marked the quorum of the
    sync of step DURING_SYNC (`FaultTolerant._beat`, which comes right before the sync's
    all-reduce), while that all-reduce waits on a simulated 300 ms link."""
    out = tmp_path_factory.mktemp("during") / "run"
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(REPLICAS),
               "--engine", "diloco", "--sync-every", str(SYNC_EVERY), "--steps", str(DURING_STEPS),
               "--max-restarts", "0", "--snapshot-every", "0", "--eval-every", "0", "--out", str(out), *FT_TINY_GPT,
               "--log-every", str(DURING_STEPS)]  # fmt: skip

    def kill_in_the_sync(proc) -> bool:
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        pid = wait_for(lambda: proc.poll() is None and replica_pid(launcher, 2), deadline)
        beat = os.path.join(psutil.Process(pid).environ()["NANODDP_FT_BEATS"], "replica-2")
        before = DURING_SYNC - SYNC_EVERY  # the sync before: its step record's time follows its quorum's mark
        if not _wait_for_record(proc, out, deadline, lambda r: "event" not in r and r["step"] == before):
            return False
        committed = next(r["time"] for r in _records(out) if "event" not in r and r["step"] == before)
        wait_for(lambda: proc.poll() is not None or os.stat(beat).st_mtime > committed, deadline, 0.001)
        os.kill(pid, signal.SIGKILL)
        return True

    slow_link = dict(os.environ, NANODDP_LINK_LATENCY="300ms")
    run = run_training(command, out, timeout_s=180, during=kill_in_the_sync, env=slow_link)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return out, run


def test_a_replica_lost_during_a_sync_the_survivors_retry_it(lost_during_a_sync):
    """The survivors' first try of the sync failed, the retry among them averaged their whole
    round (nothing of the failed try applied), and model.pt equals the replay bitwise."""
    out, run = lost_during_a_sync
    assert f"the sync at step {DURING_SYNC} failed" in run.output, run.output[-3000:]
    syncs = [r for r in run.records if r.get("event") == "sync"]
    assert [(s["step"], s["replicas"], s["samples"]) for s in syncs] == [
        (3, [0, 1, 2], [12, 12, 12]),
        (6, [0, 1], [12, 12]),  # pieces of 4 (split over 3), 3 steps each: the survivors' whole round
        (9, [0, 1], [18, 18]),
    ], syncs
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay_during, 1, syncs, timeout=240)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _replay_during(env, syncs):
    return replay_rounds_run(env, syncs, "diloco", replicas=REPLICAS, steps=DURING_STEPS, sync_every=SYNC_EVERY)
