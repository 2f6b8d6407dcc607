"""A single-node job is private to this machine: every way of starting one (`nanoddp run`,
`nanoddp train`, `nanoddp.launch`, `nanoddp.notebook_launch`, the notebook's worker pool) listens
on loopback only. torchrun points workers at MASTER_ADDR=<hostname>, rank 0's TCPStore server
listens on every interface, and gloo's device follows the hostname's address, so a local job
would accept connections from the network.

The usual host maps its hostname to 127.0.0.1 and hides the gloo part; the cases that run where
the hostname resolves to the machine's network address give the job a private UTS and mount
namespace (`unshare`, as root) with its own hostname and /etc/hosts."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from nanoddp.bench.training_run import forked_child
from nanoddp.env import DistEnv, all_ranks_here, loopback_interface, pin_sockets_to_loopback
from nanoddp.run import bootstrap

SCRIPT = """
import json, os
import psutil, torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)  # gloo's pairs are connected by now
# Peers of the same job also connect (as clients) to rank 0's store: listen state is what matters.
sockets = psutil.Process().net_connections(kind="inet")
listening = sorted({c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN})
env = {name: os.environ.get(name) for name in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
print("LOOPBACK-CHECK " + json.dumps({"rank": dist.get_rank(), "sum": value.item(), "listening": listening, **env}))
dist.barrier()
dist.destroy_process_group()
"""


def _nanoddp_run(args: list[str], timeout: float) -> tuple[int, str]:
    """`python -m nanoddp.run ARGS` in its own session, forked from the tests' fork server (its
    workers are torchrun's fresh interpreters); every descendant killed at the end."""
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


@pytest.mark.timeout(240)
def test_single_node_script_listens_on_loopback_only(tmp_path):
    script = tmp_path / "listen.py"
    script.write_text(textwrap.dedent(SCRIPT))
    code, out = _nanoddp_run(["--nproc", "2", str(script)], timeout=220)
    assert code == 0, out[-3000:]
    lines = [line.split("LOOPBACK-CHECK ", 1)[1] for line in out.splitlines() if "LOOPBACK-CHECK " in line]
    reports = [json.loads(line) for line in lines]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["sum"] == 2 for r in reports), out[-3000:]
    for report in reports:
        assert report["listening"], report  # rank 0 hosts the store; gloo listens on every rank
        assert set(report["listening"]) <= {"127.0.0.1", "::1"}, report
        assert report["MASTER_ADDR"] == "127.0.0.1", report


