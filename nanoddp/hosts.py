"""Which interface reaches the rendezvous endpoint, and whether this host is the store's host.

A multi-node job meets at one address (`--rdzv-endpoint HOST:PORT`). Two facts follow from it on
every node, and torch guesses both from the hostname: whether this node hosts the rendezvous
store (torchrun's c10d backend asks whether HOST names this machine), and which address gloo
listens on (the one the hostname resolves to). In containers and namespaces the hostname often
resolves to 127.0.0.1 or to nothing, so no node hosts the store and peers dial loopback.

Here both come from the kernel instead: the address this host would send from to reach the
endpoint (a connected UDP socket: the routing table picks the source, no packet leaves), the
interface that holds that address, and whether the endpoint's address is one of this host's own.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

import psutil

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port when the endpoint names none


@dataclass(frozen=True)
class EndpointRoute:
    """How this host reaches a rendezvous endpoint."""

    endpoint: str
    """HOST:PORT as given."""
    address: str
    """The endpoint host's IP address (HOST itself when it is one)."""
    port: int
    local_address: str
    """This host's address on the way to the endpoint: where its listeners should bind."""
    interface: str
    """The interface that holds `local_address` (gloo's GLOO_SOCKET_IFNAME)."""
    is_local: bool
    """The endpoint's address is this host's own: this host serves the rendezvous store."""


def is_address(host: str) -> bool:
    """Whether `host` is an IP address rather than a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def split_endpoint(endpoint: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """(host, port) of HOST[:PORT] or [IPV6][:PORT]; one-line ValueError naming `flag` for anything else."""
    text = endpoint.strip()
    host, port = text, str(DEFAULT_RDZV_PORT)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (rest or port)
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT with a port in 1..65535, got {endpoint!r}")
    return host, int(port)


def url_host(address: str) -> str:
    """`address` as the host part of HOST:PORT (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address else address


def resolve(host: str, flag: str = "--rdzv-endpoint") -> str:
    """HOST's IP address (IPv4 first); one-line ValueError (naming `flag`) when it does not resolve here."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(
            f"{_what(flag)} host {host!r} does not resolve on this host ({exc.strerror}); "
            f"give {flag} as an IP address, or a name every node resolves"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` on this host, or None."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(entry.address.split("%", 1)[0]) == wanted:
                        return name
                except ValueError:
                    continue
    return None


def source_address(address: str, port: int) -> str:
    """The address this host sends from to reach `address` (the kernel's route choice)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))  # UDP: picks the route and source address, sends nothing
        return str(probe.getsockname()[0])


def route_to(endpoint: str, flag: str = "--rdzv-endpoint") -> EndpointRoute:
    """How this host reaches `endpoint` (given as `flag`); one-line ValueError when it cannot (bad
    form, no name, no route)."""
    host, port = split_endpoint(endpoint, flag)
    address = resolve(host, flag)
    try:
        local = source_address(address, port)
    except OSError as exc:
        raise ValueError(
            f"no route from this host to the {_what(flag)} endpoint {endpoint} ({address}: {exc.strerror}); "
            "check this host's network, or give the address node 0 is reachable at"
        ) from None
    interface = interface_of(local)
    if interface is None:  # the kernel chose it, so an interface holds it; say so if not
        raise ValueError(f"no interface of this host holds {local}, its address towards {endpoint}")
    is_local = ipaddress.ip_address(address).is_loopback or interface_of(address) is not None
    return EndpointRoute(endpoint, address, port, local, interface, is_local)


def _what(flag: str) -> str:
    """What an endpoint flag names, for its lines: `--rdzv-endpoint` the rendezvous, another
    (`--lighthouse`) the quorum service."""
    return "rendezvous" if flag == "--rdzv-endpoint" else f"quorum service ({flag})"


def wait_reachable(address: str, port: int, timeout_s: float) -> bool:
    """Whether `address`:`port` accepts a TCP connection within `timeout_s` (tried every half second:
    the node that serves it may start later than this one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(0.1, min(left, 3.0))):
                return True
        except OSError:
            if deadline - time.monotonic() <= 0.5:
                return False
            time.sleep(0.5)
