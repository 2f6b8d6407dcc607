"""The distributed environment: who am I, how many are we, and how do we talk.

`DistEnv` is the one object that carries distributed facts through the code. It is built
once from the torchrun environment variables (this is the only module that reads
`os.environ`) or directly by `nanoddp.launch`, and passed down explicitly.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import psutil
import torch
import torch.distributed as dist

from nanoddp import hosts
from nanoddp.torchrun import inside_torchrun, scheduler_vars

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

TORCHRUN_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")
DEFAULT_PG_TIMEOUT = timedelta(minutes=5)


def default_backend(local_world_size: int = 1) -> str:
    """nccl when every local rank can own a GPU, gloo otherwise (CPU, or too few GPUs)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """One GPU per local rank under nccl; everything on the CPU under gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Immutable: pass it down, never re-read env vars."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    """How many times torchrun has restarted this worker group (TORCHELASTIC_RESTART_COUNT)."""
    torchrun: bool = field(default=False)
    """True when the process was started by torchrun's elastic agent."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, local_world_size={self.local_world_size}), got {self.local_rank}"
            )
        if self.backend not in ("gloo", "nccl", "mpi", "ucc"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def is_master(self) -> bool:
        """Rank 0: the one process that logs, prints and writes shared files."""
        return self.rank == 0

    @classmethod
    def single_process(cls, backend: str | None = None) -> DistEnv:
        """The environment of a plain `python script.py` run: one rank, one node."""
        backend = backend or default_backend(1)
        return cls(0, 0, 1, 1, 0, device_for(backend, 0), backend)

    @classmethod
    def from_process_group(cls) -> DistEnv:
        """The environment of a process group the script made itself (e.g. with a file://
        store): rank, size and backend from the group, the node layout from torchrun's
        variables when present (else one node)."""
        rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return cls(
            rank,
            local_rank,
            world_size,
            local_world_size,
            rank // local_world_size,
            device_for(backend, local_rank),
            backend,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            torchrun=inside_torchrun(),
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, backend: str | None = None) -> DistEnv:
        """Build from torchrun's variables, else srun's or mpirun's (`nanoddp.torchrun`); with none
        of them set, a single-process env.

        A partial set (say RANK without WORLD_SIZE) is an error rather than a guess, because a
        guessed world size is how jobs hang at the first collective.
        """
        environ = os.environ if environ is None else environ
        present = [name for name in ("RANK", "WORLD_SIZE") if name in environ]
        if not present:
            mapped = scheduler_vars(environ)  # srun / mpirun: one job of N ranks, or a refusal
            if mapped is None:
                return cls.single_process(backend)
            return cls.from_environ(mapped, backend)
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise ValueError(
                f"incomplete distributed environment: {', '.join(present)} set but "
                f"{', '.join(missing)} missing; launch with torchrun (or `nanoddp train`), "
                "which sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        rank = _int_var(environ, "RANK")
        world_size = _int_var(environ, "WORLD_SIZE")
        local_rank = _int_var(environ, "LOCAL_RANK", default=rank)
        local_world_size = _int_var(environ, "LOCAL_WORLD_SIZE", default=world_size)
        node_rank = _int_var(environ, "GROUP_RANK", default=0)
        if world_size > 1:
            unset = [name for name in TORCHRUN_RENDEZVOUS_VARS if name not in environ]
            if unset:
                raise ValueError(
                    f"WORLD_SIZE={world_size} but {', '.join(unset)} not set: the ranks cannot "
                    "find each other; set MASTER_ADDR and MASTER_PORT (torchrun does this)"
                )
        master_port = _int_var(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None
        backend = backend or default_backend(local_world_size)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            device=device_for(backend, local_rank),
            backend=backend,
            master_addr=environ.get("MASTER_ADDR"),
            master_port=master_port,
            restart_count=_int_var(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
            torchrun="TORCHELASTIC_RUN_ID" in environ,
        )


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in environ:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    raw = environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"environment variable {name} must be >= 0, got {value}")
    return value


def free_port() -> int:
    """A TCP port the OS says is free right now on loopback (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_store(port: int, rank: int, world_size: int, timeout: timedelta = DEFAULT_PG_TIMEOUT) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1:`port` that listens on loopback only (the rank-0 server)."""
    return bound_store("127.0.0.1", port, rank, world_size, timeout)


def bound_store(
    address: str, port: int, rank: int, world_size: int, timeout: timedelta = DEFAULT_PG_TIMEOUT
) -> dist.TCPStore:
    """A TCPStore on `address`:`port` whose server (rank 0) listens on that address only.

    torch's TCPStore server listens on every interface, whatever host it is given, so a job
    would accept connections from any network. Rank 0 binds the listening socket itself and
    hands it over (`master_listen_fd`); `multi_tenant` lets a later TCPStore for the same port in
    this process (torchrun's rendezvous) reuse this server. Raises OSError (EADDRINUSE) when the
    port is taken on that address.
    """
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    store = dist.TCPStore(
        address,
        listener.getsockname()[1],
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.fileno(),
    )
    listener.detach()  # the store's server owns the descriptor now (and closes it)
    return store


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == "127.0.0.1" for address in addresses):
            return name
    return "lo"


SOCKET_INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo's and nccl's sockets listen (nccl's for its bootstrap and its socket transport)."""


def pin_sockets_to(interface: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Make gloo and nccl listen on `interface`, unless the user chose one for either.

    Without these variables gloo listens on the address the hostname resolves to and nccl on the
    first interface that is not loopback: a local job would accept connections from other
    machines. Both read them whenever they create a group, so groups made later follow too."""
    environ = os.environ if environ is None else environ
    for name in SOCKET_INTERFACE_VARS:
        environ.setdefault(name, interface)


def pin_sockets_to_loopback(environ: MutableMapping[str, str] | None = None) -> None:
    """`pin_sockets_to` the loopback interface: every rank runs on this machine."""
    pin_sockets_to(loopback_interface(), environ)


def _is_loopback(host: str) -> bool:
    """A loopback address or `localhost`; a name is not resolved (its answer is the question)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def all_ranks_here(env: DistEnv, init_method: str | None = None) -> bool:
    """Whether every rank of `env`'s job runs on this machine, so its sockets can stay on loopback.

    torchrun counts this node's ranks (LOCAL_WORLD_SIZE) itself. Elsewhere LOCAL_WORLD_SIZE may
    be a default, so a rendezvous endpoint off loopback (MASTER_ADDR, tcp://HOST) is taken as
    the user's word that other machines take part."""
    if env.local_world_size != env.world_size:
        return False
    if env.torchrun:
        return True
    host = env.master_addr
    if init_method is not None and init_method.startswith("tcp://"):
        host = urlsplit(init_method).hostname
    return host is None or _is_loopback(host)


def init(
    env: DistEnv | None = None,
    init_method: str | None = None,
    timeout: timedelta = DEFAULT_PG_TIMEOUT,
) -> DistEnv:
    """Initialise the default process group for `env` (from the environment when None).

    `timeout` bounds torch's own collectives so that a lost peer becomes an error, not a hang.
    Private by default: a single-process env without MASTER_ADDR gets a loopback-only rendezvous
    (so code written for N ranks runs unchanged with one), and so does a torchrun job whose ranks
    all run on this node; whenever every rank runs here, gloo listens on loopback too
    (`pin_sockets_to_loopback`). Multi-node jobs meet at MASTER_ADDR (rank 0's store bound to it when
    it is an address, else torch's env:// rendezvous), and gloo and nccl listen on the interface
    towards it (`hosts.route_to`) unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise.
    """
    env = env or DistEnv.from_environ()
    if dist.is_initialized():
        return env
    store = None
    if init_method is None:
        # torchrun >= 2.5 may hand its workers the agent's own store (MASTER_PORT is then the
        # agent's server): only when the workers host their own store can they bind it here.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        port = env.master_port if env.torchrun and not agent_store else None
        if port is not None and env.local_world_size == env.world_size:
            store = loopback_store(port, env.rank, env.world_size, timeout)
        elif port is not None and env.master_addr is not None and hosts.is_address(env.master_addr):
            # several nodes, MASTER_ADDR an address of rank 0's host (`nanoddp train` passes
            # torchrun --local-addr): rank 0's server listens on that address only
            store = bound_store(env.master_addr, port, env.rank, env.world_size, timeout)
        elif env.torchrun:  # torch's env:// rendezvous keys the store by restart attempt
            init_method = "env://"
        elif env.master_addr is not None and env.master_port is not None:
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
        elif env.world_size == 1:
            store = loopback_store(0, 0, 1, timeout)
        else:
            raise ValueError(f"world_size={env.world_size} needs MASTER_ADDR/MASTER_PORT or init_method")
    if all_ranks_here(env, init_method):
        pin_sockets_to_loopback()
    elif env.master_addr is not None and env.master_port is not None:
        # gloo would listen on the hostname's address (127.0.0.1 in many containers): the
        # interface towards rank 0's host instead, unless the user chose one
        pin_sockets_to(hosts.route_to(f"{env.master_addr}:{env.master_port}").interface)
    if env.backend == "nccl":
        torch.cuda.set_device(env.device)
    dist.init_process_group(
        backend=env.backend,
        init_method=init_method,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        # nccl: bind the group to this rank's GPU (torch otherwise guesses it from the rank)
        device_id=torch.device(env.device) if env.backend == "nccl" else None,
    )
    logger.debug("rank %d/%d joined via %s (%s)", env.rank, env.world_size, init_method or "loopback", env.backend)
    return env


def cleanup() -> None:
    """Barrier, then destroy the process group. Safe to call twice or when never initialised."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def abandon() -> None:
    """Destroy the process group without a barrier: the way out after an error on this rank."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int, rank: int = 0, same_across_ranks: bool = False) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device); return the seed used.

    With `same_across_ranks=False` each rank gets `seed + rank`: different dropout masks and
    data augmentation per rank, which is what data parallelism wants. Model init must then come
    from a broadcast (DDP does it), not from the RNG.
    """
    effective = seed if same_across_ranks else seed + rank
    random.seed(effective)
    try:
        import numpy as np

        np.random.seed(effective % 2**32)
    except ImportError:  # numpy is optional for torch
        pass
    torch.manual_seed(effective)  # also seeds every CUDA device
    return effective
