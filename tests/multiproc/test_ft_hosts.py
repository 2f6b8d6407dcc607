"""`--on-failure continue` across real hosts: every host a network namespace with its own address
on one bridge (`nanoddp.bench.netns_hosts`), each host one replica group of 2 processes (`--nproc
2`, the default `--group-size` across hosts) training `--engine hsdp`: FSDP over the host's two
processes, replicated across the hosts.

One launch (the module fixture) of `nanoddp train --on-failure continue --engine hsdp --nproc 2
--nnodes 2 --max-replicas 3 --min-replicas 1`, a tiny GPT, lives through, in order:
- both hosts train together (world size 2); every host's listening sockets are read meanwhile;
- host 1 is killed whole (its launcher and its replica's processes, SIGKILL to every process of
  its namespace): host 0 goes on alone at once, no restart, no snapshot read (world size 1);
- host 1's launcher is started again with the same command: it finds the run under way, and
  its replica group joins at a step boundary, each process taking its shard of the state from
  the process of host 0 that holds the same shard, without resuming from the snapshots OUT holds
  or waiting for the run's first full group (world size 2 again);
- host 2, node rank 2 of a run of two hosts, grows it: its replica joins alike, and every step
  after is split over three (world size 3);
- two hosts lost in a row at 3 hosts: host 1 killed whole (hosts 0 and 2 go on, world size 2),
  then host 2 hung whole (SIGSTOP to every process of its namespace: its launcher cannot see it;
  host 0 goes on alone once its collective with host 2 times out, world size 1 to the end).

[Note: holding the running replicas] A host spends seconds starting (imports, data, model), while
the running replicas' tiny steps take milliseconds: they would finish the run first. So they are
held (SIGSTOP to every process of the replica group, its session) while a host starts, until its
replica has asked the quorum service for a group, as replicas in a long step (released any earlier,
their steps of a few milliseconds could finish the run while the joiner is still making its
Manager); and likewise while a host is killed, so that the run cannot end before the kill, nor the
others form a group without a held one. The collective timeout is longer than a hold, so a replica
held inside a collective does not time its peer out. A held process cannot send the heartbeats a
busy replica sends, so a helper in host 0's namespace sends them for it (torchft's
LighthouseClient, the replica's own id): the quorum service then sees what it sees of busy
replicas, and the joiner, which asks first, waits for them (torchft forms no group of half the
healthy replicas or fewer) instead of forming a group without them. A replica held while it was
asking for a quorum would be grouped with the joiner without the other: such a hold is released and
made again.

Every test but the last reads that one run; the reference for the weights and the losses is the
replay of its world-size schedule over one group's two processes (`helpers.replay_engine_run`,
the engine tests' own). The last launches `nanoddp run --on-failure continue` across the two hosts:
a user's loop placed alike (replica ids, addresses), both replicas ending with the same weights.
And `--engine localsgd` (the low-communication loop, a quorum per sync) across two hosts, the
quorum service a Lighthouse on a third (`--lighthouse`), loses node 0 mid-run: host 1 goes on
alone from the next sync, bitwise equal to the replay of its sync records
(`rounds_replay.replay_rounds_run`).
Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (
    FT_TINY_GPT,
    OutputReader,
    lighthouse_on,
    replay_engine_run,
    replica_pid,
    run_on_ranks,
    wait_for,
)
from rounds_replay import replay_rounds_run

from nanoddp.base.records import read_records
from nanoddp.bench.netns_hosts import NetnsHosts, unavailable_reason

pytest.importorskip("torchft")
pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"namespace hosts: {unavailable_reason()}"),
    pytest.mark.usefixtures("cpu_processes"),  # compared with CPU replays, also where a GPU is
]

STEPS, SNAPSHOT_EVERY, BOTH_BEFORE_KILL, ALONE_BEFORE_HOLD, BOTH_BEFORE_GROWTH = 50, 5, 3, 2, 2
THREE_BEFORE_LOSS, TWO_BEFORE_LOSS = 2, 2  # steps of the grown run, then of the two left, before each loss
GROUP = 2  # processes per host: one replica group each (--nproc 2, the default --group-size across hosts)
PORT = 29510  # inside the namespaces this module made: nothing else listens there
RUN_TIMEOUT_S = 240  # the hung host costs the collective timeout (HELD_MAX_S) on top
HELD_MAX_S = 60  # the collective timeout: a replica held mid-step (a long step) must not time out its peer
HOLD_TRIES = 20  # holds of both replicas until one finds neither asking for a quorum (the module's note)

# Sends held replicas' heartbeats (the module's note). Says IMPORTED once its imports are done (the
# launchers start after it), READY once it reaches the quorum service, then reads commands on stdin:
# `beat K..` beats every 0.1 s for replica K's newest id the Lighthouse lists (the
# held process's); `count` says how many replicas ask for a quorum now; `wait N` says ASKED once more
# than N do (or GAVE UP at 120 s); `rest` stops beating. EOF ends it.
HEARTBEATS = r"""
import datetime, re, sys, threading, time, urllib.request
from torchft.coordination import LighthouseClient
print("IMPORTED", flush=True)
url, deadline = sys.argv[1], time.monotonic() + 120
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
status = lambda: opener.open(url + "/status", timeout=10).read().decode()
while True:  # the quorum service starts with node 0's launcher, maybe after this helper
    try:
        client = LighthouseClient(url, datetime.timedelta(seconds=10))
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
print("READY", flush=True)
beating, lock = [], threading.Lock()
def beat():
    while True:
        with lock:
            for replica_id in beating:
                client.heartbeat(replica_id)
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "ns": 1e-9}
def newest(page, k):
    seen = re.findall(rf"(replica_{k}:[0-9a-f-]+): seen ([0-9.]+)(s|ms|µs|ns) ago", page)
    return min(seen, key=lambda row: float(row[1]) * UNITS[row[2]])[0]
