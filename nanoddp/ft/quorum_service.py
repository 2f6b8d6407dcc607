"""The quorum service of a fault-tolerant run (torchft's Lighthouse): started here, bound to the
one address the run was given, or found running elsewhere; and whether a run is under way there.

Every replica's Manager asks the Lighthouse, at each step, which replicas form the group. On one
node the launcher runs it on loopback; across hosts node 0's launcher runs it on the rendezvous
endpoint (`Placement.lighthouse`), or `--lighthouse` names one already running, which the
launcher waits for as a rendezvous client waits for its store.

[Note: a host started again joins] A launcher that finds the run under way at the service
(`run_under_way`) belongs to a host that was lost and is started again with the same command:
its replicas are joiners from their first process on (`ReplicaEnv.join`), so they take their
state from a peer at a step boundary, never resume from a snapshot of their own, and do not wait
for the run's first full group. Under way means that the run's first full group has formed
(a quorum of every replica it starts with) or that a member of the last quorum has committed a
step. A quorum alone is not enough: with `--min-replicas` below the starting count, the first
host's replicas form groups of their own while they wait for the others at start-up, and a host
started a moment later would take itself for a host started again (a joiner, holding nothing,
in a group with nobody who holds the state: the run would stop). torchft's Lighthouse answers
no such question through its client (asking for a quorum would make the asker a member), so it
is read from the page the Lighthouse serves on the same port, `/status`: "Current quorum_id: N"
(0 until a first quorum), then the last quorum's "Num participants: K" and each member's
"Step: S".
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from nanoddp import hosts
from nanoddp.ft.placement import Placement
from nanoddp.ft.replica_env import LOOPBACK
from nanoddp.ft.stopped import first_line

# The quorum service's clocks. A lost replica is left out once the others have waited JOIN_MS for it
# (or its heartbeats, sent every 100 ms, stopped HEARTBEAT_MS ago); a new quorum is looked for every TICK_MS.
# Why 1 s of heartbeats: a quorum needs a majority of the replicas still heartbeating, so when one
# of two is lost (a host of two), the survivor waits until the lost one's heartbeats are that old
# (2 s gave the survivor a 2.2 s stall, `bench restarts --hosts 2`); ten missed beats in a row is
# still far from what a busy replica's heartbeat thread misses.
JOIN_MS, HEARTBEAT_MS, TICK_MS = 500, 1000, 10
STATUS_TIMEOUT_S = 10.0  # one read of the Lighthouse's status page
QUORUM_ID = re.compile(r"Current quorum_id: (\d+)")
PARTICIPANTS = re.compile(r"Num participants: (\d+)")  # the last quorum's
STEP = re.compile(r"Step: (\d+)")  # each member's of the last quorum: steps it committed


class QuorumServiceUnavailable(RuntimeError):
    """The quorum service could not be started or reached; its text is the line shown."""


@dataclass
class QuorumService:
    """The run's quorum service as this launcher sees it."""

    url: str
    """`http://host:port`: what the replicas' Managers dial."""
    server: Any = None
    """The LighthouseServer this launcher runs (None: another launcher's, or `--lighthouse`'s)."""
    under_way: bool = False
    """A quorum had formed before this launcher came (see the module's note)."""

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()


def open_quorum_service(where: Placement, wait_s: float) -> QuorumService:
    """Start the quorum service if this launcher serves it (`Placement.serves_lighthouse`), else
    wait up to `wait_s` for it to accept connections and ask whether a run is under way there.
    Raises QuorumServiceUnavailable with one line when neither works."""
    if where.serves_lighthouse:
        return _start(where)
    assert where.lighthouse is not None  # placement_for: across hosts, another launcher's service
    address, port = where.lighthouse
    endpoint = f"{hosts.url_host(address)}:{port}"
    if not hosts.wait_reachable(address, port, wait_s):
        raise QuorumServiceUnavailable(
            f"cannot reach the quorum service at {endpoint} within {wait_s:g} s; start node 0 (the host that owns "
            "that address) with the same --rdzv-endpoint, or check --lighthouse, the address and the port"
        )
    url = f"http://{endpoint}"
    return QuorumService(url, None, run_under_way(url, where.replicas))


def _start(where: Placement) -> QuorumService:
    from torchft.coordination import LighthouseServer

    address, port = where.lighthouse or (LOOPBACK, 0)  # one node: private to this machine, any free port
    bind = f"{hosts.url_host(address)}:{port}"
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=where.min_replicas,
            join_timeout_ms=JOIN_MS,
            quorum_tick_ms=TICK_MS,
            heartbeat_timeout_ms=HEARTBEAT_MS,
        )
    except Exception as exc:  # torchft raises its Rust error as a plain exception
        raise QuorumServiceUnavailable(
            f"cannot start the quorum service on {bind} ({first_line(exc)}); is another run using that port? "
            "choose another --rdzv-endpoint port"
        ) from None
    bound_port = server.address().rsplit(":", 1)[1]  # it names the host by its hostname: use the address
    return QuorumService(f"http://{hosts.url_host(address)}:{bound_port}", server)


def run_under_way(url: str, replicas: int) -> bool:
    """Whether the run whose quorum service is at `url`, starting with `replicas` replicas, is
    under way: its first full group formed, or a step committed (the module's note)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
    try:
        with direct.open(f"{url}/status", timeout=STATUS_TIMEOUT_S) as answer:
            page = answer.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise QuorumServiceUnavailable(f"the quorum service at {url} did not answer its status page ({exc})") from None
    found = QUORUM_ID.search(page)
    if found is None:
        raise QuorumServiceUnavailable(
            f"{url}/status has no 'Current quorum_id: N': is it torchft's Lighthouse (torchft==0.2.0)?"
        )
    if int(found.group(1)) == 0:
        return False
    _, _, last = page.partition("Previous quorum id:")
    members = PARTICIPANTS.search(last)
    steps = [int(step) for step in STEP.findall(last)]
    return (members is not None and int(members.group(1)) >= replicas) or any(step > 0 for step in steps)
