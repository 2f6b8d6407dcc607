"""Multi-node across real addresses: every node a network namespace with its own address on one
bridge (`nanoddp.bench.netns_hosts`), the hostname resolving to 127.0.0.1 in all of them.

- `nanoddp.hosts` inside a namespace: the interface and source address towards a peer, its own
  address, loopback; the store's host is the one that owns the endpoint's address.
- Three hosts (`--nproc 1` each, the store's host started last), every listener of a host on its
  own address (never *, never 127.0.0.1 where peers must dial), the store's host decided by
  address; one host SIGKILLed whole after a snapshot and started again: the job resumes on the
  restart path (`--max-restarts`) and ends bitwise equal to the same job with all ranks on one
  host. (One launch checks what a two-host run and a three-host run with a kill each did.)
- `nanoddp run` with the static backend: a script's all_reduce across two hosts.
- An endpoint nobody serves, or a node left alone, is one line naming the endpoint within
  `--rdzv-timeout`; one without a route is refused in one line before anything starts, by
  `nanoddp train` and `nanoddp run` alike.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from helpers import OutputReader

from nanoddp.base.records import read_records
from nanoddp.bench.netns_hosts import NetnsHosts, unavailable_reason
from nanoddp.bench.training_run import forked_child
from nanoddp.fork_server import ForkedModule

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"namespace hosts: {unavailable_reason()}"),
    pytest.mark.usefixtures("cpu_processes"),  # compared with CPU replays, also where a GPU is
]

# GPT tiny on 32-byte windows (~0.2 s a step on 2 busy cores, so a kill after step 5 lands mid-run);
# logged at each snapshot step, so that a resumed run averages the same steps per record
TRAIN_ARGS = [
    "--steps", "15", "--snapshot-every", "5", "--seq-len", "32", "--batch-size", "12",
    "--text-max-bytes", "200000", "--log-every", "5", "--eval-every", "0", "--no-progress",
]  # fmt: skip
RUN_TIMEOUT_S = 300
PORT = 29500  # inside the namespaces the test made: nothing else listens there


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    """Three namespace hosts for the whole module (two-host cases use the first two)."""
    with NetnsHosts(3) as fabric:
        yield fabric


def _train(hosts: NetnsHosts | None, host: int, *args: str) -> ForkedModule:
    """`nanoddp train TRAIN_ARGS ARGS` inside `host` (None: on this machine, as one host), forked
    from the tests' fork server."""
    argv = [sys.executable, "-m", "nanoddp", "train", *TRAIN_ARGS, *args]
    return forked_child(argv) if hosts is None else hosts.fork(host, argv)


def _node(hosts: NetnsHosts, host: int, nnodes: int, out: Path, *extra: str) -> ForkedModule:
    endpoint = f"{hosts.addresses[0]}:{PORT}"
    return _train(hosts, host, "--nproc", "1", "--nnodes", str(nnodes), "--node-rank", str(host),
                  "--rdzv-endpoint", endpoint, "--rdzv-id", "netns", "--out", str(out), *extra)  # fmt: skip


def _finish_all(hosts: NetnsHosts | None, procs: list[ForkedModule]) -> list[str]:
    """Wait for launchers that make one job; on a failure or timeout kill every host's processes
    (and every launcher) and fail with all outputs."""
    outputs = [OutputReader(proc) for proc in procs]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    failed = any(p.poll() != 0 for p in procs)
    if failed:
        _kill_everything(hosts, procs)
    texts = [output.done() for output in outputs]
    if failed:
        report = "\n".join(f"--- launcher {i}: exit {p.returncode}\n{texts[i][-3000:]}" for i, p in enumerate(procs))
        pytest.fail(f"a launcher failed or did not finish in {RUN_TIMEOUT_S}s:\n{report}")
    return texts


def _kill_everything(hosts: NetnsHosts | None, procs: list[ForkedModule]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.wait(timeout=30)
    if hosts is not None:
        for host in range(len(hosts.names)):
            hosts.kill(host)


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_records(run_dir) if "loss" in r]


def _assert_same_run(expected: Path, got: Path) -> None:
    want, have = _params(expected), _params(got)
    assert want.keys() == have.keys()
    for name, value in want.items():
        assert torch.equal(value, have[name]), f"{name} differs from the one-host run"
    assert _losses(expected) == _losses(got)


