"""Where the nodes of a job meet: torchrun's rendezvous flags, completed for this host.

`nanoddp train` and `nanoddp run` take the same launch options (`cli.add_launch_args`) and turn
them into torchrun's flags here (`launch_argv`); the one agent wrapper (`agent`) completes them
for this host just before the agent starts (`rendezvous`):

- one node: the store on loopback only (`private_rendezvous`);
- several nodes: who hosts the store and where everything listens come from this host's
  interfaces, not from its hostname (`multinode_rendezvous`, `nanoddp.hosts`). torch decides
  both by the hostname, which in containers and namespaces often resolves to 127.0.0.1: then no
  node hosts the store and peers dial loopback.

A rendezvous that cannot happen is one line that names the endpoint, on every node, within the
rendezvous timeout: no route (refused before anything starts, `check_launch_args`), nobody
serving the endpoint, or a node that never joins.
"""

from __future__ import annotations

import argparse
import errno
import secrets

from nanoddp import env as nd
from nanoddp import hosts

RDZV_TIMEOUT_S = 600  # torchrun's own wait for every node to join


class RendezvousUnreachable(RuntimeError):
    """No store answered at the endpoint within the rendezvous timeout; its text is the line shown."""


def check_launch_args(args: argparse.Namespace) -> None:
    """The rendezvous options, checked before anything starts: a positive timeout, and an
    endpoint this host can resolve and route to (`hosts.route_to`); one-line ValueError."""
    if not args.rdzv_timeout > 0:
        raise ValueError(f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout}")
    if args.rdzv_endpoint and not args.standalone:
        hosts.route_to(args.rdzv_endpoint)


def launch_argv(args: argparse.Namespace, nproc: int) -> list[str]:
    """torchrun's launch flags (processes, nodes, rendezvous, restarts) from the launch options."""
    timeout = max(1, round(args.rdzv_timeout))  # torchrun takes whole seconds
    argv = ["--nproc-per-node", str(nproc), "--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank)]
    argv += ["--rdzv-backend", args.rdzv_backend, "--rdzv-id", args.rdzv_id, "--max-restarts", str(args.max_restarts)]
    single_node = str(args.nnodes).split(":")[-1] == "1" and not args.rdzv_endpoint
    if args.standalone or single_node:
        argv.append("--standalone")
    elif args.rdzv_endpoint:
        argv += ["--rdzv-endpoint", args.rdzv_endpoint]
        # how long a node waits to reach the store (read_timeout) and for every node (join_timeout)
        argv += ["--rdzv-conf", f"join_timeout={timeout},read_timeout={timeout}"]
    return argv


def rendezvous(torchrun_argv: list[str]) -> tuple[list[str], object | None]:
    """Complete torchrun's rendezvous flags for this host; return the argv and the store this
    process serves (None: another process's), which must stay referenced while the agent runs.
    Raises RendezvousUnreachable when no store answers at the endpoint in time."""
    if "--standalone" in torchrun_argv:
        return private_rendezvous(torchrun_argv)
    if "--rdzv-endpoint" not in torchrun_argv:
        return torchrun_argv, None
    return multinode_rendezvous(torchrun_argv)


def private_rendezvous(torchrun_argv: list[str]) -> tuple[list[str], object | None]:
    """Single node (`--standalone`): host the rendezvous store on loopback only.

    torchrun's standalone store listens on every interface. Instead this process starts a
    loopback-only store (`env.loopback_store`) and points torchrun's c10d rendezvous at it;
    torchrun's own TCPStore for that port then shares it (multi-tenant)."""
    store = nd.loopback_store(0, 0, 1)
    argv = list(torchrun_argv)
    argv.remove("--standalone")
    argv[argv.index("--rdzv-id") + 1] = secrets.token_hex(8)
    argv[argv.index("--rdzv-backend") + 1] = "c10d"
    return ["--rdzv-endpoint", f"127.0.0.1:{store.port}", *argv], store


def multinode_rendezvous(torchrun_argv: list[str]) -> tuple[list[str], object | None]:
    """Several nodes, decided from this host's interfaces (`hosts.route_to`):

    - the store: the node whose interface holds the endpoint's address hosts it (for the static
      backend, node 0 as well), bound to that address only; torchrun's store for the port shares
      it, told so by `is_host`. When the port is taken there already, another agent on this host
      serves it (several agents behind one address) and this one is a client;
    - a client first waits, up to the rendezvous timeout, for the endpoint to accept a connection
      (`hosts.wait_reachable`), so that nobody serving it is one line, not the store's C++ errors;
    - `--local-addr` is this host's address towards the endpoint, so the workers' MASTER_ADDR is
      reachable (not the hostname), and gloo and nccl listen on the interface that holds it
      (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless set).
    """
    argv = list(torchrun_argv)
    endpoint, backend = _flag(argv, "--rdzv-endpoint"), _flag(argv, "--rdzv-backend")
    route = hosts.route_to(endpoint)
    nd.pin_sockets_to(route.interface)
    store = None
    if route.is_local and (backend == "c10d" or (backend == "static" and _flag(argv, "--node-rank") == "0")):
        try:
            store = nd.bound_store(route.address, route.port, 0, 1)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    timeout = float(_rdzv_conf(argv).get("read_timeout", RDZV_TIMEOUT_S))
    if store is None and not hosts.wait_reachable(route.address, route.port, timeout):
        raise RendezvousUnreachable(unreachable_line(endpoint, timeout))
    if backend == "c10d":
        conf = argv.index("--rdzv-conf") + 1  # launch_argv wrote it
        argv[conf] = f"{argv[conf]},is_host={int(store is not None)}"
    return ["--local-addr", route.local_address, *argv], store


def unreachable_line(endpoint: str, timeout_s: float) -> str:
    """The line for an endpoint where no store answered in time."""
    return (
        f"nanoddp: cannot reach the rendezvous store at {endpoint} within {timeout_s:g} s; start node 0 "
        "(the host that owns that address) with the same --rdzv-endpoint, or check the address and port"
    )


def failure_line(torchrun_argv: list[str], exc: BaseException) -> str:
    """One line for a rendezvous torchrun gave up on (its store lost, or a node that never joined)."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    endpoint, conf = _flag(torchrun_argv, "--rdzv-endpoint"), _rdzv_conf(torchrun_argv)
    if isinstance(exc, RendezvousConnectionError):
        return unreachable_line(endpoint, float(conf.get("read_timeout", RDZV_TIMEOUT_S)))
    return (
        f"nanoddp: rendezvous at {endpoint} timed out after {conf.get('join_timeout', RDZV_TIMEOUT_S)} s: "
        "not every node joined; start each node with the same --nnodes, --rdzv-endpoint and --rdzv-id"
    )


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _rdzv_conf(argv: list[str]) -> dict[str, str]:
    text = _flag(argv, "--rdzv-conf") if "--rdzv-conf" in argv else ""
    return dict(pair.split("=", 1) for pair in text.split(",") if "=" in pair)