def asking():
    found = re.search(r"only have ([0-9]+) participants", status())
    return int(found.group(1)) if found else 0
for line in sys.stdin:
    command, *given = line.split()
    if command == "beat":
        page = status()
        with lock:
            beating[:] = [newest(page, int(k)) for k in given]
            for replica_id in beating:
                client.heartbeat(replica_id)
        print("BEATING " + " ".join(beating), flush=True)
    elif command == "count":
        print(f"COUNT {asking()}", flush=True)
    elif command == "wait":
        until = time.monotonic() + 120
        while asking() <= int(given[0]) and time.monotonic() < until:
            time.sleep(0.1)
        print("ASKED" if time.monotonic() < until else "GAVE UP", flush=True)
    elif command == "rest":
        with lock:
            beating.clear()
        print("RESTING", flush=True)
"""


def _step_records(out: Path) -> list[dict]:
    with contextlib.suppress(ValueError):  # a line being written
        return [r for r in read_records(out, missing_ok=True) if "event" not in r]
    return []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The one launch every test reads (the module docstring): outputs, records, listeners, model."""
    out = tmp_path_factory.mktemp("ft-hosts") / "run"
    with NetnsHosts(3) as hosts:
        endpoint = f"{hosts.addresses[0]}:{PORT}"
        train = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nnodes", "2",
                 "--max-replicas", "3", "--nproc", str(GROUP), "--engine", "hsdp", "--rdzv-endpoint", endpoint,
                 "--min-replicas", "1",
                 "--max-restarts", "0", "--steps", str(STEPS), "--snapshot-every", str(SNAPSHOT_EVERY),
                 "--eval-every", "0", "--out", str(out), *FT_TINY_GPT,
                 "--collective-timeout", str(HELD_MAX_S)]  # fmt: skip

        def launch(host: int) -> subprocess.Popen:
            """A fresh interpreter, not `hosts.fork`: forked launchers start in milliseconds, and
            the holds below were tuned to launchers that take seconds (forked, a busy run once
            left replicas out of quorums in a way the checks do not allow for)."""
            argv = hosts.command(host, [*train, "--node-rank", str(host)])
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        procs: list[subprocess.Popen] = []
        outputs: list[OutputReader] = []
        helper = hosts.popen(0, [sys.executable, "-c", HEARTBEATS, f"http://{endpoint}"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, RUST_LOG="error"))  # fmt: skip

        def tell(command: str) -> str:
            helper.stdin.write(command + "\n")
            helper.stdin.flush()
            return helper.stdout.readline().strip()

        def start_again(host: int) -> subprocess.Popen:
            started = launch(host)  # the same command, on that host
            procs.append(started)
            outputs.append(OutputReader(started))
            assert tell("wait 0") == "ASKED"  # the new host's replica waits for a quorum
            return started

        def kill_host(host: int, launcher: subprocess.Popen) -> str:
            """Every process of `host` SIGKILLed at once (the host is gone); its launcher's output."""
            hosts.kill(host)
            assert launcher.wait(timeout=30) == -signal.SIGKILL and not hosts.pids(host)
            procs.remove(launcher)
            return outputs[[o.proc for o in outputs].index(launcher)].done()

        def hang_host(host: int) -> None:
            """Every process of `host` stopped at once (the host hangs: nothing on it runs any more)."""
            for pid in hosts.pids(host):
                os.kill(pid, signal.SIGSTOP)

        def hold(pids: list[int], replicas: str, action):
            """`action()` while `pids` (replicas `replicas`: each its group's rank 0, which leads the
            group's session) are held, every process of their groups, their heartbeats sent for them;
            hold again while one of them was asking for a quorum when held (the module's note)."""
            for _ in range(HOLD_TRIES):
                for pid in pids:
                    os.killpg(pid, signal.SIGSTOP)  # their last heartbeats were at most 0.1 s ago: the helper's
                try:  # come well within the quorum service's heartbeat timeout (1 s)
                    assert tell(f"beat {replicas}").startswith("BEATING replica_"), "no heartbeat id"
                    if tell("count") == "COUNT 0":
                        return action()
                finally:
                    for pid in pids:
                        os.killpg(pid, signal.SIGCONT)
                    assert tell("rest") == "RESTING"
                time.sleep(0.01)
            raise AssertionError(f"replicas {replicas} were asking for a quorum at each of {HOLD_TRIES} holds")

        try:
            started = time.monotonic()
            deadline = started + RUN_TIMEOUT_S
            # the helper's imports take seconds on a busy machine: the launchers start once they are
            # done, so that the run cannot get far before the helper reaches the quorum service
            assert helper.stdout.readline().strip() == "IMPORTED"
            for host in (1, 0):  # host 1 first: it reads the quorum service before host 0's replica forms a group
                procs.append(launch(host))
                outputs.append(OutputReader(procs[-1]))
            first, zero = procs
            assert helper.stdout.readline().strip() == "READY"

            def records_where(world_size: int, count: int, after: int = 0):
                """Wait for `count` step records at `world_size` past the last at world size `after`."""

                def enough():
                    ended = [i for i, p in enumerate(procs) if p.poll() is not None]
                    assert not ended, "a launcher ended early:\n" + "\n".join(outputs[i].done()[-3000:] for i in ended)
                    sizes = [r["world_size"] for r in _step_records(out)]
                    since = max((i + 1 for i, size in enumerate(sizes) if size == after), default=0)
                    return sizes[since:].count(world_size) >= count

                return wait_for(enough, deadline, step_s=0.01)

            records_where(2, BOTH_BEFORE_KILL)
            listening = {host: hosts.listening(host) for host in (0, 1)}
            survivor = replica_pid(psutil.Process(zero.pid), 0)
            assert survivor is not None
            killed_output = kill_host(1, first)

            # host 0 alone, then held while host 1 starts again (the module's note)
            records_where(1, ALONE_BEFORE_HOLD)
            again = hold([survivor], "0", lambda: start_again(1))
            rejoined = wait_for(lambda: replica_pid(psutil.Process(again.pid), 1), deadline)

            # both together again, then both held while host 2 grows the run
            records_where(2, BOTH_BEFORE_GROWTH, after=1)
            grower = hold([survivor, rejoined], "0 1", lambda: start_again(2))
            grown = wait_for(lambda: replica_pid(psutil.Process(grower.pid), 2), deadline)

            # two hosts lost in a row: host 1 killed while hosts 0 and 2 are held, then host 2 hung
            # while host 0 is (ended once host 0's launcher has: a hung host is nobody's to end)
            records_where(3, THREE_BEFORE_LOSS)
            killed_again = hold([survivor, grown], "0 2", lambda: kill_host(1, again))
            records_where(2, TWO_BEFORE_LOSS, after=3)
            hold([survivor], "0", lambda: hang_host(2))
            helper.stdin.close()
            for proc in [zero, helper]:
                with contextlib.suppress(subprocess.TimeoutExpired):  # the exit codes below say it
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            wall_s = time.monotonic() - started
            texts = [killed_output, outputs[1].done(), killed_again, kill_host(2, grower)]
            left = {host: hosts.pids(host) for host in (0, 1, 2)}
        finally:
            for proc in [*procs, helper]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        child.kill()
                proc.kill()
                proc.wait(timeout=30)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = ("host 1", "host 0", "host 1 again", "host 2")
    codes = [zero.returncode, again.returncode, grower.returncode]
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL], "\n".join(f"--- {name}\n{text[-4000:]}" for name, text in
                                         zip(names, texts, strict=True))  # fmt: skip
    return {
        "records": read_records(out),
        "outputs": dict(zip(names, texts, strict=True)),
        "listening": listening,
        "addresses": hosts.addresses,
        "left": {**left, "helper": helper.returncode, "namespaces": [n for n in hosts.names if n in namespaces]},
        "model": torch.load(out / "model.pt", weights_only=True),
        "wall_s": wall_s,
    }


