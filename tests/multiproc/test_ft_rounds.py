"""`nanoddp train --on-failure continue --engine localsgd|diloco`: replicas lost and joined at syncs.

One launch per engine: 3 replicas of a tiny GPT, a sync every 3 steps. Replica 2 is SIGKILLed
from outside after step 4 (between the syncs of steps 3 and 6): the two others step on alone and
the next sync averages over them (replica 2's samples since the sync of step 3 are lost); they
sync alone for a round or more; its replacement, at a later sync, heals from a peer (last-synced
weights, outer state, inner AdamW and step count) and trains the rounds after it. References:
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

REPLICAS, SYNC_EVERY, STEPS, KILL_AFTER = 3, 3, 48, 4
HELD_AFTER = 9  # the survivors are held after a sync of theirs alone, at step HELD_AFTER or later
HOLD_S = 1.0  # each hold: below the quorum service's heartbeat timeout (quorum_service.HEARTBEAT_MS)


@pytest.fixture(scope="module", params=["localsgd", "diloco"])
def launched(request, tmp_path_factory):
    engine, out = request.param, tmp_path_factory.mktemp(request.param) / "run"
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(REPLICAS),
               "--engine", engine, "--sync-every", str(SYNC_EVERY), "--steps", str(STEPS), "--max-restarts", "1",
               "--no-warm-spare", "--snapshot-every", "0", "--eval-every", "0", "--out", str(out), *FT_TINY_GPT,
               "--log-every", str(STEPS)]  # fmt: skip
    # each sync waits on a simulated 20 ms link (nanoddp's sends only: the same sums), so that the
    # survivors' rounds after the kill last a second or more on any machine
    slow_link = dict(os.environ, NANODDP_LINK_LATENCY="20ms")
    run = run_training(command, out, timeout_s=180, during=lambda proc: _plant(proc, out), env=slow_link)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return engine, out, run


def _plant(proc, out) -> bool:
    """The schedule, from outside: replica 2 SIGKILLed once step KILL_AFTER is recorded (held first:
    it dies between the syncs of steps 3 and 6 whatever the machine's speed); once the two
    others have synced alone at step HELD_AFTER they are slowed (held by SIGSTOP most of the time)
    until replica 2's replacement is up and asking the quorum service (connected to it), so that
    it joins at a sync with steps left, however long its start takes on a loaded machine."""
    launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 150
    pids = [wait_for(lambda r=r: proc.poll() is None and replica_pid(launcher, r), deadline) for r in range(3)]
    if not _wait_for_record(proc, out, deadline, lambda r: "event" not in r and r["step"] >= KILL_AFTER):
        return False
    os.kill(pids[2], signal.SIGSTOP)
    os.kill(pids[2], signal.SIGKILL)
    # held in pulses shorter than the quorum service's heartbeat timeout (it would leave a held
    # replica out) and than the Manager's timeouts (a commit missed by one member alone), each
    # after an inner step of theirs alone, until the replacement is up and asking the quorum service
    if not _wait_for_record(proc, out, deadline, lambda r: "event" not in r and r["step"] >= HELD_AFTER + 1):
        return False
    joiner, port = None, None
    while not _asking(joiner, port) and time.monotonic() < deadline:
        for pid in pids[:2]:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(HOLD_S)
        for pid in pids[:2]:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.1)
        if joiner is None and (found := replica_pid(launcher, 2, attempt=1)) is not None:
            joiner = psutil.Process(found)
            port = int(joiner.environ()["NANODDP_FT_LIGHTHOUSE"].rsplit(":", 1)[1])
    return True


def _asking(joiner, port) -> bool:
    """Whether the replacement's Manager is connected to the quorum service (it asks next)."""
    return joiner is not None and any(c.raddr and c.raddr.port == port for c in joiner.net_connections("tcp"))


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
    assert [s["step"] for s in syncs] == list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY)), syncs
    # the loss: the first sync after the kill averages the two survivors' samples alone
    lost_at = next(i for i, s in enumerate(syncs) if s["replicas"] != [0, 1, 2])
    assert syncs[lost_at]["step"] > KILL_AFTER and syncs[:lost_at][-1]["step"] <= KILL_AFTER, syncs
    assert syncs[lost_at]["replicas"] == [0, 1] and all(n > 0 for n in syncs[lost_at]["samples"]), syncs
    # the joiner: healed from a peer at a later sync, with no samples of its own, then trains
    joined_at = next(i for i, s in enumerate(syncs) if i > lost_at and s["replicas"] == [0, 1, 2])
    joined = syncs[joined_at]
    assert joined["step"] > HELD_AFTER and joined["samples"][2] == 0 and joined["healed_from"][2] in (0, 1), syncs
    assert joined["healed_from"][:2] == [-1, -1] and joined_at < len(syncs) - 1, syncs
    assert all(s["replicas"] == [0, 1, 2] and 0 not in s["samples"] for s in syncs[joined_at + 1 :]), syncs
    # every step's record has the world size of its round's quorum
    history = [r["world_size"] for r in records if "event" not in r]
    rounds = [REPLICAS] + [len(s["replicas"]) for s in syncs[:-1]]
    assert history == [size for size in rounds for _ in range(SYNC_EVERY)], history
    changes = [(r["event"], r["replicas"]) for r in records if r.get("event") in ("rank_lost", "rank_joined")]
    assert changes == [("rank_lost", [2]), ("rank_joined", [2])], changes
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay, 1, syncs, engine, timeout=240)[0]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{engine} {name}: {(got[name] - want[name]).abs().max()}"
