"""Where a fault-tolerant launcher's replicas sit and listen (`nanoddp.ft.placement`), and the
quorum service it starts or finds (`nanoddp.ft.quorum_service`), without a network of its own:
every launch flag's refusal is one line before anything starts; replica ids, the bind address
and who serves the quorum service follow from the flags; a Lighthouse on loopback says whether a
run is under way (a real one, torchft's, the assumption pinned); `ReplicaEnv` carries the address,
the minimum and the join through the environment. Across real hosts: tests/multiproc/test_ft_hosts.py.
"""

from __future__ import annotations

import argparse
import datetime
import http.server
import socket
import threading
import time

import pytest

from nanoddp import hosts
from nanoddp.ft.placement import Placement, majority, placement_for, refuse_continue_flags
from nanoddp.ft.replica_env import ReplicaEnv


def _args(**given) -> argparse.Namespace:
    flags = {"nnodes": "1", "node_rank": 0, "rdzv_endpoint": "", "lighthouse": "", "min_replicas": None,
             "max_replicas": None}  # fmt: skip
    return argparse.Namespace(**{**flags, **given})


@pytest.mark.parametrize(
    ("given", "nproc", "group_size", "line"),
    [
        ({"nnodes": "3:2"}, 2, None, r"--on-failure continue takes --nnodes N \(hosts at start\) or N:MAX"),
        ({"nnodes": "0"}, 2, None, "--on-failure continue takes --nnodes N"),
        ({"nnodes": "2", "max_replicas": 3, "rdzv_endpoint": "127.0.0.1:1"}, 2, None,
         r"^--max-replicas must be at least the replicas the run starts with \(--nnodes 2 x --nproc 2 = 4\), got 3"),
        ({"nnodes": "2:3", "max_replicas": 4, "rdzv_endpoint": "127.0.0.1:1"}, 1, None,
         r"^--max-replicas 4 and --nnodes 2:3 \(up to 3 replicas at --nproc 1\) disagree"),
        ({"nnodes": "2", "node_rank": 2, "max_replicas": 5, "rdzv_endpoint": "127.0.0.1:1"}, 2, None,
         r"^--node-rank must be in 0\.\.1 \(.* below --max-replicas 5\), got 2 \(ids 4\.\.5\)"),
        ({"nnodes": "2:3", "node_rank": 3, "rdzv_endpoint": "127.0.0.1:1"}, 1, None,
         r"^--node-rank must be in 0\.\.2 \(.* below --max-replicas 3\), got 3 \(ids 3\.\.3\)"),
        ({"max_replicas": 3}, 2, None, r"across hosts \(--nnodes 1, --max-replicas 3\) needs --rdzv-endpoint"),
        ({"nnodes": "2", "node_rank": 2, "rdzv_endpoint": "127.0.0.1:1"}, 2, None, "--node-rank must be in 0..1"),
        ({"nnodes": "2", "min_replicas": 5, "rdzv_endpoint": "127.0.0.1:1"}, 2, None,
         r"--min-replicas must be in 1\.\.4 \(the run's replicas: --nnodes 2 x --nproc 2\), got 5"),
        ({"min_replicas": 0}, 3, None, r"--min-replicas must be in 1\.\.3"),
        ({"nnodes": "2"}, 1, None, "needs --rdzv-endpoint HOST:PORT .* or --lighthouse HOST:PORT"),
        ({}, 3, 2, r"^--group-size 2 \(processes per replica group\) must divide --nproc 3 \(the processes of each"),
        ({"nnodes": "2", "rdzv_endpoint": "node0:"}, 1, None, "^--rdzv-endpoint must be HOST:PORT"),
        ({"nnodes": "2", "lighthouse": "lh:http"}, 1, None, "^--lighthouse must be HOST:PORT"),
        ({"nnodes": "2", "lighthouse": "no-such-host.invalid:1"}, 1, None,
         "^quorum service \\(--lighthouse\\) host 'no-such-host.invalid' does not resolve"),
    ],
)  # fmt: skip
def test_a_launch_that_does_not_fit_is_one_line(given, nproc, group_size, line):
    with pytest.raises(ValueError, match=line) as refused:
        placement_for(_args(**given), nproc, group_size)
    assert "\n" not in str(refused.value)


def test_one_node_is_todays_run_on_loopback():
    where = placement_for(_args(), 3)
    assert where == Placement.one_node(3) == Placement(3, majority(3))
    assert (where.first, where.replicas, where.min_replicas, where.address) == (0, 3, 2, "127.0.0.1")
    assert where.serves_lighthouse and where.lighthouse is None and not where.across_hosts