def _history(records: list[dict]) -> list[int]:
    return [r["world_size"] for r in records if "event" not in r]


# A replica left out for lateness is back within this many steps: any number. A replica group asks
# for a quorum once its last member has (torchft's server for the group waits for all of them), so
# with 2 processes a host beside busy cores one can be late at quorum after quorum while the others'
# steps take milliseconds: busy fresh-clone runs saw a group out for 6 and for 14 steps, then back
# (bitwise the replay all the same). With --max-restarts 0 nothing replaces a replica, so one that
# rejoins is the same process, left out and healed: lateness, however long.
LATE_MAX_STEPS = STEPS


def _without_late_replicas(records: list[dict], history: list[int], changes: list[tuple]) -> tuple[list, list]:
    """`history` and `changes` as if no replica had been late to a quorum after the host's rejoin.

    The quorum service leaves out a live replica that asks for a group more than its JOIN_MS after
    the others (`ft/quorum_service.py`), as it must to go on without a lost one; on a loaded
    machine a replica descheduled that long is left out of a step and heals back at the next.
    That is a `rank_lost` and a `rank_joined` of the same replica, the world size restored within
    LATE_MAX_STEPS steps. The bitwise replay (the test above) replays such steps too; here the
    schedule the test made is judged without them. The kill's pair (first two events) stays."""
    events = [r for r in records if r.get("event", "eval") != "eval"]
    kept, judged, i = changes[:2], list(history), 2
    while i < len(changes):
        lost, joined = changes[i], changes[i + 1] if i + 1 < len(changes) else None
        late = (
            joined is not None and lost[0] == "rank_lost" and joined[0] == "rank_joined"
            and lost[2] == joined[2] and joined[1] == lost[1] + 1
            and 0 < events[i + 1]["step"] - events[i]["step"] <= LATE_MAX_STEPS
        )  # fmt: skip
        if not late:
            kept.append(changes[i])
            i += 1
            continue
        for step in range(events[i]["step"], events[i + 1]["step"]):  # 1-based: the steps it missed
            judged[step - 1] = joined[1]
        i += 2
    return judged, kept


