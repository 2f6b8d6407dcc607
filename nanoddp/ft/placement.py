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

[Note: growth] `--max-replicas M` (or torchrun's spelling, `--nnodes N:MAX`: M = MAX*P) lets the
run grow past the N*P replicas it starts with: a host launched later with a node rank K >= N whose
ids K*P .. K*P+P-1 are all below M is a grower. It joins the running group at a step boundary and
heals from a peer, as a host started again does, and the global batch of every step after it is
split over one more replica (`global_batches.share`). A grower comes to a run under way: one
that finds none is refused in one line (`supervisor.supervise`). The starting count still
decides the rest: the first step waits for N*P replicas, and the default `--min-replicas` is a
majority of them.

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
    """Replicas this launcher plays (one process each, or a group of `--group-size` processes)."""
    min_replicas: int
    """The fewest replicas a quorum (and so a step) may have."""
    nnodes: int = 1
    node_rank: int = 0
    address: str = LOOPBACK
    """Where this host's replicas bind their servers, and what they tell the others."""
    interface: str | None = None
    """The interface that holds `address` (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); None on one
    node, where the replicas pin gloo and nccl to loopback themselves."""
    lighthouse: tuple[str, int] | None = None
    """(address, port) of the quorum service; None on one node: loopback, a port of the OS's choice."""
    serves_lighthouse: bool = True
    """This launcher starts the quorum service (node 0 without `--lighthouse`, or one node)."""
    max_replicas: int = 0
    """The most replicas the run may grow to (the module's note); 0: `replicas`, no growth."""

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
    def most_replicas(self) -> int:
        """The replica ids of the run are below this: `max_replicas`, or `replicas` without growth."""
        return max(self.max_replicas, self.replicas)

    @property
    def grows(self) -> bool:
        """This launcher's replicas are past the starting count: it joins a run under way."""
        return self.node_rank >= self.nnodes

    @property
    def across_hosts(self) -> bool:
        return self.interface is not None


def _hosts(nnodes_text: str) -> tuple[int, int | None]:
    """`--nnodes N` or torchrun's `MIN:MAX` under continue: (hosts at start, most hosts or None)."""
    start, sep, most = nnodes_text.partition(":")
    if start.isdigit() and int(start) >= 1 and (not sep or (most.isdigit() and int(most) >= int(start))):
        return int(start), int(most) if sep else None
    raise ValueError(
        f"--on-failure continue takes --nnodes N (hosts at start) or N:MAX (start with N, grow to MAX hosts' "
        f"replicas, as --max-replicas MAX x --nproc), got --nnodes {nnodes_text}"
    )


def placement_for(args: argparse.Namespace, nproc: int, group_size: int | None = None) -> Placement:
    """This launcher's `Placement` from the launch flags (`--nnodes`, `--node-rank`,
    `--rdzv-endpoint`, `--lighthouse`, `--min-replicas`, `--max-replicas`; `nproc`: the processes
    of each host; `group_size`: `nanoddp train`'s `--group-size`, the processes of each replica,
    default 1); a one-line ValueError for the first flag that does not fit. The replica counts
    (`--min-replicas`, `--max-replicas`) count replica groups."""
    nnodes, most_hosts = _hosts(str(args.nnodes))
    node_rank = args.node_rank
    group_size = group_size or 1
    if group_size < 1 or nproc % group_size:
        raise ValueError(
            f"--group-size {group_size} (processes per replica group) must divide --nproc {nproc} (the processes "
            f"of each host) into whole groups; use a divisor of {nproc}, e.g. {nproc} (a host is one replica group)"
        )
    nproc //= group_size  # from here on: the replicas of each host
    replicas = nnodes * nproc
    max_replicas = _max_replicas(getattr(args, "max_replicas", None), most_hosts, nnodes, nproc)
    if not 0 <= node_rank < max_replicas // nproc:
        raise ValueError(_node_rank_line(node_rank, nnodes, nproc, max_replicas))
    given = getattr(args, "min_replicas", None)
    min_replicas = majority(replicas) if given is None else given
    if not 1 <= min_replicas <= replicas:
        raise ValueError(
            f"--min-replicas must be in 1..{replicas} (the run's replicas: --nnodes {nnodes} x --nproc {nproc}), "
            f"got {min_replicas}"
        )
    lighthouse, endpoint = getattr(args, "lighthouse", "") or "", args.rdzv_endpoint or ""
    if max_replicas == replicas == nproc and not (lighthouse or endpoint):
        return Placement(nproc, min_replicas)
    if not (lighthouse or endpoint):
        raise ValueError(
            f"--on-failure continue across hosts (--nnodes {args.nnodes}"
            + (f", --max-replicas {max_replicas}" if max_replicas > replicas else "")
            + ") needs --rdzv-endpoint HOST:PORT (node 0's address: its launcher runs the quorum service there) "
            "or --lighthouse HOST:PORT (one already running)"
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
                     (route.address, route.port), serves, max_replicas if max_replicas > replicas else 0)  # fmt: skip


def _max_replicas(given: int | None, most_hosts: int | None, nnodes: int, nproc: int) -> int:
    """The most replicas the run may grow to, from `--max-replicas` or `--nnodes N:MAX` (one line
    when they disagree or fall below the starting count)."""
    replicas = nnodes * nproc
    from_hosts = None if most_hosts is None else most_hosts * nproc
    if given is not None and from_hosts is not None and given != from_hosts:
        raise ValueError(
            f"--max-replicas {given} and --nnodes {nnodes}:{most_hosts} (up to {from_hosts} replicas at --nproc "
            f"{nproc}) disagree: they say the same thing, give one of them"
        )
    most = given if given is not None else from_hosts if from_hosts is not None else replicas
    if most < replicas:
        raise ValueError(
            f"--max-replicas must be at least the replicas the run starts with (--nnodes {nnodes} x --nproc "
            f"{nproc} = {replicas}), got {most}; drop it for a run that does not grow"
        )
    return most


def _node_rank_line(node_rank: int, nnodes: int, nproc: int, max_replicas: int) -> str:
    """Why `--node-rank` does not fit: its replica ids reach past the run's most replicas."""
    if max_replicas == nnodes * nproc:
        return f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}"
    first = node_rank * nproc
    return (
        f"--node-rank must be in 0..{max_replicas // nproc - 1} (node rank K plays replica ids K*P..K*P+P-1, "
        f"P = --nproc {nproc}: all below --max-replicas {max_replicas}), got {node_rank} (ids {first}.."
        f"{first + nproc - 1}); "
        "raise --max-replicas for more hosts"
    )


def refuse_continue_flags(args: argparse.Namespace) -> None:
    """Under `--on-failure restart`: the quorum service's flags are an error, not ignored."""
    given = ["--lighthouse"] if getattr(args, "lighthouse", "") else []
    given += ["--min-replicas"] if getattr(args, "min_replicas", None) is not None else []
    given += ["--max-replicas"] if getattr(args, "max_replicas", None) is not None else []
    if given:
        raise ValueError(
            f"{', '.join(given)} applies to --on-failure continue (its quorum service); drop it, or add "
            "--on-failure continue"
        )
