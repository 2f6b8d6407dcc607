"""`nanoddp.hosts` without a network of its own: endpoint forms, and this machine's loopback
(the namespace cases, with real peers, are in tests/multiproc/test_multinode_hosts.py)."""

from __future__ import annotations

import pytest

from nanoddp import hosts


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("10.1.2.3:29500", ("10.1.2.3", 29500)),
        ("node0.example", ("node0.example", hosts.DEFAULT_RDZV_PORT)),
        ("[fd00::1]:29500", ("fd00::1", 29500)),
        ("[fd00::1]", ("fd00::1", hosts.DEFAULT_RDZV_PORT)),
    ],
)
def test_endpoint_forms(endpoint, expected):
    assert hosts.split_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["node0:", ":29500", "node0:http", "node0:70000", "[fd00::1]:x"])
def test_malformed_endpoint_is_one_line_naming_it(endpoint):
    with pytest.raises(
        ValueError, match=r"^--rdzv-endpoint must be HOST:PORT .*got " + repr(endpoint).replace("[", r"\[")
    ):
        hosts.split_endpoint(endpoint)


def test_loopback_endpoint_is_served_here_through_the_loopback_interface():
    route = hosts.route_to("127.0.0.1:29500")
    assert (route.address, route.local_address, route.is_local) == ("127.0.0.1", "127.0.0.1", True)
    assert route.interface == hosts.interface_of("127.0.0.1")
    assert hosts.is_address("127.0.0.1") and hosts.is_address("[::1]") and not hosts.is_address("node0")