@pytest.fixture(scope="module")
def replayed(run):
    """The replay of the run's world-size schedule over one group's processes: its weights and each
    step's loss."""
    return run_on_ranks(_replay_hsdp, GROUP, _history(run["records"]), timeout=240)[0]


def _replay_hsdp(env, history: list[int]) -> tuple[dict[str, torch.Tensor], list[float]]:
    losses: list[float] = []
    return replay_engine_run(env, history, "hsdp", replicas=2, losses=losses), losses


def test_a_host_lost_started_again_and_grown_equals_a_replay_bitwise(run, replayed):
    """model.pt (the group's rank 0) equals the replay of the run's schedule: host 0's steps alone,
    the joiner's pieces after it joined, and the grower's after it grew the run, were each computed
    on the right weights; and every step's recorded loss is the replay's."""
    history = _history(run["records"])
    assert len(history) == STEPS, history
    want, losses = replayed
    assert run["model"].keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(run["model"][name], value), f"{name}: {(run['model'][name] - value).abs().max()}"
    assert [r["loss"] for r in run["records"] if "event" not in r] == losses


def _phases(history: list[int]) -> list[tuple[int, int]]:
    """The world sizes in the order the run had them, each with its count of steps in a row."""
    return [(size, len(list(steps))) for size, steps in itertools.groupby(history)]