@pytest.fixture(scope="module")
def one_host_runs(tmp_path_factory) -> dict[int, Path]:
    """The reference job: all 3 ranks on one host."""
    outs = {n: tmp_path_factory.mktemp(f"one-host-{n}") for n in (3,)}
    procs = [_train(None, 0, "--nproc", str(n), "--out", str(out)) for n, out in outs.items()]
    _finish_all(None, procs)
    return outs


# ---- nanoddp.hosts, on real interfaces ---------------------------------------------------------

ROUTES = """
import json, sys
from nanoddp import hosts
own, peer, stray = sys.argv[1:4]
report = {}
for name, endpoint in [("own", own + ":29500"), ("peer", peer + ":29500"), ("loopback", "127.0.0.1:1")]:
    r = hosts.route_to(endpoint)
    report[name] = [r.address, r.port, r.local_address, r.interface, r.is_local]
for name, endpoint in [("stray", stray + ":29500"), ("name", "no-such-host.invalid:1"), ("form", own + ":0")]:
    try:
        hosts.route_to(endpoint)
        report[name] = None
    except ValueError as exc:
        report[name] = str(exc)
print("ROUTES " + json.dumps(report))
"""


@pytest.mark.timeout(120)
def test_hosts_reads_routes_and_ownership_from_the_interfaces(hosts):
    own, peer = hosts.addresses[1], hosts.addresses[0]
    stray = "192.0.2.1"  # TEST-NET-1: the namespaces have no route there
    done = subprocess.run(hosts.command(1, [sys.executable, "-c", ROUTES, own, peer, stray]),
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("ROUTES ", 1)[1])
    assert report["own"] == [own, 29500, own, "eth0", True]  # the store's host: its own address
    assert report["peer"] == [peer, 29500, own, "eth0", False]
    assert report["loopback"] == ["127.0.0.1", 1, "127.0.0.1", "lo", True]
    assert report["stray"].startswith(f"no route from this host to the rendezvous endpoint {stray}:29500")
    assert "does not resolve on this host" in report["name"]
    assert report["form"].startswith("--rdzv-endpoint must be HOST:PORT")


# ---- training across hosts ---------------------------------------------------------------------


