"""What each worker of `nanoddp run` executes: arm the hang watchdog, then run the user's script.

torchrun starts `python -m nanoddp.run.bootstrap --collective-timeout S -- SCRIPT ARGS...` on
every rank. Before the script runs, torch.distributed's collectives are replaced by the
watched versions in `nanoddp.comm.transport.watchdog` (a pass-through while no watchdog is active), and
`init_process_group` is wrapped so that the watchdog starts as soon as the script creates its
process group: it needs that group's store to compare the ranks' progress. The script then runs
as `__main__`, exactly as `python SCRIPT ARGS...` would run it.

Torch's own C++ paths (DDP's gradient buckets) do not go through the Python functions; for
them the process-group timeout is set, unless the script passes one, to the collective timeout
plus a margin, so they fail soon after the watchdog would have fired instead of hanging.

A hang ends the process from the watchdog thread; the report it logs is also written to
torchrun's error file, so the launcher's one-line summary says what hung, where.

A single-node job is private to this machine (`single_node_loopback`): torchrun hands workers
MASTER_ADDR=<this host>, rank 0's TCPStore server listens on every interface whatever address
it is given, and gloo's device follows the hostname's address. So, when every rank runs here,
MASTER_ADDR becomes 127.0.0.1, gloo and nccl are pinned to the loopback interface
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless the user set them), and a script's env://
`init_process_group` gets rank 0's store bound to loopback (`nanoddp.env.bound_store`, as
`nanoddp.env.init` does). On several nodes the agent has chosen the addresses
(`nanoddp.train.launcher.rendezvous`): MASTER_ADDR is rank 0's host's address, where its store is
bound the same way, and gloo's and nccl's interface is set.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
import runpy
import signal
import sys
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from nanoddp import env as nd
from nanoddp import hosts, torchrun
from nanoddp.base.limits import PG_TIMEOUT_MARGIN_S
from nanoddp.base.processes import die_with_parent, take_descendants_along
from nanoddp.comm.transport import watchdog
from nanoddp.train.launcher.agent import AGENT_PID_VAR


def _positional_group_ok(original: Callable[..., Any], watched: Callable[..., Any]) -> Callable[..., Any]:
    """The watched function, also for calls that pass `group`/`async_op` positionally
    (`dist.all_reduce(t, op, group)` is valid torch; the watched version takes them by keyword)."""
    names = list(inspect.signature(original).parameters)
    cut = names.index("group") if "group" in names else len(names)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > cut:
            kwargs.update(zip(names[cut:], args[cut:], strict=False))
            args = args[:cut]
        return watched(*args, **kwargs)

    return call


# torch.distributed's collectives, watched: the set nanoddp's engines use, plus barrier.
WATCHED = {
    name: _positional_group_ok(getattr(dist, name), fn)
    for name, fn in vars(watchdog.TORCH_COLLECTIVES).items()
    if name != "ReduceOp"
}
WATCHED["barrier"] = _positional_group_ok(dist.barrier, watchdog._watched(dist.barrier, "barrier", 0))


class CollectiveHang(RuntimeError):
    """The watchdog's report, as the exception recorded in torchrun's error file."""


class _HangToErrorFile(logging.Handler):
    """Copy the watchdog's hang report into this rank's torchrun error file before it exits,
    and to stderr when the script set up no logging of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR and record.getMessage().startswith("collective hang"):
            ErrorHandler().record_exception(CollectiveHang(record.getMessage()))
        if not logging.getLogger().handlers:  # as logging's last resort would, had we not added a handler
            sys.stderr.write(self.format(record) + "\n")


def single_node_loopback(environ: MutableMapping[str, str] | None = None) -> bool:
    """Point a torchrun worker of a single-node job at loopback only; return whether it did.

    Every rank on this node (LOCAL_WORLD_SIZE == WORLD_SIZE): MASTER_ADDR=127.0.0.1 and gloo on
    the loopback interface. Otherwise nothing changes: other nodes must reach this one."""
    env = os.environ if environ is None else environ
    if not torchrun.inside_torchrun(env) or env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):
        return False
    env["MASTER_ADDR"] = "127.0.0.1"
    nd.pin_sockets_to_loopback(env)
    return True