def test_the_survivor_went_on_alone_the_host_rejoined_a_third_grew_the_run_and_two_were_lost(run):
    """World size 2, then 1 from the step the kill cost (no restart: the same process, no snapshot
    read, each step recorded once), then 2 again once host 1's replica joined, then 3 once host
    2's did (node rank 2 of --nnodes 2, under --max-replicas 3); then 2 once host 1 was killed
    again, and 1 to the end once host 2 hung (two hosts lost in a row at 3 hosts)."""
    records = run["records"]
    history = _history(records)
    assert [r["step"] for r in records if "event" not in r] == list(range(1, STEPS + 1))
    changes = [(r["event"], r["world_size"], r["replicas"]) for r in records if r.get("event", "eval") != "eval"]
    history, changes = _without_late_replicas(records, history, changes)
    phases = _phases(history)
    assert [size for size, _ in phases] == [2, 1, 2, 3, 2, 1], phases
    least = [BOTH_BEFORE_KILL, ALONE_BEFORE_HOLD, BOTH_BEFORE_GROWTH, THREE_BEFORE_LOSS, TWO_BEFORE_LOSS, 1]
    assert all(count >= at_least for (_, count), at_least in zip(phases, least, strict=True)), phases
    assert changes == [
        ("rank_lost", 1, [1]), ("rank_joined", 2, [1]), ("rank_joined", 3, [2]),
        ("rank_lost", 2, [1]), ("rank_lost", 1, [2]),
    ], changes  # fmt: skip
    assert not any(r.get("event") == "resumed_from_snapshot" for r in records)
    said = [line for line in run["outputs"]["host 0"].splitlines() if line.startswith("nanoddp train: replica")]
    assert said == [], said  # host 0's launcher saw no replica of its own fail, and started none


def test_a_grown_step_splits_the_same_global_batch_over_three(run):
    """Each step at world size 3 took the pieces `share` cuts of the step's global batch (its
    recorded loss is the replay's over those pieces: the test above), and those three pieces
    partition that batch: every sample once, none lost, none twice."""
    from nanoddp.ft.global_batches import GlobalBatches, share

    history = _history(run["records"])
    batches = GlobalBatches(len(_tiny_gpt_train_set()), 12, 0)
    for step in (i for i, size in enumerate(history) if size == 3):
        batch = batches.indices(step)
        pieces = [batch[share(12, rank, 3)].tolist() for rank in range(3)]
        assert all(len(piece) == 4 for piece in pieces), pieces
        assert sorted(sum(pieces, [])) == sorted(batch.tolist()) and len(set(batch.tolist())) == 12, (step, pieces)