def _wait_for(path: Path, procs: list[ForkedModule]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _kill_everything(None, procs)
            pytest.fail(f"the run ended or stalled before {path.name} was written")
        time.sleep(0.05)


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_three_hosts_listen_on_their_own_addresses_and_resume_a_host_killed_whole_bitwise(
    hosts, one_host_runs, tmp_path
):
    """Every listener of each host on that host's own address, the store's host decided by address
    (it is started last: it need not start first); host 2 SIGKILLed whole (its agent and worker at
    once, as a lost machine) after the snapshot of step 5 and started again with the same command:
    the job resumes from a snapshot and ends bitwise equal to the one-host run, losses too."""
    restarts = ("--max-restarts", "1")
    started = {host: _node(hosts, host, 3, tmp_path, *restarts) for host in (2, 1, 0)}
    procs = [started[host] for host in range(3)]
    _wait_for(tmp_path / "snapshots" / "step-00000005.pt", procs)  # every process is up and talking
    listening = {host: hosts.listening(host) for host in range(3)}
    hosts.kill(2)
    assert procs[2].wait(timeout=30) == -9 and not hosts.pids(2)
    procs[2].stdout.close()
    procs[2] = _node(hosts, 2, 3, tmp_path, *restarts)  # the same command, on the same host
    outputs = _finish_all(hosts, procs)
    for host, addresses in listening.items():
        assert addresses == {hosts.addresses[host]}, (host, addresses)
    assert "is_host=1" in outputs[0] and all("is_host=0" in out and "is_host=1" not in out for out in outputs[1:])
    assert re.search(r"restart 1: resumed from \S+step-000000(05|10)\.pt", "".join(outputs)), outputs
    _assert_same_run(one_host_runs[3], tmp_path)


SCRIPT = """
import json, os
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
total = torch.full((1,), float(dist.get_rank() + 1))
dist.all_reduce(total)
seen = {name: os.environ.get(name) for name in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
print("ALL-REDUCE " + json.dumps({"rank": dist.get_rank(), "sum": total.item(), **seen}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_nanoddp_run_script_across_hosts_with_the_static_backend(hosts, tmp_path):
    """`nanoddp run` goes through the same rendezvous; the static backend (node 0 serves) too."""
    script = tmp_path / "all_reduce.py"
    script.write_text(SCRIPT)
    endpoint = f"{hosts.addresses[0]}:{PORT + 1}"
    procs = [
        hosts.fork(host, [sys.executable, "-m", "nanoddp", "run", "--nproc", "1", "--nnodes", "2", "--node-rank",
                          str(host), "--rdzv-backend", "static", "--rdzv-endpoint", endpoint, str(script)])
        for host in (1, 0)
    ]  # fmt: skip
    outputs = _finish_all(hosts, procs)
    reports = [json.loads(line.split("ALL-REDUCE ", 1)[1]) for out in outputs for line in out.splitlines()
               if "ALL-REDUCE " in line]  # fmt: skip
    assert sorted(r["rank"] for r in reports) == [0, 1], outputs
    for report in reports:
        assert report["sum"] == 3.0 and report["MASTER_ADDR"] == hosts.addresses[0], report
        assert report["GLOO_SOCKET_IFNAME"] == "eth0", report


# ---- endpoints that cannot be reached ----------------------------------------------------------


@pytest.mark.timeout(240)
def test_nodes_that_cannot_meet_are_one_line_naming_the_endpoint(hosts, tmp_path):
    """Nobody serving the endpoint, a node alone (the others never join), no route: one line each,
    within --rdzv-timeout, before anything starts for the last (`nanoddp train` and `nanoddp run`)."""
    unserved = f"{hosts.addresses[0].rsplit('.', 1)[0]}.250:{PORT}"  # on the bridge's subnet, no host
    alone = f"{hosts.addresses[0]}:{PORT + 2}"  # host 0 serves it, nobody else comes
    nowhere = "192.0.2.1:29500"  # TEST-NET-1: no route from the namespaces
    node = ["--nproc", "1", "--nnodes", "2", "--rdzv-timeout", "5"]
    started = time.monotonic()
    waiting = [
        _train(hosts, 1, *node, "--node-rank", "1", "--rdzv-endpoint", unserved, "--out", str(tmp_path / "a")),
        _train(hosts, 0, *node, "--rdzv-endpoint", alone, "--out", str(tmp_path / "b")),
    ]
    refused = [
        _train(hosts, 2, *node, "--rdzv-endpoint", nowhere, "--out", str(tmp_path / "c")),
        hosts.fork(2, [sys.executable, "-m", "nanoddp", "run", *node, "--rdzv-endpoint", nowhere, "-m", "json.tool"]),
    ]  # fmt: skip
    try:
        outputs = [proc.communicate(timeout=200)[0] for proc in [*waiting, *refused]]
    finally:
        _kill_everything(None, [*waiting, *refused])
    elapsed = time.monotonic() - started
    noise = ("nanoddp: torchrun ", "[W", f"nanoddp: {tmp_path / 'b'}: ")  # the command, C++ warnings, OUT's status
    lines = [[line for line in out.splitlines() if not line.startswith(noise)] for out in outputs]
    assert [proc.returncode for proc in [*waiting, *refused]] == [1, 1, 2, 2], outputs
    assert lines[0] == [
        f"nanoddp: cannot reach the rendezvous store at {unserved} within 5 s; start node 0 (the host that "
        "owns that address) with the same --rdzv-endpoint, or check the address and port"
    ], outputs[0]
    assert lines[1] == [
        f"nanoddp: rendezvous at {alone} timed out after 5 s: not every node joined; start each node with the "
        "same --nnodes, --rdzv-endpoint and --rdzv-id"
    ], outputs[1]
    assert elapsed < 150, elapsed  # 5 s, not torchrun's 600: start-up on a busy machine is the rest
    for found in lines[2:]:
        assert len(found) == 1, found
        assert found[0].startswith(f"nanoddp: error: no route from this host to the rendezvous endpoint {nowhere}")