def _bound_rendezvous(call: inspect.BoundArguments) -> None:
    """An env:// `init_process_group` call given a store whose server listens on MASTER_ADDR only.

    torch's env:// rendezvous makes rank 0's TCPStore server listen on every interface; the
    store `nanoddp.env.bound_store` makes for MASTER_PORT listens on MASTER_ADDR only: 127.0.0.1
    on one node (`single_node_loopback`), rank 0's host's address on several. Calls
    that bring their own store or another init_method, and workers told to use the agent's
    store (a client, nothing to bind), are left as they are."""
    arguments = call.arguments
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if arguments.get("store") is not None or arguments.get("init_method") not in (None, "env://") or agent_store:
        return
    if "MASTER_PORT" not in os.environ:
        return
    rank = arguments.get("rank", -1)
    world_size = arguments.get("world_size", -1)
    arguments["rank"] = int(os.environ["RANK"]) if rank == -1 else rank
    arguments["world_size"] = int(os.environ["WORLD_SIZE"]) if world_size == -1 else world_size
    arguments["init_method"] = None
    timeout = arguments.get("timeout") or nd.DEFAULT_PG_TIMEOUT
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    arguments["store"] = nd.bound_store(address, port, arguments["rank"], arguments["world_size"], timeout)


def arm_watchdog(timeout_s: float, bind_store: bool = False) -> None:
    """Patch torch.distributed so that the script's collectives are watched (see the docstring);
    with `bind_store`, its env:// process group also gets a store listening on MASTER_ADDR only."""
    original_init = dist.init_process_group
    original_destroy = dist.destroy_process_group
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs)
        if call.arguments.get("timeout") is None:
            call.arguments["timeout"] = timedelta(seconds=timeout_s + PG_TIMEOUT_MARGIN_S)
        if bind_store:
            _bound_rendezvous(call)
        excepthook = sys.excepthook
        original_init(*call.args, **call.kwargs)
        sys.excepthook = excepthook  # torch's adds "[rank1]: " to tracebacks; the launcher prefixes already
        watchdog.enable(timeout_s)

    @functools.wraps(original_destroy)
    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        if group is None or group is dist.group.WORLD:
            watchdog.disable()  # its thread reads the store the group is about to close
        original_destroy(group)

    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group
    for name, watched in WATCHED.items():
        setattr(dist, name, watched)
    logging.getLogger(watchdog.__name__).addHandler(_HangToErrorFile())


def run_script(target: str, args: list[str], as_module: bool) -> None:
    """Run `target` as `__main__` with `sys.argv` as `python target args...` would set it."""
    sys.argv = [target, *args]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = str(Path(target).resolve().parent)  # what `python target` puts first
        runpy.run_path(target, run_name="__main__")


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoddp.run.bootstrap")
    parser.add_argument("--collective-timeout", type=float, required=True)
    parser.add_argument("-m", dest="as_module", action="store_true")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(argv)
    # one node: MASTER_ADDR is now 127.0.0.1; several: an address when the agent passed torchrun
    # --local-addr (`nanoddp run` does), else a name, left to torch's env:// rendezvous
    single_node_loopback()
    arm_watchdog(parsed.collective_timeout, bind_store=hosts.is_address(os.environ.get("MASTER_ADDR", "")))
    try:
        run_script(parsed.target, parsed.args, parsed.as_module)
    finally:
        watchdog.disable()


if __name__ == "__main__":
    die_with_parent(int(os.environ.get(AGENT_PID_VAR, os.getppid())))  # even a SIGKILLed launcher takes us along
    take_descendants_along()  # and what the script starts goes with us
    try:
        record(_main)()
    except KeyboardInterrupt:  # Ctrl-C on the launcher, forwarded by torchrun: it says so in one line
        sys.exit(128 + signal.SIGINT)