def _tiny_gpt_train_set():
    from nanoddp.train.config import TrainConfig
    from nanoddp.train.recipe import build_job

    config = TrainConfig(text_max_bytes=1900, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, batch_size=12)
    return build_job(config).train_set


def test_the_host_started_again_joins_without_resuming_or_waiting(run):
    """Its launcher found the run under way; its replica neither resumed from the snapshots OUT held
    nor waited for the run's first full group (a first process logs that group, a joiner never)."""
    again = run["outputs"]["host 1 again"]
    assert "nanoddp train: the run is under way at http://" in again and "replicas 1..1 join it" in again, again
    assert "resum" not in again.lower() and "group of 2 replicas formed" not in again, again
    assert "group of 2 replicas formed" in run["outputs"]["host 0"]


def test_every_listener_binds_its_hosts_address(run):
    """Read while both hosts trained: the quorum service, each replica's Manager, group store and
    gloo sockets; nothing on every interface, nothing on another host's address."""
    for host, found in run["listening"].items():
        own = run["addresses"][host]
        assert own in found and found <= {own, "127.0.0.1"}, (host, found)


def test_the_grower_joins_without_resuming_or_waiting(run):
    """Host 2's launcher found the run under way (the run's first group had formed) and its replica
    took its state from a peer: no resume from the snapshots OUT held, no wait for a first group."""
    grower = run["outputs"]["host 2"]
    assert "nanoddp train: the run is under way at http://" in grower and "replicas 2..2 join it" in grower, grower
    assert "resum" not in grower.lower() and "replicas formed" not in grower, grower


def test_nothing_outlives_the_run(run):
    """No process in any host once the launchers ended (the helper ended by its input), and the
    namespaces removed."""
    assert run["left"] == {0: [], 1: [], 2: [], "helper": 0, "namespaces": []}, run["left"]


# ---- `nanoddp run --on-failure continue` across hosts -----------------------------------------