def test_multi_node_environment_is_left_as_the_user_set_it(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert bootstrap.single_node_loopback() is False
    assert os.environ["MASTER_ADDR"] == "node0.example" and "GLOO_SOCKET_IFNAME" not in os.environ


def test_only_jobs_whose_ranks_all_run_here_are_pinned_to_loopback():
    cpu = torch.device("cpu")
    launched = DistEnv(1, 1, 2, 2, 0, cpu, "gloo")  # nanoddp.launch, the notebook's pool
    assert all_ranks_here(launched, "file:///tmp/store") and all_ranks_here(launched, "tcp://127.0.0.1:29500")
    assert not all_ranks_here(launched, "tcp://node0.example:29500")
    torchrun_here = DistEnv(1, 1, 2, 2, 0, cpu, "gloo", master_addr=HOSTNAME, master_port=1, torchrun=True)
    assert all_ranks_here(torchrun_here)  # torchrun counted this node's ranks itself
    two_nodes = DistEnv(3, 1, 4, 2, 1, cpu, "gloo", master_addr="node0.example", master_port=1, torchrun=True)
    assert not all_ranks_here(two_nodes)
    # RANK/WORLD_SIZE/MASTER_ADDR without LOCAL_WORLD_SIZE: the endpoint says where the job is
    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0.example", "MASTER_PORT": "1"}
    assert not all_ranks_here(DistEnv.from_environ(environ, backend="gloo"))
    assert all_ranks_here(DistEnv.from_environ({**environ, "MASTER_ADDR": "::1"}, backend="gloo"))
    chosen = {"GLOO_SOCKET_IFNAME": "eth7"}
    pin_sockets_to_loopback(chosen)  # the user's choice for gloo stands; nccl's listeners pinned too
    assert chosen == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": loopback_interface()}


# ---- where the hostname resolves to the machine's network address ------------------------------
HOSTNAME = "nanoddp-probe-host"
LOOPBACK = {"127.0.0.1", "::1"}
READY_TIMEOUT_S = 50  # two ranks importing torch on a loaded 2-core machine, then one collective
HOLD_S = 120  # how long a ready rank waits to be looked at; the test kills it long before
TINY_TRAIN = [
    "--nproc", "2", "--text-max-bytes", "1900", "--seq-len", "16", "--d-model", "32", "--n-layers", "2",
    "--n-heads", "2", "--d-ff", "64", "--batch-size", "8", "--steps", "100000", "--warmup-steps", "1",
    "--log-every", "1", "--snapshot-every", "0", "--eval-every", "0", "--no-progress",
]  # fmt: skip

# After its first collective each rank writes READY_DIR/rank<r>, then waits to be killed.
HOLD = f"""
import os, time
def hold(rank, ready_dir):
    open(os.path.join(ready_dir, f"rank{{rank}}"), "w").close()
    time.sleep({HOLD_S})
"""

RUN_SCRIPT = f"""{HOLD}
import sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
hold(dist.get_rank(), sys.argv[1])
"""

# LAUNCHER: `launch`, or `notebook_launch` (rank_main then travels by value).
LAUNCH_SCRIPT = f"""{HOLD}
import sys
import torch
import nanoddp

def rank_main(env, ready_dir):
    torch.set_num_threads(1)
    torch.distributed.all_reduce(torch.ones(1))
    hold(env.rank, ready_dir)

if __name__ == "__main__":
    nanoddp.LAUNCHER(rank_main, 2, args=(sys.argv[1],), backend="gloo", timeout=300)
"""

# What `%dist_init 2` starts: the pool returns once both workers have joined the group. (Under the
# main guard: its workers come from a fork server, and multiprocessing's children import the
# main module, as with `launch`; a kernel's main module is ipykernel's launcher, guarded too.)
POOL_SCRIPT = f"""
import os, sys, time
from nanoddp.notebook.pool import WorkerPool
if __name__ == "__main__":
    pool = WorkerPool(2, "gloo", ["cpu", "cpu"], num_threads=1, pg_timeout_s=60)
    pool.start(timeout_s=120)
    for rank in range(2):
        open(os.path.join(sys.argv[1], f"rank{{rank}}"), "w").close()
    time.sleep({HOLD_S})
"""


def _network_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback (eth0's, say), or None."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


@pytest.fixture
def hostname_on_network(tmp_path) -> list[str]:
    """An argv prefix that runs a command where this host's name resolves to its network address:
    a private UTS namespace with its own hostname, and a private mount namespace in which a hosts
    file mapping that name to the address is bind-mounted over /etc/hosts."""
    address = _network_ipv4()
    if address is None:
        pytest.skip("no non-loopback IPv4 address here: there is no network address to resolve the hostname to")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give the job its own hostname and /etc/hosts")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{address} {HOSTNAME}\n")
    setup = f'hostname {HOSTNAME} && mount --bind {hosts} /etc/hosts && exec "$@"'
    prefix = ["unshare", "--uts", "--mount", "sh", "-c", setup, "sh"]
    resolve = "import socket; print(socket.gethostbyname(socket.getfqdn()))"
    check = subprocess.run([*prefix, sys.executable, "-c", resolve], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        pytest.skip(f"unshare --uts --mount does not work here: {check.stderr.strip()[-300:]}")
    assert check.stdout.strip() == address, check.stdout  # else the case below proves nothing
    return prefix


def _listening(proc: psutil.Process) -> list[str]:
    """'ip:port' of every listening TCP socket of `proc` (none once it is gone)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return [f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    return []


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s session and every descendant (torchrun's workers have sessions of their own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _sockets_of_running_job(argv: list[str], ready: Callable[[], bool], log: Path) -> dict[str, list[str]]:
    """Start `argv`; once `ready()`, the listening sockets of every process of the job, by
    'pid command'. The whole tree is killed before this returns."""
    with log.open("w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job did not get its ranks through a collective:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        found = {}
        for member in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                found[f"{member.pid} {' '.join(member.cmdline())[:120]}"] = _listening(member)
        return found
    finally:
        _kill_tree(proc)


def _ranks_ready(ready_dir: Path) -> Callable[[], bool]:
    return lambda: all((ready_dir / f"rank{rank}").exists() for rank in (0, 1))


def _stepped(log: Path) -> Callable[[], bool]:
    """Rank 0 of `nanoddp train` has logged a step (its gradients went through a collective)."""
    return lambda: log.is_file() and re.search(r" INFO \S+: step \d+", log.read_text()) is not None


def _job(kind: str, tmp_path: Path) -> tuple[list[str], Callable[[], bool]]:
    """The command of one way of starting a 2-rank job, and when its ranks are up."""
    ready_dir = tmp_path / "ready"
    ready_dir.mkdir()
    if kind == "train":
        out = tmp_path / "run"
        argv = [sys.executable, "-m", "nanoddp", "train", *TINY_TRAIN, "--out", str(out)]
        return argv, _stepped(out / "logs" / "rank0.log")
    script = tmp_path / "job.py"
    text = {"run": RUN_SCRIPT, "pool": POOL_SCRIPT}.get(kind) or LAUNCH_SCRIPT.replace("LAUNCHER", kind)
    script.write_text(textwrap.dedent(text))
    prefix = [sys.executable, "-m", "nanoddp", "run", "--nproc", "2"] if kind == "run" else [sys.executable]
    return [*prefix, str(script), str(ready_dir)], _ranks_ready(ready_dir)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["train", "run", "launch", "notebook_launch", "pool"])
def test_every_single_node_job_listens_on_loopback_whatever_the_hostname_resolves_to(
    hostname_on_network, tmp_path, kind
):
    argv, ready = _job(kind, tmp_path)
    sockets = _sockets_of_running_job([*hostname_on_network, *argv], ready, tmp_path / "job.log")
    addresses = [address for found in sockets.values() for address in found]
    public = [address for address in addresses if address.rsplit(":", 1)[0] not in LOOPBACK]
    assert addresses and not public, json.dumps(sockets, indent=1)
