"""`nanoddp train --on-failure continue --engine localsgd|diloco`: replicas lost and joined at syncs.

One launch per engine: 3 replicas of a tiny GPT, a round of 3 steps, 12 steps; localsgd syncs
the whole model every 3 steps, diloco is Streaming DiLoCo (3 fragments, one syncing after every
step, mix 0.5, pseudo-gradients sent bf16). Replica 2 is SIGKILLed from outside after step 4:
the two others step on alone and the next sync averages over their samples (replica 2's since
that fragment's last sync are lost); there its replacement heals from a peer (last-synced
weights, outer state, inner AdamW and step count), starts from the last-synced weights of every
fragment, and trains the rounds after it. A second launch (diloco, int8 pseudo-gradients with
error feedback, `--sync-delay 1`: each sync's quorum one step before its outer step, its sum
running behind that step) loses replica 2 while a sum is on the wire: the survivors retry it
among themselves at the outer step, from what they took at the quorum (their error feedback as
it was), and go on at world size 2; then a grower (replica 3, a second launcher past the 3
replicas the run starts with, `--max-replicas 4`) joins at a sync's quorum, heals, and the
rounds after it are split over three. References:
- the `sync` records (who was present, the samples each trained since the last sync, whom a
  joiner healed from) make the schedule described above, and the step records' world sizes are
  the quorum of each round's start;
- `model.pt` equals, bitwise, `rounds_replay.replay_rounds_run` of that schedule: one model per
  replica in one process, without `nanoddp.ft`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest
import torch
from helpers import FT_TINY_GPT, replica_pid, run_on_ranks, wait_for
from rounds_replay import replay_rounds_run

from nanoddp.base.processes import end_tree
from nanoddp.bench.training_run import run_training
from nanoddp.env import free_port

pytest.importorskip("torchft")

REPLICAS, SYNC_EVERY, STEPS, KILL_AFTER = 3, 3, 12, 4


COMPRESS = {"localsgd": "fp32", "diloco": "bf16"}  # the first launches' wire formats
STREAMING = {"localsgd": (1, 0.0), "diloco": (3, 0.5)}  # the first launches' (fragments, mix)
DURING_COMPRESS = "int8"  # the second launch's


@pytest.fixture(scope="module", params=list(COMPRESS))
def launched(request, tmp_path_factory):
    """The run of one engine; `--min-replicas 3` makes the survivors' next sync wait for the
    replacement (its start takes seconds on a loaded machine), so it joins there."""
    engine, out = request.param, tmp_path_factory.mktemp(request.param) / "run"
    fragments, mix = STREAMING[engine]
    wire = ["--pseudo-grad-dtype", COMPRESS[engine], "--fragments", str(fragments), "--mix", str(mix)]
    wire = wire if engine == "diloco" else []
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(REPLICAS), *wire,
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

    run = run_training(command, out, timeout_s=180, during=kill_replica_2, forked=True)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return engine, out, run


def _wait_for_record(proc, out, deadline: float, wanted) -> dict | None:
    """The first record `wanted` accepts, once written; None if the run ends or `deadline` passes first."""
    while proc.poll() is None and time.monotonic() < deadline:
        found = [r for r in _records(out) if wanted(r)]
        if found:
            return found[0]
        time.sleep(0.002)
    return None


def _records(out) -> list[dict]:
    from nanoddp.base.records import read_records

    return read_records(out, missing_ok=True)


def _replay(env, syncs, engine):
    fragments, mix = STREAMING[engine]
    return replay_rounds_run(env, syncs, engine, replicas=REPLICAS, steps=STEPS, sync_every=SYNC_EVERY,
                             compress=COMPRESS[engine], fragments=fragments, mix=mix)  # fmt: skip


def _want_schedule(fragments: int, lost: int, healed: int) -> list[tuple]:
    """(step, fragment, replicas, samples, healed_from) of every sync: fragment (k - 1) mod F after
    step k SYNC_EVERY/F, every fragment after the last step; each replica trains 4 samples a step
    (12 split over 3) and counts them for each fragment since its last sync; at sync `lost`
    replica 2's replacement heals from `healed` and brings none, and counts from there."""
    period = SYNC_EVERY // fragments
    points = [(s, (s // period - 1) % fragments) for s in range(period, STEPS, period)]
    points += [(STEPS, f) for f in range(fragments)]
    since = {r: [0] * fragments for r in range(REPLICAS)}  # the step each count started at
    schedule = []
    for k, (step, fragment) in enumerate(points):
        samples, sources = [4 * (step - since[r][fragment]) for r in range(REPLICAS)], [-1] * REPLICAS
        if k == lost:
            samples[2], sources[2], since[2] = 0, healed, [step] * fragments
        schedule.append((step, fragment, list(range(REPLICAS)), samples, sources))
        for r in range(REPLICAS):
            since[r][fragment] = step
    return schedule


def test_a_lost_replica_and_its_joiner_equal_the_replay_bitwise(launched):
    engine, out, run = launched
    records = run.records
    syncs = [r for r in records if r.get("event") == "sync"]
    got_schedule = [(s["step"], s["fragment"], s["replicas"], s["samples"], s["healed_from"]) for s in syncs]
    # replica 2 is killed after step 4's record; on a fast machine the loss may land a round late
    lost = next(k for k, s in enumerate(syncs) if 0 in s["samples"])
    fragments = STREAMING[engine][0]
    assert syncs[lost]["step"] > KILL_AFTER and lost < len(syncs) - fragments, got_schedule  # not a final sync
    healed = syncs[lost]["healed_from"][2]
    assert healed in (0, 1), got_schedule
    assert got_schedule == _want_schedule(fragments, lost, healed), got_schedule
    assert [r["world_size"] for r in records if "event" not in r] == [REPLICAS] * STEPS
    changes = [
        (r["event"], r["step"], r["replicas"]) for r in records if r.get("event") in ("rank_lost", "rank_joined")
    ]
    at = syncs[lost]["step"] + 1
    assert changes == [("rank_lost", at, [2]), ("rank_joined", at, [2])], changes
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay, 1, syncs, engine, timeout=240)[0]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{engine} {name}: {(got[name] - want[name]).abs().max()}"


# ---- lost during a sync, then a grower --------------------------------------------------------
# --sync-delay 1: the sync whose outer step follows step 6 takes its quorum after step 5; replica 2
# dies while its sum is on the wire, and the survivors retry it after step 6
DURING_STEPS, DURING_DELAY, DURING_START, DURING_SYNC = 15, 1, 5, 6
GROWER = 3  # the replica id of the growing launcher (--node-rank 3 of --nproc 1: past the 3 of the start)
ABSENT = [f"absent_{i}" for i in range(4)]  # heartbeats of replicas that never ask (the fixture's note)
HEARTBEAT_S = 2.5  # past the quorum service's heartbeat timeout (`quorum_service.HEARTBEAT_MS`)


@pytest.fixture(scope="module")
def lost_during_a_sync(tmp_path_factory):
    """diloco, 3 replicas, no replacement: replica 2 SIGKILLed once the sync started after step
    DURING_START is recorded (after its quorum and its facts, right before its sum goes behind the
    inner steps), while that sum waits on a simulated 300 ms link. Once the survivors' retry after
    step DURING_SYNC has committed, a grower launcher (`--nnodes 3 --nproc 1 --node-rank 3`: the same run of 3
    replicas, as seen from a host of one) joins it through the run's endpoint on loopback.

    [Note: the grower's sync] Its start takes seconds, the survivors' rounds milliseconds: they are
    held (SIGSTOP) until it asks for a quorum. torchft's Lighthouse forms a quorum at once when
    every member of the last one asks (a fast quorum: with everyone else asking, the grower
    included), and otherwise, past the join timeout, with a majority of the healthy replicas
    present: released, the first survivor to ask would be grouped with the grower without the
    other. So while the grower comes, replicas that never ask (`ABSENT`) heartbeat: no majority
    of the healthy can form, only the fast quorum of both survivors and the grower. The hold is
    shorter than the collective timeout (60 s here), so a survivor held in a collective stays."""
    out = tmp_path_factory.mktemp("during") / "run"
    port = free_port()
    common = ["--on-failure", "continue", "--engine", "diloco", "--pseudo-grad-dtype", DURING_COMPRESS,
              "--sync-every", str(SYNC_EVERY), "--sync-delay", str(DURING_DELAY), "--steps",
              str(DURING_STEPS), "--max-restarts", "0", "--snapshot-every", "0", "--eval-every", "0", "--out", str(out),
              *FT_TINY_GPT, "--log-every", str(DURING_STEPS), "--collective-timeout", "60", "--max-replicas", "4",
              "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    command = [sys.executable, "-m", "nanoddp", "train", "--nproc", str(REPLICAS), *common]
    growing = [sys.executable, "-m", "nanoddp", "train", "--nnodes", str(REPLICAS), "--nproc", "1", "--node-rank",
               str(GROWER), *common]  # fmt: skip
    slow_link = dict(os.environ, NANODDP_LINK_LATENCY="300ms")
    grower_log = out.parent / "grower.log"
    grown: list[subprocess.Popen] = []

    def kill_in_the_sync_then_grow(proc) -> bool:
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        pid = wait_for(lambda: proc.poll() is None and replica_pid(launcher, 2), deadline)
        started = lambda r: r.get("event") == "sync" and r["step"] == DURING_START  # noqa: E731
        if not _wait_for_record(proc, out, deadline, started):
            return False
        os.kill(pid, signal.SIGKILL)
        retried = lambda r: r.get("event") == "sync" and r["step"] == DURING_SYNC  # noqa: E731
        if not _wait_for_record(proc, out, deadline, retried):
            return False
        survivors = [replica_pid(launcher, replica) for replica in (0, 1)]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # the grower's own: its start is seconds of imports on a busy host
        with _heartbeating(url, ABSENT):
            held = time.monotonic()
            for survivor in survivors:
                os.kill(survivor, signal.SIGSTOP)
            try:
                with open(grower_log, "w") as log:
                    grown.append(subprocess.Popen(growing, stdout=log, stderr=subprocess.STDOUT, env=slow_link,
                                                  start_new_session=True))  # fmt: skip
                # the survivors' heartbeats have stopped (held): the one replica asking is the grower
                try:
                    wait_for(lambda: time.monotonic() > held + HEARTBEAT_S and _asking(url) == 1, deadline, 0.05)
                except AssertionError:
                    raise AssertionError(f"the grower never asked alone for a quorum ({_asking(url)} asking); "
                                         f"its output:\n{grower_log.read_text()[-3000:]}") from None  # fmt: skip
            finally:
                for survivor in survivors:
                    os.kill(survivor, signal.SIGCONT)
            joined = lambda r: r.get("event") == "sync" and GROWER in r["replicas"]  # noqa: E731
            return _wait_for_record(proc, out, deadline, joined) is not None

    try:
        run = run_training(command, out, timeout_s=240, during=kill_in_the_sync_then_grow, env=slow_link, forked=True)
        assert run.acted and run.returncode == 0, run.output[-5000:]
        assert grown[0].wait(timeout=60) == 0, grower_log.read_text()[-5000:]
    finally:
        for proc in grown:
            end_tree(proc)  # a no-op once it ended
    return out, run, grower_log.read_text()


@contextlib.contextmanager
def _heartbeating(url: str, names: list[str]):
    """Heartbeats for `names` at the Lighthouse `url`, every 0.1 s, while inside."""
    from torchft.coordination import LighthouseClient

    client, stop = LighthouseClient(url, datetime.timedelta(seconds=10)), threading.Event()

    def beat() -> None:
        while not stop.is_set():
            for name in names:
                client.heartbeat(name)
            stop.wait(0.1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join(timeout=30)


def _asking(url: str) -> int:
    """How many healthy replicas ask the Lighthouse at `url` for a quorum now: its status page's
    next-quorum line ends "[H/N participants healthy]" whatever the quorum's state."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    page = direct.open(f"{url}/status", timeout=10).read().decode()
    found = re.search(r"\[([0-9]+)/[0-9]+ participants healthy\]", page)
    assert found, f"no participant count on the Lighthouse's status page:\n{page[:2000]}"
    return int(found.group(1))


def test_a_replica_lost_during_a_sync_the_survivors_retry_it(lost_during_a_sync):
    """The sum started after step 5 failed at the outer step after step 6, on both survivors without
    waiting out a timeout; the retry among the survivors sent what they took after step 5 (nothing
    of the failed try applied), and model.pt equals the replay bitwise."""
    out, run, _ = lost_during_a_sync
    assert f"the sync at step {DURING_SYNC} failed" in run.output, run.output[-3000:]
    # the survivor that saw the loss closed the group at once, so the other's receive from it
    # failed then (its sockets closed), not at the collective timeout (60 s of waiting)
    assert "Timed out waiting" not in run.output, run.output[-3000:]
    syncs = [r for r in run.records if r.get("event") == "sync"]
    assert [(s["step"], s["replicas"], s["samples"]) for s in syncs[:3]] == [
        (2, [0, 1, 2], [8, 8, 8]),  # pieces of 4 (split over 3), 2 steps: the quorum one step early
        (DURING_START, [0, 1, 2], [8, 8, 8]),  # steps 4 and 5 since the outer step after step 3
        (DURING_SYNC, [0, 1], [8, 8]),  # the retry: the survivors' samples as taken after step 5
    ], syncs
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay_during, 1, syncs, timeout=240)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def test_a_grower_joins_at_a_sync_and_the_rounds_after_split_over_one_more(lost_during_a_sync):
    """The grower (replica 3, past the run's 3) came to a run under way, joined at a sync's quorum
    with no samples, healed from a survivor, and from there every step's global batch of 12 was
    split over three (pieces of 4, 8 samples between a quorum and the outer step before it) where
    the survivors had split it over two (pieces of 6, 12); the step records' world sizes say the
    same. The final sync, after step 15, drops the sum started after step 14 and sends steps
    13-15 afresh. The model's bits: the test above (the replay follows these records)."""
    _, run, grower_output = lost_during_a_sync
    assert f"replicas {GROWER}..{GROWER} join it" in grower_output and "resum" not in grower_output.lower()
    syncs = [r for r in run.records if r.get("event") == "sync"]
    starts = list(range(SYNC_EVERY - DURING_DELAY, DURING_STEPS, SYNC_EVERY))  # 2, 5, 8, 11, 14
    assert [s["step"] for s in syncs] == sorted([*starts, DURING_SYNC, DURING_STEPS]), syncs
    at = next(i for i, s in enumerate(syncs) if GROWER in s["replicas"])
    join = syncs[at]
    assert DURING_SYNC < join["step"] < DURING_STEPS - SYNC_EVERY, syncs  # a round after it, split over three
    assert all((s["replicas"], s["samples"]) == ([0, 1], [12, 12]) for s in syncs[3:at]), syncs
    assert (join["replicas"], join["samples"], join["healed_from"][:2]) == ([0, 1, 3], [12, 12, 0], [-1, -1])
    assert join["healed_from"][2] in (0, 1), join
    after = [(s["replicas"], s["samples"], s["healed_from"]) for s in syncs[at + 1 :]]
    full = ([0, 1, 3], [8, 8, 8], [-1, -1, -1])
    assert after == [full] * (len(after) - 1) + [([0, 1, 3], [12, 12, 12], [-1, -1, -1])], after
    sizes = [r["world_size"] for r in run.records if "event" not in r]
    want = [3] * DURING_SYNC + [2] * (join["step"] - DURING_SYNC) + [3] * (DURING_STEPS - join["step"])
    assert sizes == want, sizes
    changes = [(r["event"], r["replicas"]) for r in run.records if r.get("event") in ("rank_lost", "rank_joined")]
    assert changes == [("rank_lost", [2]), ("rank_joined", [GROWER])], changes


def _replay_during(env, syncs):
    return replay_rounds_run(env, syncs, "diloco", replicas=REPLICAS, steps=DURING_STEPS, sync_every=SYNC_EVERY,
                             compress=DURING_COMPRESS, sync_delay=DURING_DELAY)  # fmt: skip


# ---- a straggler -------------------------------------------------------------------------------
# A wider tiny GPT (inner steps of tens of ms, not a few) and longer rounds: the hold below must
# land in a round's inner steps, some hundreds of ms after a sync, not a few ms. Three rounds to try in.
STRAGGLER_MODEL = {"d_model": 256, "d_ff": 2048}
STRAGGLER_SYNC_EVERY, STRAGGLER_STEPS = 6, 30
HOLD_S = 4.0  # a hold that found replica 2 inside a sync ends well within the collective timeout (10 s)


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    """localsgd, 3 replicas (a quorum may form with 2): replica 2 held (SIGSTOP) in a round, so that
    it comes to the round's sync later than the join timeout and the others sync without it; then
    they are held in turn until it asks for its quorum (the grower's note: the Lighthouse forms the
    next one with all three), and it meets them at the next sync, behind: it heals there from a
    peer and goes on, the same process (its round's samples lost).

    The hold is made once a sync's record appears, and must land in the round's steps. A busy
    machine can wake this test late, with replica 2 already asking for the next sync or inside it;
    then that sync does not complete while it is held, so it is let go after HOLD_S (its peers'
    collective waits for it, well within the timeout: nothing fails) and the hold is tried again
    at the next sync's record."""
    out = tmp_path_factory.mktemp("straggler") / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    every = STRAGGLER_SYNC_EVERY
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(REPLICAS),
               "--engine", "localsgd", "--sync-every", str(every), "--steps", str(STRAGGLER_STEPS),
               "--max-restarts", "0", "--no-warm-spare", "--snapshot-every", "0", "--eval-every", "0",
               "--out", str(out), *FT_TINY_GPT, "--log-every", str(STRAGGLER_STEPS),
               *[f"--{name.replace('_', '-')}={value}" for name, value in STRAGGLER_MODEL.items()],
               "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip

    def hold_replica_2_past_a_sync(proc) -> bool:
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        pids = [wait_for(lambda r=r: proc.poll() is None and replica_pid(launcher, r), deadline) for r in range(3)]
        # The replicas run at a lower priority than this test, so that it mostly stops replica 2
        # within milliseconds of a record.
        for pid in pids:
            psutil.Process(pid).nice(10)
        for sync_step in range(every, STRAGGLER_STEPS - every, every):  # it must heal at a later sync
            if _sync_record(proc, out, sync_step, deadline) is None:
                return False
            os.kill(pids[2], signal.SIGSTOP)
            missed = _sync_record(proc, out, sync_step + every, min(deadline, time.monotonic() + HOLD_S))
            if missed is not None and 2 not in missed["replicas"]:
                break  # left out, still held
            os.kill(pids[2], signal.SIGCONT)  # inside that sync (or past it): let it go, try the next round
            missed = _sync_record(proc, out, sync_step + every, deadline)
            if missed is None:
                return False
            if 2 not in missed["replicas"]:
                return True  # left out after all, and running: it asks for the next quorum by itself
        else:
            return False
        # hold its peers until it asks for a quorum, so that the next one has all three
        for pid in pids[:2]:
            os.kill(pid, signal.SIGSTOP)
        os.kill(pids[2], signal.SIGCONT)
        try:
            wait_for(lambda: _asking(url) == 1, deadline, 0.05)
        finally:
            for pid in pids[:2]:
                os.kill(pid, signal.SIGCONT)
        return True

    run = run_training(command, out, timeout_s=180, during=hold_replica_2_past_a_sync, forked=True)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return out, run


def _sync_record(proc, out, step: int, deadline: float) -> dict | None:
    """The record of the sync at `step` (`_wait_for_record`)."""
    return _wait_for_record(proc, out, deadline, lambda r: r.get("event") == "sync" and r["step"] == step)


def test_a_straggler_left_out_of_a_sync_heals_at_the_next_and_goes_on(straggler):
    """A sync went on without replica 2; at the next sync it was behind, healed from a peer with no
    samples of its own, and trained on in the same process (no replacement, no failure); model.pt
    equals the replay of the records bitwise."""
    out, run = straggler
    assert "failed" not in run.output and "replacement" not in run.output, run.output[-3000:]
    syncs = [r for r in run.records if r.get("event") == "sync"]
    missed = next(i for i, s in enumerate(syncs) if 2 not in s["replicas"])
    assert syncs[missed]["replicas"] == [0, 1], syncs
    healed = syncs[missed + 1]
    at = healed["replicas"].index(2)
    assert (healed["samples"][at], healed["healed_from"][at] in (0, 1)) == (0, True), healed
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay_straggler, 1, syncs, timeout=240)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _replay_straggler(env, syncs):
    return replay_rounds_run(
        env,
        syncs,
        "localsgd",
        replicas=REPLICAS,
        steps=STRAGGLER_STEPS,
        sync_every=STRAGGLER_SYNC_EVERY,
        model=STRAGGLER_MODEL,
    )