def test_across_hosts_each_node_plays_its_replicas_and_node_0_serves_the_endpoint():
    endpoint = "127.0.0.1:29511"  # this machine's own: every node here, as on one machine with N launchers
    nodes = [placement_for(_args(nnodes="3", node_rank=k, rdzv_endpoint=endpoint, min_replicas=1), 2)
             for k in range(3)]  # fmt: skip
    assert [(n.first, n.replicas, n.min_replicas) for n in nodes] == [(0, 6, 1), (2, 6, 1), (4, 6, 1)]
    assert [n.serves_lighthouse for n in nodes] == [True, False, False]
    route = hosts.route_to(endpoint)
    for node in nodes:
        assert node.lighthouse == ("127.0.0.1", 29511) and node.across_hosts
        assert (node.address, node.interface) == (route.local_address, route.interface)
    assert placement_for(_args(nnodes="2", rdzv_endpoint=endpoint), 2).min_replicas == 3  # a majority of 4
    given = placement_for(_args(nnodes="2", rdzv_endpoint=endpoint, lighthouse="127.0.0.1:29512"), 1)
    assert not given.serves_lighthouse and given.lighthouse == ("127.0.0.1", 29512)  # no launcher starts one


def test_a_run_that_grows_places_its_growers_past_the_starting_count():
    """`--max-replicas M` and torchrun's `--nnodes N:MAX` are one thing: hosts N.. are growers whose
    ids stay below M; the minimum stays a majority of the starting replicas."""
    endpoint = "127.0.0.1:29511"
    spelled = [
        [placement_for(_args(nnodes="2", node_rank=k, rdzv_endpoint=endpoint, max_replicas=3), 1) for k in range(3)],
        [placement_for(_args(nnodes="2:3", node_rank=k, rdzv_endpoint=endpoint), 1) for k in range(3)],
    ]
    assert spelled[0] == spelled[1]
    nodes = spelled[0]
    assert [(n.first, n.replicas, n.most_replicas, n.min_replicas, n.grows) for n in nodes] == [
        (0, 2, 3, 2, False), (1, 2, 3, 2, False), (2, 2, 3, 2, True)]  # fmt: skip
    assert placement_for(_args(nnodes="2", rdzv_endpoint=endpoint, max_replicas=2), 1).max_replicas == 0  # no growth
    assert placement_for(_args(nnodes="2:5", rdzv_endpoint=endpoint), 1).min_replicas == 2  # of 2, not of 5
    env = ReplicaEnv("http://h:1", replica=2, replicas=2, max_replicas=3)
    assert ReplicaEnv.from_environ(env.to_environ()) == env and env.most_replicas == 3
    with pytest.raises(ValueError, match=r"replica id must be in \[0, 3\), got 3"):
        ReplicaEnv("http://h:1", replica=3, replicas=2, max_replicas=3)


def test_node_0_must_own_the_endpoint_it_serves(monkeypatch):
    """The quorum service binds the endpoint's address: node 0 elsewhere is refused in one line."""
    elsewhere = hosts.EndpointRoute("192.0.2.7:29500", "192.0.2.7", 29500, "192.0.2.1", "eth9", is_local=False)
    monkeypatch.setattr(hosts, "route_to", lambda endpoint, flag="--rdzv-endpoint": elsewhere)
    with pytest.raises(ValueError, match=r"^--rdzv-endpoint 192\.0\.2\.7:29500: 192\.0\.2\.7 is not an address of"):
        placement_for(_args(nnodes="2", rdzv_endpoint="192.0.2.7:29500"), 1)
    assert not placement_for(_args(nnodes="2", node_rank=1, rdzv_endpoint="192.0.2.7:29500"), 1).serves_lighthouse


def test_restart_refuses_the_quorum_flags():
    refuse_continue_flags(_args())
    with pytest.raises(ValueError, match=r"^--lighthouse, --min-replicas applies to --on-failure continue"):
        refuse_continue_flags(_args(lighthouse="h:1", min_replicas=0))
    with pytest.raises(ValueError, match=r"^--max-replicas applies to --on-failure continue"):
        refuse_continue_flags(_args(max_replicas=3))


