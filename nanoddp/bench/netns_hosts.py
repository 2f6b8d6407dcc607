"""Hosts with their own addresses on one Linux machine: network namespaces joined by a bridge.

Multi-node means separate addresses, so a multi-node feature is tested (and benchmarked) where
every node is a network namespace with `lo` up and one address on a veth pair whose other end is
a port of one bridge, as machines on a switch. Processes run inside a host with `ip netns exec`
(`command`, `popen`), or are forked from this process's fork server and enter the host's network
as their first act (`fork`: the same program without a fresh interpreter's imports). The
filesystem, the process table and the hostname stay shared (the hostname resolving to 127.0.0.1
everywhere, as in many containers), and so does the kernel's boot id, from which nccl tells
machines apart: each host's processes get NCCL_HOSTID set to the host's name, so that nccl treats
two namespaces as two machines (its socket transport between them, as gloo's; two ranks on one
GPU are refused as duplicates only within one machine). Killing a host is SIGKILL to every
process in its namespace (`ip netns pids`), the closest thing to pulling its power cord.

The fabric is private to the process that makes it: names carry its pid and a random token, and
the subnet is a random /24 in 10.200-254.x.x (the namespaces' routes are their own, and the
bridge holds no address, so even two fabrics on one subnet could not meet). `close()` kills what
runs inside, deletes the veths, the namespaces and the bridge; a fabric left by a SIGKILLed
maker is removed by the next `NetnsHosts()` (its pid is gone). Needs root and iproute2's `ip`.

`shape(bits_per_s)` makes the fabric a slow link the kernel enforces for every process alike (our
collectives, torch's gloo, anything): a token-bucket qdisc (`tc ... tbf`, iproute2's `tc`) at the
root of the bridge's end of each veth. That end's egress is everything the bridge delivers to its
host, so each host receives at most the rate, whoever sends; with two hosts each direction crosses
exactly one bucket (a switch whose every port is that fast). No latency is added: that needs
netem, which not every kernel has (this one does not); tbf's own `latency` is the queue's bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from nanoddp.bench.training_run import forked_child
from nanoddp.fork_server import ForkedModule

logger = logging.getLogger(__name__)

NAME_PREFIX = "nanoddp-"  # namespaces: nanoddp-<pid>-<token>-<index>
BRIDGE_PREFIX = "ndb"  # bridges: ndb<token> (a link's name has 15 characters at most)
KILL_WAIT_S = 10.0
CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2) into a network namespace
HOST_ID_VAR = "NCCL_HOSTID"  # what tells nccl one machine from another (the module's note)
THIS_HOSTS_NETWORK = (
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", HOST_ID_VAR,
)  # fmt: skip


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be made here (a one-line reason), or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


def shaping_unavailable_reason() -> str | None:
    """Why `NetnsHosts.shape` cannot work here (a one-line reason), or None when it can."""
    reason = unavailable_reason()
    if reason is None and shutil.which("tc") is None:
        return "iproute2's `tc` is not installed"
    return reason


def tbf_args(device: str, bits_per_s: float) -> list[str]:
    """`tc` arguments that cap `device`'s egress at `bits_per_s` with a token bucket.

    [Note: tbf's figures] The bucket holds 10 ms of the rate (at least 32 KiB: below one timer tick
    of tokens the kernel cannot reach the rate); a burst that size is 1 % of a second's bytes, so a
    transfer of a few MB is within a percent of the rate. The queue holds 100 ms of the rate before
    it drops: enough for TCP to keep the bucket busy, little enough that a collective's small
    message is not stuck for seconds behind a bulk transfer."""
    burst_bytes = max(int(bits_per_s / 8 * 0.010), 32 * 1024)
    return ["qdisc", "add", "dev", device, "root", "tbf", "rate", f"{int(bits_per_s)}bit",
            "burst", str(burst_bytes), "latency", "100ms"]  # fmt: skip


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


class NetnsHosts:
    """`count` namespace hosts on one bridge; use as a context manager (closes on any exit).

    `addresses[i]` is host i's address; `command(i, argv)` is argv run inside host i.
    """

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"count must be >= 1 host, got {count}")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot make namespace hosts: {reason}")
        remove_stale()
        token = secrets.token_hex(3)
        self.names = [f"{NAME_PREFIX}{os.getpid()}-{token}-{i}" for i in range(count)]
        self.bridge = f"{BRIDGE_PREFIX}{token}"
        self._veths = [f"nd{token}v{i}" for i in range(count)]  # the bridge's ends (15 chars at most)
        subnet = ipaddress.ip_network(f"10.{200 + secrets.randbelow(55)}.{secrets.randbelow(256)}.0/24")
        self.addresses = [str(subnet.network_address + 1 + i) for i in range(count)]
        self.bits_per_s: float | None = None  # the cap `shape` set (None: full speed)
        try:
            self._build(subnet.prefixlen)
        except BaseException:
            self.close()
            raise

    def _build(self, prefixlen: int) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for name, veth, address in zip(self.names, self._veths, self.addresses, strict=True):
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def __enter__(self) -> NetnsHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shape(self, bits_per_s: float | None, hosts: Sequence[int] | None = None) -> None:
        """Cap what each host (of `hosts`; default every one) receives at `bits_per_s` (the
        module's note), replacing any cap set before; None removes the caps (full speed)."""
        if bits_per_s is not None and not bits_per_s > 0:
            raise ValueError(f"a link rate must be > 0 bits/s, got {bits_per_s}")
        for veth in self._veths if hosts is None else [self._veths[h] for h in hosts]:
            # no qdisc of ours yet is not an error: the deletion is only for replacing one
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True, timeout=30)
            if bits_per_s is not None:
                _tc(*tbf_args(veth, bits_per_s))
        self.bits_per_s = bits_per_s

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host` (its network; everything else is shared).

        The variables that name a machine's own network (`THIS_HOSTS_NETWORK`) are dropped: they
        belong to the machine that set them (a test process that pinned gloo to loopback, say),
        and another host would not have them."""
        unset = [arg for name in THIS_HOSTS_NETWORK for arg in ("-u", name)]
        return ["ip", "netns", "exec", self.names[host], "env", *unset, f"{HOST_ID_VAR}={self.names[host]}", *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside host `host` (subprocess.Popen's keyword arguments)."""
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def fork(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None) -> ForkedModule:
        """`popen(host, argv, env=env, stdout=PIPE, stderr=STDOUT, text=True, start_new_session=True)`
        for an argv `python -m MODULE ...`, forked from this process's fork server instead
        (`bench.training_run.forked_child`: no imports of its own, seconds of CPU each on a small
        machine); the child enters the host's network before anything else, without
        `THIS_HOSTS_NETWORK` in its environment and with the host's NCCL_HOSTID, as `command`
        runs it."""
        environ = {name: value for name, value in (os.environ if env is None else env).items()
                   if name not in THIS_HOSTS_NETWORK}  # fmt: skip
        environ[HOST_ID_VAR] = self.names[host]
        return forked_child(argv, environ, enter=functools.partial(enter_netns, self.names[host]))

    def pids(self, host: int) -> list[int]:
        """Every process whose network is host `host`'s."""
        return _netns_pids(self.names[host])

    def listening(self, host: int) -> set[str]:
        """The addresses TCP sockets listen on in host `host` (`0.0.0.0`/`::` for every interface),
        read from the kernel's table of that namespace (`/proc/PID/net/tcp*` of a process inside)."""
        found: set[str] = set()
        for pid in self.pids(host)[:1]:
            for table in ("tcp", "tcp6"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    found |= _listening_addresses(Path(f"/proc/{pid}/net/{table}").read_text())
        return found

    def kill(self, host: int) -> None:
        """SIGKILL every process of host `host`, until none is left (children forked meanwhile too)."""
        _kill_netns(self.names[host])

    def close(self) -> None:
        """Kill every process inside, delete the veths (their qdiscs with them), namespaces and
        bridge; safe to call twice."""
        for name, veth in zip(self.names, self._veths, strict=True):
            with contextlib.suppress(RuntimeError):
                _kill_netns(name)
            # deleting one end deletes the pair now (a namespace's own teardown is asynchronous)
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def enter_netns(name: str) -> None:
    """Move this process into namespace `name`'s network, as `ip netns exec` does before it runs its
    program. (Its other step, a /sys of the namespace's own, matters to nothing here: interfaces,
    addresses and routes are read through netlink and sockets, which follow the network.) A socket
    opened before stays in the network it was opened in."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # os.setns arrives with Python 3.12
        if libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"cannot enter the network of namespace {name}: {os.strerror(code)}")
    finally:
        os.close(fd)


def _listening_addresses(table: str) -> set[str]:
    """Local addresses of the LISTEN rows (state 0A) of a /proc/net/tcp or tcp6 table."""
    found = set()
    for row in table.splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        if state == "0A":
            raw = bytes.fromhex(local.split(":")[0])
            if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def _netns_pids(name: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in done.stdout.split()]


def _kill_netns(name: str) -> None:
    deadline = time.monotonic() + KILL_WAIT_S
    while pids := _netns_pids(name):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # never reaped here: a killed child's exit status stays its parent's to read
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of namespace {name} survived SIGKILL for {KILL_WAIT_S} s")


def remove_stale() -> None:
    """Remove the fabrics of makers that are gone (SIGKILLed before their `close()`): namespaces
    named by a dead pid, then bridges with no namespace of their token left (a maker killed in
    `close()` between deleting its namespaces and its bridge; a bridge's name has room for no pid)."""
    bridges = _bridge_tokens()  # listed first: a maker adds its namespaces before its bridge
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    live_tokens = set()
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name[len(NAME_PREFIX) :].split("-") if name.startswith(NAME_PREFIX) else []
        if len(parts) != 3 or not parts[0].isdigit() or psutil.pid_exists(int(parts[0])):
            live_tokens.update(parts[1:2])
            continue
        logger.info("removing namespace host %s left by a dead process", name)
        with contextlib.suppress(RuntimeError):
            _kill_netns(name)
        subprocess.run(["ip", "link", "del", f"nd{parts[1]}v{parts[2]}"], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    for token in bridges - live_tokens:
        logger.info("removing bridge %s%s left by a dead process", BRIDGE_PREFIX, token)
        subprocess.run(["ip", "link", "del", f"{BRIDGE_PREFIX}{token}"], capture_output=True, timeout=30)


def _bridge_tokens() -> set[str]:
    """The tokens of the fabric bridges on this machine (`ndb<6 hex digits>`)."""
    done = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, timeout=30)
    names = [line.split(":")[1].strip().split("@")[0] for line in done.stdout.splitlines() if line.count(":") >= 2]
    token_chars = set("0123456789abcdef")
    return {
        name[len(BRIDGE_PREFIX) :]
        for name in names
        if name.startswith(BRIDGE_PREFIX)
        and len(name) == len(BRIDGE_PREFIX) + 6
        and set(name[len(BRIDGE_PREFIX) :]) <= token_chars
    }
