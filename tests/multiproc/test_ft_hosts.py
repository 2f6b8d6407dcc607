"""`--on-failure continue` across real hosts: every host a network namespace with its own address
on one bridge (`nanoddp.bench.netns_hosts`), one-rank replicas (`--nproc 1` per host).

One launch (the module fixture) of `nanoddp train --on-failure continue --nnodes 2 --min-replicas 1`,
a tiny GPT, lives through, in order:
- both hosts train together (world size 2); every host's listening sockets are read meanwhile;
- host 1 is killed whole (its launcher and its replica, SIGKILL to every process of its
  namespace): host 0 goes on alone at once, no restart, no snapshot read (world size 1);
- host 1's launcher is started again with the same command: it finds the run under way, and
  its replica joins at a step boundary, takes its state from host 0's replica, without resuming
  from the snapshots OUT holds or waiting for the run's first full group (world size 2 again).

[Note: holding the survivor] A relaunched host spends seconds starting (imports, data, model),
while the survivor's tiny steps take milliseconds: it would finish the run first. So host 0's
replica is held (SIGSTOP) from its second step alone until host 1's replica has asked the quorum
service for a group, as a survivor in a long step (released any earlier, its steps of a few
milliseconds could finish the run while the joiner is still making its Manager). A held process
cannot send the heartbeats a busy survivor sends, so a helper in host 0's namespace sends them
for it (torchft's LighthouseClient, the replica's own id): the quorum service then sees what it
sees of a busy survivor, and the joiner, which asks first, waits for it (torchft forms no group
of half the healthy replicas or fewer) instead of forming a group alone.

Every test but the last reads that one run; the reference for the weights is the single-process
replay of its world-size schedule (`helpers.replay_continue_run`, the one-node continue tests'
own). The last launches `nanoddp run --on-failure continue` across the two hosts: a user's loop
placed alike (replica ids, addresses), both replicas ending with the same weights.
Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import FT_TINY_GPT, OutputReader, replay_continue_run, replica_pid, wait_for

from nanoddp.base.records import read_records
from nanoddp.bench.netns_hosts import NetnsHosts, unavailable_reason

pytest.importorskip("torchft")
pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"namespace hosts: {unavailable_reason()}")

STEPS, SNAPSHOT_EVERY, BOTH_BEFORE_KILL, ALONE_BEFORE_HOLD = 30, 5, 3, 2
PORT = 29510  # inside the namespaces this module made: nothing else listens there
RUN_TIMEOUT_S = 150

# Sends replica 0's heartbeats while the test holds it (see the module's note): once it reaches the
# quorum service, waits for a line on stdin; then beats every 0.1 s for the replica_0 the Lighthouse
# lists, says ASKED once the Lighthouse holds a quorum request (the joiner's: the held survivor asks
# none), and goes on beating until EOF (or says GAVE UP at its deadline).
HEARTBEATS = r"""
import datetime, re, sys, threading, time, urllib.request
from torchft.coordination import LighthouseClient
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
sys.stdin.readline()
replica_id = re.findall(r"(replica_0:[0-9a-f-]+): seen", status())[-1]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
client.heartbeat(replica_id)
print("BEATING " + replica_id, flush=True)
asked = False
while not done.wait(0.1):
    client.heartbeat(replica_id)
    if not asked and re.search(r"only have [1-9][0-9]* participants", status()):
        asked = True
        print("ASKED", flush=True)
    elif not asked and time.monotonic() > deadline:
        asked = True
        print("GAVE UP", flush=True)
