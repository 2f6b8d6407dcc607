"""Where one launcher's replicas sit in a fault-tolerant run, and where everything listens.

On one node (today's `--on-failure continue`) every replica is here, ids 0 .. P-1, and the quorum
service and every server bind loopback: the run accepts no connection from the network.

Across hosts (`--nnodes N --node-rank K --nproc P --rdzv-endpoint HOST:PORT`, one-rank replicas)
host K's launcher plays replicas K*P .. K*P+P-1 of the run's N*P. Node 0's launcher runs the
quorum service (torchft's Lighthouse) bound to the endpoint's address, unless `--lighthouse
HOST:PORT` names one already running: then no launcher starts one. Each replica's servers (its
Manager's, its group store, gloo's) bind this host's own address on the way to the quorum
service, and gloo listens on the interface that holds it; both come from the kernel's route
(`nanoddp.hosts.route_to`), not from the hostname, which in containers often resolves to
127.0.0.1. Nothing binds every interface.

Every launch flag of a fault-tolerant run is checked here, before any process starts: one line
each, naming the flag, the rule and what to do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from nanoddp import hosts
from nanoddp.ft.replica_env import LOOPBACK


def majority(replicas: int) -> int:
    """The fewest replicas that may form a quorum by default: more than half of the run's.

    [Note: no two groups] The Lighthouse forms a quorum of the replicas that asked, once the
    healthy ones that did not ask have had the join timeout to do so. A survivor slow to ask (a
    loaded machine) could otherwise be left out and form a group of its own at its next request:
    two groups training apart from the same step. Two majorities always share a replica, so at
    most one group goes on; a group that is not a majority waits for its replacements.
    `--min-replicas` below a majority (`1`: the last host of two goes on alone) gives that up,
    on the user's word."""
    return replicas // 2 + 1


@dataclass(frozen=True)
class Placement:
    """This launcher's replicas and addresses (see the module docstring). Immutable."""

    nproc: int
    """Replicas this launcher plays (one process each)."""
    min_replicas: int
    """The fewest replicas a quorum (and so a step) may have."""
    nnodes: int = 1
    node_rank: int = 0
    address: str = LOOPBACK
    """Where this host's replicas bind their servers, and what they tell the others."""
    interface: str | None = None
    """The interface that holds `address` (gloo's GLOO_SOCKET_IFNAME); None on one node, where
    the replicas pin gloo to loopback themselves."""
    lighthouse: tuple[str, int] | None = None
    """(address, port) of the quorum service; None on one node: loopback, a port of the OS's choice."""
    serves_lighthouse: bool = True
    """This launcher starts the quorum service (node 0 without `--lighthouse`, or one node)."""

    @classmethod
    def one_node(cls, nproc: int) -> Placement:
        """Every replica here, everything on loopback (`--nnodes 1`, no endpoint)."""
        return cls(nproc, majority(nproc))

    @property
    def first(self) -> int:
        """The id of this launcher's first replica."""
        return self.node_rank * self.nproc

    @property
    def replicas(self) -> int:
        """The run's replicas, on every host together."""
        return self.nnodes * self.nproc

    @property
    def across_hosts(self) -> bool:
        return self.interface is not None


def placement_for(args: argparse.Namespace, nproc: int, group_size: int | None = None) -> Placement:
    """This launcher's `Placement` from the launch flags (`--nnodes`, `--node-rank`,
    `--rdzv-endpoint`, `--lighthouse`, `--min-replicas`; `group_size`: `nanoddp train`'s
    `--group-size`); a one-line ValueError for the first flag that does not fit."""
    nnodes_text = str(args.nnodes)
    if not nnodes_text.isdigit() or int(nnodes_text) < 1:
        raise ValueError(
            f"--on-failure continue takes --nnodes N, a fixed number of hosts (a host lost and started again "
            f"rejoins the run; an elastic MIN:MAX is the restart path's), got --nnodes {nnodes_text}"
        )
    nnodes, node_rank = int(nnodes_text), args.node_rank
    if group_size not in (None, 1):
        raise ValueError(
            f"--on-failure continue runs one-rank replicas (--group-size 1), got --group-size {group_size}; "
            "replica groups of several ranks (HSDP inside a host) come later: drop --group-size"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
    replicas = nnodes * nproc
    given = getattr(args, "min_replicas", None)
    min_replicas = majority(replicas) if given is None else given
    if not 1 <= min_replicas <= replicas:
        raise ValueError(
            f"--min-replicas must be in 1..{replicas} (the run's replicas: --nnodes {nnodes} x --nproc {nproc}), "
            f"got {min_replicas}"
        )
    lighthouse, endpoint = getattr(args, "lighthouse", "") or "", args.rdzv_endpoint or ""
    if nnodes == 1 and not (lighthouse or endpoint):
        return Placement(nproc, min_replicas)
    if not (lighthouse or endpoint):
        raise ValueError(
            f"--on-failure continue across hosts (--nnodes {nnodes}) needs --rdzv-endpoint HOST:PORT (node 0's "
            "address: its launcher runs the quorum service there) or --lighthouse HOST:PORT (one already running)"
        )
    flag = "--lighthouse" if lighthouse else "--rdzv-endpoint"
    route = hosts.route_to(lighthouse or endpoint, flag)
    serves = not lighthouse and node_rank == 0
    if serves and not route.is_local:
        raise ValueError(
            f"--rdzv-endpoint {endpoint}: {route.address} is not an address of this host, and node 0's launcher "
            "runs the quorum service there; start node 0 on the host that owns it, or name a quorum service "
            "already running with --lighthouse HOST:PORT"
        )
    return Placement(nproc, min_replicas, nnodes, node_rank, route.local_address, route.interface,
                     (route.address, route.port), serves)  # fmt: skip


def refuse_continue_flags(args: argparse.Namespace) -> None:
    """Under `--on-failure restart`: the quorum service's flags are an error, not ignored."""
    given = ["--lighthouse"] if getattr(args, "lighthouse", "") else []
    given += ["--min-replicas"] if getattr(args, "min_replicas", None) is not None else []
    if given:
        raise ValueError(
            f"{', '.join(given)} applies to --on-failure continue (its quorum service); drop it, or add "
            "--on-failure continue"
        )