def test_the_cli_refuses_before_anything_starts(tmp_path):
    """`nanoddp train` and `nanoddp run` reach the same checks from their flags."""
    from nanoddp.run.command import check_args
    from nanoddp.train.launcher.cli import check_train_argv

    tiny = ["--text-max-bytes", "1900", "--seq-len", "16", "--batch-size", "12", "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="--node-rank must be in 0..1 for --nnodes 2, got 3"):
        check_train_argv([*tiny, "--on-failure", "continue", "--nnodes", "2", "--node-rank", "3",
                          "--rdzv-endpoint", "127.0.0.1:29513"])  # fmt: skip
    with pytest.raises(ValueError, match="^--min-replicas applies to --on-failure continue"):
        check_train_argv([*tiny, "--min-replicas", "1"])
    with pytest.raises(ValueError, match="^--max-replicas applies to --on-failure continue"):
        check_train_argv([*tiny, "--max-replicas", "3"])
    growing = [*tiny, "--on-failure", "continue", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29513"]
    split = r"^batch_size=12 \(global\) cannot be split over 13 processes \(replicas x --group-size\) x grad_accum 1"
    with pytest.raises(ValueError, match=split):
        check_train_argv([*growing, "--nproc", "1", "--max-replicas", "13"])
    with pytest.raises(ValueError, match=r"--node-rank must be in 0\.\.2 .*got 3"):
        check_train_argv([*growing, "--nproc", "1", "--nnodes", "2:3", "--node-rank", "3"])
    from nanoddp.run.command import add_run_args

    parser = argparse.ArgumentParser()
    add_run_args(parser)
    with pytest.raises(ValueError, match="^--lighthouse applies to --on-failure continue"):
        check_args(parser.parse_args(["--nproc", "1", "--lighthouse", "127.0.0.1:1", "-m", "json.tool"]))


def test_replica_env_carries_address_minimum_and_join():
    env = ReplicaEnv("http://10.0.0.1:29500", replica=3, replicas=4, address="10.0.0.2", min_replicas=1, join=True)
    back = ReplicaEnv.from_environ(env.to_environ())
    assert back == env and back.joiner and back.attempt == 0  # a host started again: a joiner from its first process
    fresh = ReplicaEnv.from_environ(ReplicaEnv("http://h:1", replica=0, replicas=2).to_environ())
    assert (fresh.address, fresh.min_replicas, fresh.join, fresh.joiner) == ("127.0.0.1", 1, False, False)
    with pytest.raises(ValueError, match=r"min_replicas must be in \[1, 2\], got 3"):
        ReplicaEnv("http://h:1", replica=0, replicas=2, min_replicas=3)


# ---- the quorum service ---------------------------------------------------------------------------


def test_a_lighthouse_says_whether_a_run_is_under_way():
    """torchft's own Lighthouse on loopback, read as a host started again reads it
    (`quorum_service.run_under_way`), for a run of 2 replicas: no quorum yet, or a group of the
    first replica alone at step 0 (it waits for the other at start-up, `--min-replicas 1`), is a
    run starting; a member that committed a step, or a group of both, is a run under way."""
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseClient

    from nanoddp.ft.quorum_service import open_quorum_service, run_under_way

    service = open_quorum_service(Placement.one_node(1), wait_s=1)
    try:
        assert service.url.startswith("http://127.0.0.1:") and not service.under_way
        assert not run_under_way(service.url, 2)
        client = LighthouseClient(service.url, datetime.timedelta(seconds=10))

        def alone_at(step: int) -> None:
            client.quorum("replica_0:x", datetime.timedelta(seconds=10), address="a", store_address="s", step=step,
                          world_size=1)  # fmt: skip

        alone_at(0)
        assert not run_under_way(service.url, 2)  # starting: the other replica is not there yet
        assert run_under_way(service.url, 1)  # the whole run of one replica formed its group
        alone_at(3)
        assert run_under_way(service.url, 2)  # a step committed: the other is a host started again
    finally:
        service.shutdown()


def test_a_quorum_service_that_is_not_there_or_not_a_lighthouse_is_one_line():
    from nanoddp.ft.quorum_service import QuorumServiceUnavailable, open_quorum_service, run_under_way

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again: nothing listens there
    where = placement_for(_args(nnodes="2", node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}"), 1)
    with pytest.raises(QuorumServiceUnavailable, match=f"^cannot reach the quorum service at 127.0.0.1:{port} within"):
        open_quorum_service(where, wait_s=1)

    class NotALighthouse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotALighthouse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(QuorumServiceUnavailable, match="has no 'Current quorum_id: N': is it torchft's Lighthouse"):
            run_under_way(f"http://127.0.0.1:{server.server_address[1]}", 2)
    finally:
        server.shutdown()
        server.server_close()


def test_a_grower_that_finds_no_run_under_way_is_one_line_and_exit_1(monkeypatch, capsys):
    """A grower comes to a run under way or not at all: a quorum service with no group yet (a real
    Lighthouse on loopback), or none answering (the run is over), is one line and exit 1, and no
    replica starts (the command would fail the test: it is not a program)."""
    pytest.importorskip("torchft")
    from nanoddp.ft import supervisor
    from nanoddp.ft.quorum_service import open_quorum_service

    service = open_quorum_service(Placement.one_node(1), wait_s=1)
    port = int(service.url.rsplit(":", 1)[1])
    grower = placement_for(_args(node_rank=1, max_replicas=2, rdzv_endpoint=f"127.0.0.1:{port}"), 1)
    assert grower.grows and grower.first == 1 and not grower.serves_lighthouse
    launch = supervisor.Launch(["/no/such/replica"], 1, 0, 5.0, placement=grower)
    try:
        assert supervisor.supervise(launch) == 1
    finally:
        service.shutdown()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"nanoddp run: --node-rank 1 grows a run under way (replicas 1..1, past the 1 it starts with) but found "
        f"none: the run at {service.url} has not formed its first group; start a growing host while the run "
        "trains (after its first step, before its last), with the run's --rdzv-endpoint or --lighthouse"
    ]
    # torchft's shutdown returns before its listener closes (under load, a while later): wait for that
    closed_by = time.monotonic() + 30
    while hosts.wait_reachable("127.0.0.1", port, 0.1) and time.monotonic() < closed_by:
        time.sleep(0.05)
    monkeypatch.setattr(supervisor, "GROWER_WAIT_S", 0.2)  # nothing listens there now
    assert supervisor.supervise(launch) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert f"found none: its quorum service at 127.0.0.1:{port} does not answer within 0.2 s;" in line, line