"""


def _step_records(out: Path) -> list[dict]:
    with contextlib.suppress(ValueError):  # a line being written
        return [r for r in read_records(out, missing_ok=True) if "event" not in r]
    return []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The one launch every test reads (the module docstring): outputs, records, listeners, model."""
    out = tmp_path_factory.mktemp("ft-hosts") / "run"
    with NetnsHosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:{PORT}"
        train = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nnodes", "2",
                 "--nproc", "1", "--rdzv-endpoint", endpoint, "--min-replicas", "1", "--max-restarts", "0",
                 "--steps", str(STEPS), "--snapshot-every", str(SNAPSHOT_EVERY), "--eval-every", "0",
                 "--out", str(out), *FT_TINY_GPT, "--collective-timeout", "5"]  # fmt: skip

        def launch(host: int) -> subprocess.Popen:
            argv = hosts.command(host, [*train, "--node-rank", str(host)])
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        procs: list[subprocess.Popen] = []
        outputs: list[OutputReader] = []
        helper = hosts.popen(0, [sys.executable, "-c", HEARTBEATS, f"http://{endpoint}"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, RUST_LOG="error"))  # fmt: skip
        try:
            started = time.monotonic()
            deadline = started + RUN_TIMEOUT_S
            for host in (1, 0):  # host 1 first: it reads the quorum service before host 0's replica forms a group
                procs.append(launch(host))
                outputs.append(OutputReader(procs[-1]))
            first, zero = procs
            assert helper.stdout.readline().strip() == "READY"

            def records_where(world_size: int, count: int):
                def enough():
                    assert all(p.poll() is None for p in procs), "a launcher ended early"
                    return len([r for r in _step_records(out) if r["world_size"] == world_size]) >= count

                return wait_for(enough, deadline, step_s=0.01)

            records_where(2, BOTH_BEFORE_KILL)
            listening = {host: hosts.listening(host) for host in (0, 1)}
            survivor = replica_pid(psutil.Process(zero.pid), 0)
            assert survivor is not None
            hosts.kill(1)
            assert first.wait(timeout=30) == -signal.SIGKILL and not hosts.pids(1)
            killed_output = outputs[0].done()

            # host 0 alone, then held (the module's note); its heartbeats sent for it meanwhile
            procs.remove(first)
            records_where(1, ALONE_BEFORE_HOLD)
            os.kill(survivor, signal.SIGSTOP)  # its last heartbeat was at most 0.1 s ago: the helper's come well
            try:  # within the quorum service's heartbeat timeout (2 s)
                helper.stdin.write("beat\n")
                helper.stdin.flush()
                assert helper.stdout.readline().startswith("BEATING replica_0:")
                again = launch(1)  # the same command, on the same host
                procs.append(again)
                outputs.append(OutputReader(again))
                assert helper.stdout.readline().strip() == "ASKED"  # host 1's replica waits for a quorum
            finally:
                os.kill(survivor, signal.SIGCONT)
            helper.stdin.close()
            for proc in [*procs, helper]:
                with contextlib.suppress(subprocess.TimeoutExpired):  # the exit codes below say it
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            wall_s = time.monotonic() - started
            texts = [killed_output, outputs[1].done(), outputs[2].done()]
            left = {host: hosts.pids(host) for host in (0, 1)}
        finally:
            for proc in [*procs, helper]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        child.kill()
                proc.kill()
                proc.wait(timeout=30)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    codes = [zero.returncode, again.returncode]
    assert codes == [0, 0], "\n".join(f"--- {name}\n{text[-4000:]}" for name, text in
                                      zip(("host 1", "host 0", "host 1 again"), texts, strict=True))  # fmt: skip
    return {
        "records": read_records(out),
        "outputs": dict(zip(("host 1", "host 0", "host 1 again"), texts, strict=True)),
        "listening": listening,
        "addresses": hosts.addresses,
        "left": {**left, "helper": helper.returncode, "namespaces": [n for n in hosts.names if n in namespaces]},
        "model": torch.load(out / "model.pt", weights_only=True),
        "wall_s": wall_s,
    }


def _history(records: list[dict]) -> list[int]:
    return [r["world_size"] for r in records if "event" not in r]


def test_a_host_lost_and_started_again_equals_a_replay_bitwise(run):
    """model.pt (the group's rank 0, on host 0) equals the replay of the run's schedule: host 0's
    steps alone, and the joiner's pieces after it joined, were each computed on the right weights."""
    history = _history(run["records"])
    assert len(history) == STEPS, history
    want = replay_continue_run(history, replicas=2)
    assert run["model"].keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(run["model"][name], value), f"{name}: {(run['model'][name] - value).abs().max()}"


def test_the_survivor_went_on_alone_and_the_host_rejoined(run):
    """World size 2, then 1 from the step the kill cost (no restart: the same process, no snapshot
    read, each step recorded once), then 2 again once host 1's replica joined."""
    records = run["records"]
    history = _history(records)
    assert [r["step"] for r in records if "event" not in r] == list(range(1, STEPS + 1))
    alone = [i for i, size in enumerate(history) if size == 1]
    assert history[:BOTH_BEFORE_KILL] == [2] * BOTH_BEFORE_KILL and history[-1] == 2, history
    assert alone and alone == list(range(alone[0], alone[-1] + 1)) and len(alone) >= ALONE_BEFORE_HOLD, history
    changes = [(r["event"], r["world_size"], r["replicas"]) for r in records if r.get("event", "eval") != "eval"]
    assert changes == [("rank_lost", 1, [1]), ("rank_joined", 2, [1])], changes
    assert not any(r.get("event") == "resumed_from_snapshot" for r in records)
    said = [line for line in run["outputs"]["host 0"].splitlines() if line.startswith("nanoddp train: replica")]
    assert said == [], said  # host 0's launcher saw no replica of its own fail, and started none


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


def test_nothing_outlives_the_run(run):
    """No process in either host once both launchers ended (the helper ended by its input), and
    the namespaces removed."""
    assert run["left"] == {0: [], 1: [], "helper": 0, "namespaces": []}, run["left"]


# ---- `nanoddp run --on-failure continue` across hosts -----------------------------------------

LOOP = """
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
print("FINAL", env.replica, env.address, ft.history, params, flush=True)
ft.close()
"""


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_nanoddp_run_places_a_users_loop_across_hosts(tmp_path):
    """`nanoddp run` takes the same flags: each host's replica has its id of the run's two and its
    host's address, both step at world size 2, and end with the same weights."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    with NetnsHosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:{PORT + 1}"
        procs = [
            hosts.popen(host, [sys.executable, "-m", "nanoddp", "run", "--on-failure", "continue", "--nnodes", "2",
                               "--node-rank", str(host), "--nproc", "1", "--rdzv-endpoint", endpoint,
                               "--collective-timeout", "5", str(script)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    (zero, address0, *rest0), (one, address1, *rest1) = (final.split(" ", 2) for final in finals)
    assert (zero, one, address0, address1) == ("0", "1", *hosts.addresses), finals
    assert rest0 == rest1 and rest0[0].startswith("[2, 2, 2, 2] "), finals  # the same history and weights