LOOP = """
import os
import torch
torch.set_num_threads(1)
from nanoddp.ft import FaultTolerant, ReplicaEnv

env = ReplicaEnv.from_environ()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)
ft = FaultTolerant(model, opt, dataset_len=24, batch_size=8, seed=0, env=env)
for step in ft.steps(4):
    idx = ft.batch_for(step)
    loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
    loss.backward()
    ft.average_gradients(loss)
    ft.commit()
params = [p.detach().flatten().tolist() for p in model.parameters()]
sockets = ",".join(os.environ[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
print("FINAL", env.replica, env.address, sockets, ft.history, params, flush=True)
ft.close()
"""


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_nanoddp_run_places_a_users_loop_across_hosts(tmp_path):
    """`nanoddp run` takes the same flags: each host's replica has its id of the run's two and its
    host's address, gloo's and nccl's sockets on the host's interface, both step at world size 2,
    and end with the same weights."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    with NetnsHosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:{PORT + 1}"
        procs = [
            hosts.fork(host, [sys.executable, "-m", "nanoddp", "run", "--on-failure", "continue", "--nnodes", "2",
                              "--node-rank", str(host), "--nproc", "1", "--rdzv-endpoint", endpoint,
                              "--collective-timeout", "5", str(script)])
            for host in (1, 0)
        ]  # fmt: skip
        try:
            outputs = [proc.communicate(timeout=RUN_TIMEOUT_S - 30)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    finals = sorted(line.split("FINAL ", 1)[1] for out in outputs for line in out.splitlines() if "FINAL " in line)
    assert len(finals) == 2, outputs
    (zero, address0, sockets0, *rest0), (one, address1, sockets1, *rest1) = (f.split(" ", 3) for f in finals)
    assert (zero, one, address0, address1) == ("0", "1", *hosts.addresses), finals
    assert sockets0 == sockets1 == "eth0,eth0", finals  # each host's one interface (`NetnsHosts`)
    assert rest0 == rest1 and rest0[0].startswith("[2, 2, 2, 2] "), finals  # the same history and weights


# ---- the low-communication loop across hosts, losing node 0 -----------------------------------
ROUNDS_STEPS, ROUNDS_SYNC_EVERY, ROUNDS_KILL_AFTER = 200, 10, 20
ROUNDS_RUN_S = 240  # 200 steps of two replicas on a loaded machine, with start-up


@pytest.mark.timeout(ROUNDS_RUN_S + 120)  # + the replay
def test_localsgd_across_hosts_goes_on_without_node_0_and_equals_the_replay(tmp_path):
    """`--engine localsgd` under continue across two hosts (`nanoddp.ft.rounds`: a quorum per sync,
    none between), the quorum service a Lighthouse of its own on a third host (`--lighthouse`, as
    docs/ft.md says to run it where node 0 may be lost): node 0 (the host whose replica writes the
    records) is killed whole once step ROUNDS_KILL_AFTER is recorded; host 1 goes on alone from the
    next sync (`--min-replicas 1`), writes the records and `model.pt` from there, and `model.pt`
    equals, bitwise, the one-process replay of the run's sync records."""
    out = tmp_path / "run"
    with NetnsHosts(3) as hosts:
        lighthouse, service = lighthouse_on(hosts, 2, PORT + 2)
        train = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nnodes", "2", "--nproc", "1",
                 "--lighthouse", lighthouse, "--min-replicas", "1", "--max-restarts", "0", "--engine", "localsgd",
                 "--sync-every", str(ROUNDS_SYNC_EVERY), "--steps", str(ROUNDS_STEPS), "--snapshot-every", "0",
                 "--eval-every", "0", "--out", str(out), *FT_TINY_GPT]  # fmt: skip
        procs = {host: hosts.fork(host, [*train, "--node-rank", str(host)]) for host in (1, 0)}
        outputs = {host: OutputReader(proc) for host, proc in procs.items()}
        try:
            deadline = time.monotonic() + ROUNDS_RUN_S
            steps = lambda: [r["step"] for r in _step_records(out)]  # noqa: E731
            wait_for(lambda: procs[1].poll() is None and max(steps(), default=0) >= ROUNDS_KILL_AFTER, deadline, 0.002)
            hosts.kill(0)
            assert procs[0].wait(timeout=30) == -signal.SIGKILL
            assert procs[1].wait(timeout=max(1.0, deadline - time.monotonic())) == 0, outputs[1].done()[-3000:]
        finally:
            for proc in (*procs.values(), service):
                proc.kill()
                proc.wait(timeout=30)
    output = outputs[1].done()
    syncs = [r for r in read_records(out) if r.get("event") == "sync"]
    members = [s["replicas"] for s in syncs]
    assert [0, 1] in members and members[-1] == [1], (members, output[-3000:])
    lost = members.index([1])  # from here on host 1 alone, its round's samples its own
    assert members[lost:] == [[1]] * (len(members) - lost) and members[:lost] == [[0, 1]] * lost, members
    assert [s["step"] for s in syncs] == list(range(ROUNDS_SYNC_EVERY, ROUNDS_STEPS + 1, ROUNDS_SYNC_EVERY))
    got = torch.load(out / "model.pt")
    want = run_on_ranks(_replay_rounds, 1, syncs, timeout=240)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {(got[name] - want[name]).abs().max()}"


def _replay_rounds(env, syncs):
    return replay_rounds_run(env, syncs, "localsgd", replicas=2, steps=ROUNDS_STEPS, sync_every=ROUNDS_SYNC_EVERY)
