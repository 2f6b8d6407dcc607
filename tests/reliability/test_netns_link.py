"""The kernel-shaped link of `nanoddp bench wan --link netns`: `NetnsHosts.shape` (tc tbf).

Two namespace hosts capped at 20 Mbit/s; 5 MB go over TCP (plain python sockets, nothing of ours
on the path) from host 0 to host 1 and then back, and each receiver measures its rate from its
first byte to its last: both are within 10 % of the set rate (the reference: the rate given to
`tc`). Lifting the cap leaves no qdisc of ours; after `close()` no namespace, veth, bridge or
qdisc of the fabric is left. (The commands `bench wan` builds over it are checked in
tests/unit/test_bench_wan_link.py.)

Skipped, with the reason, where namespaces or qdiscs cannot be made (not root, no `ip` or `tc`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanoddp.bench.netns_hosts import NetnsHosts, shaping_unavailable_reason

pytestmark = pytest.mark.skipif(
    shaping_unavailable_reason() is not None, reason=f"shaped namespace hosts: {shaping_unavailable_reason()}"
)

RATE_BITS_PER_S = 20e6
NBYTES = 5_000_000  # 2 s each way at 20 Mbit/s: the bucket's 32 KiB burst is under 1 % of it
PORT = 29600  # inside the namespaces the test made: nothing else listens there

# host 1: serve, receive NBYTES, send NBYTES back; host 0: connect, send, receive. Each receiver
# prints its rate in bits/s over what arrived after its first chunk, timed from that chunk on.
PUMP = """
import socket, sys, time
role, address, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def receive(sock):
    first = sock.recv(1 << 20)
    started, got = time.monotonic(), len(first)
    while got < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise SystemExit(f"the peer closed after {got} of {nbytes} bytes")
        got += len(chunk)
    return 8 * (got - len(first)) / (time.monotonic() - started)

if role == "serve":
    server = socket.create_server((address, port))
    print("READY", flush=True)
    sock, _ = server.accept()
    print("RATE", receive(sock), flush=True)
    sock.sendall(bytes(nbytes))
    sock.recv(1)  # the client closes once it has everything
else:
    sock = socket.create_connection((address, port), timeout=60)
    sock.sendall(bytes(nbytes))
    print("RATE", receive(sock), flush=True)
sock.close()
"""


def _rate(output: str) -> float:
    return float(next(line for line in output.splitlines() if line.startswith("RATE ")).split()[1])


@pytest.mark.timeout(180)
def test_a_shaped_link_carries_the_set_rate_each_way_and_nothing_is_left_after_close():
    with NetnsHosts(2) as hosts:
        hosts.shape(RATE_BITS_PER_S)
        address = hosts.addresses[1]
        server = hosts.popen(1, [sys.executable, "-c", PUMP, "serve", address, str(PORT), str(NBYTES)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "READY"
            client = subprocess.run(
                hosts.command(0, [sys.executable, "-c", PUMP, "send", address, str(PORT), str(NBYTES)]),
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            served = server.communicate(timeout=60)[0]
        finally:
            server.kill()
            server.wait()
        assert client.returncode == 0 and server.returncode == 0, (client.stdout + client.stderr, served)
        into_host_1, into_host_0 = _rate(served), _rate(client.stdout)
        for measured in (into_host_1, into_host_0):
            assert measured == pytest.approx(RATE_BITS_PER_S, rel=0.10), (into_host_1, into_host_0)
        veths = [line.split(":")[1].strip().split("@")[0] for line in _ip("link", "show", "master", hosts.bridge)]
        assert len(veths) == 2 and all("tbf" in _tc_qdiscs(veth) for veth in veths)
        hosts.shape(None)
        assert all("tbf" not in _tc_qdiscs(veth) for veth in veths)
    namespaces = {line.split()[0] for line in _ip("netns", "list") if line.strip()}
    assert not set(hosts.names) & namespaces, "a namespace outlived close()"
    left = [line for line in _ip("link", "show") if hosts.bridge in line or any(v in line for v in veths)]
    assert left == [], f"links outlived close(): {left}"


def _ip(*args: str) -> list[str]:
    done = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.splitlines()


def _tc_qdiscs(device: str) -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", device], capture_output=True, text=True, timeout=30).stdout
