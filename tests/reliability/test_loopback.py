"""A single-node `nanoddp run` job is private to this machine: a script that calls the standard
`dist.init_process_group("gloo")` must listen on loopback only. torchrun points workers at
MASTER_ADDR=<hostname>, rank 0's TCPStore server listens on every interface, and gloo's device
follows the hostname's address, so a local job would accept connections from the network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

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
    """`python -m nanoddp.run ARGS` in its own session; every descendant killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoddp.run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
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
