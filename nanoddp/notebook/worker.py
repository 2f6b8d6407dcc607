"""The worker side of notebook mode: one process per rank that runs the cells the kernel sends.

Started by `nanoddp.notebook.pool` as `python -m nanoddp.notebook.worker` would be, forked from
the kernel's fork server (`worker_processes.start_worker`), in its own session (so the kernel's
process-group signals do not reach it) with its settings on stdin, never in argv where `ps` would
show the authkey; it dies with the kernel (`fork_server` ties a forked child to its launcher).
It connects back over an authenticated Unix socket, joins the process group, then loops: receive
a cell, run it, stream its output, report.

Cells run like IPython runs them: the code is parsed once, every statement but the last is
exec'd and a final expression is eval'd separately so its value can be shown. SIGINT raises
KeyboardInterrupt only while a cell runs, and never in the middle of a message to the kernel.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import linecache
import logging
import os
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

from nanoddp.notebook.recovery import Inbox, abort_collectives, comm_in_flight, rebuild_group

logger = logging.getLogger(__name__)

NO_VALUE = object()  # a cell whose last statement is not an expression
RICH_REPRS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)


class Channel:
    """The worker's end of the kernel connection, safe against SIGINT.

    A KeyboardInterrupt raised half-way through `Connection.send` would leave a torn message
    on the socket and wreck the protocol for good, so the SIGINT handler only raises while no
    message is being sent; an interrupt that lands during a send is raised right after it.
    """

    def __init__(self, conn: Connection):
        self.conn = conn
        self.busy = False  # a cell is running: SIGINT means "stop it"
        self._lock = threading.Lock()
        self._main_sending = False
        self._interrupt_pending = False

    def send(self, message: tuple) -> None:
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            self._main_sending = True
        try:
            with self._lock:
                self.conn.send(message)
        finally:
            if in_main:
                self._main_sending = False
        if in_main and self._interrupt_pending:
            self._interrupt_pending = False
            if self.busy:
                raise KeyboardInterrupt

    def on_sigint(self, signum: int, frame: Any) -> None:
        """SIGINT handler: interrupt a running cell; ignore it while idle (a late interrupt)."""
        if not self.busy:
            return
        if self._main_sending:
            self._interrupt_pending = True
            return
        raise KeyboardInterrupt


class RankStream(io.TextIOBase):
    """sys.stdout/sys.stderr of a worker: whole lines go to the kernel as they are written.

    Line buffering keeps one rank's line in one message, so the kernel can prefix it with the
    rank without interleaving half-lines of two ranks; `flush()` sends a partial line.
    """

    def __init__(self, channel: Channel, name: str):
        super().__init__()
        self._channel = channel
        self._name = name
        self._pending: list[str] = []
        self._lock = threading.Lock()

    encoding = "utf-8"  # shadows TextIOBase's (None) getter

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._pending.append(text)
            if "\n" not in text:
                return len(text)
            joined = "".join(self._pending)
            cut = joined.rindex("\n") + 1
            self._pending = [joined[cut:]] if cut < len(joined) else []
        self._channel.send(("stream", self._name, joined[:cut]))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            joined = "".join(self._pending)
            self._pending = []
        if joined:
            self._channel.send(("stream", self._name, joined))


def run_source(source: str, namespace: dict, filename: str) -> Any:
    """Run a cell as IPython does: exec all statements, eval a trailing expression.

    Returns the expression's value, or NO_VALUE when the cell does not end in an expression
    or ends with ';' (IPython's "don't show the result"). The source is registered in
    linecache so tracebacks show the offending line.
    """
    tree = ast.parse(source, filename=filename, mode="exec")
    last = None
    if tree.body and isinstance(tail := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    # dont_inherit: this module's `from __future__` imports must not leak into user code.
    exec(compile(tree, filename, "exec", dont_inherit=True), namespace)
    if last is None:
        return NO_VALUE
    value = eval(compile(last, filename, "eval", dont_inherit=True), namespace)
    if source.rstrip().endswith(";"):
        return NO_VALUE
    return value


def format_user_traceback(exc: BaseException) -> str:
    """The traceback from the cell's own frames down: this module's frames are noise."""
    tb = exc.__traceback__
    this_file = os.path.abspath(__file__)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == this_file:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _pretty(value: Any) -> str:
    try:
        from IPython.lib.pretty import pretty  # the same text IPython shows for the value

        return pretty(value)
    except ImportError:
        return repr(value)


def _figure_png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _is_figure(value: Any) -> bool:
    figure_module = sys.modules.get("matplotlib.figure")
    return figure_module is not None and isinstance(value, figure_module.Figure)


def mime_bundle(value: Any, rich: bool) -> dict[str, Any]:
    """{mime type: data} for a value, as Jupyter expects it (binary images base64-encoded).

    Only text/plain unless `rich`: the other ranks' rich output is never shown, so it is not
    computed (rendering a figure to PNG is not free).
    """
    bundle: dict[str, Any] = {"text/plain": _pretty(value)}
    if not rich or isinstance(value, type):
        return bundle
    if _is_figure(value):
        bundle["image/png"] = _figure_png(value)
        return bundle
    for attr, mime in RICH_REPRS:
        method = getattr(value, attr, None)
        if not callable(method):
            continue
        try:
            data = method()
        except Exception:  # a broken _repr_ must not fail the cell; IPython ignores it too
            logger.debug("%s() of %r failed", attr, type(value), exc_info=True)
            continue
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode("ascii")
        if data is not None:
            bundle[mime] = data
    return bundle


class Worker:
    """One rank: its namespace, its streams, and the loop that serves the kernel."""

    def __init__(self, channel: Channel, env: Any, pg_timeout_s: float):
        self.channel = channel
        self.env = env
        self.pg_timeout_s = pg_timeout_s
        self.display_rank = True  # this rank's rich output is the one the notebook shows
        self.namespace = self._make_namespace()
        self.generation = 1  # of the default process group: +1 per rebuild (recovery.py)
        self.state = "idle"  # idle / busy / rebuilding: what %dist_status shows for this rank
        self.inbox: Inbox | None = None

    def _make_namespace(self) -> dict[str, Any]:
        """A fresh `__main__` module, like IPython's, so cell-defined classes can be pickled."""
        import torch
        import torch.distributed as dist

        main = types.ModuleType("__main__", "the notebook cells' namespace on this rank")
        sys.modules["__main__"] = main
        env = self.env
        namespace = main.__dict__
        namespace.update(
            rank=env.rank,
            local_rank=env.local_rank,
            world_size=env.world_size,
            dist=dist,
            torch=torch,
            env=env,
            device=env.device,
            gpu_id=env.device.index if env.device.type == "cuda" else None,
            get=self.get,
            display=self.display,
        )
        return namespace

    def get(self, what: str) -> Any:
        """The notebook tutorials' helper: "ws", "pg", "rank"/"grank" (global rank), "lrank" (local rank)."""
        import torch.distributed as dist

        lookups: dict[str, Callable[[], Any]] = {
            "ws": dist.get_world_size,
            "pg": lambda: dist.group.WORLD,
            "rank": dist.get_rank,
            "grank": dist.get_rank,
            "lrank": lambda: self.env.local_rank,
        }
        if what not in lookups:
            raise ValueError(f"get() knows {sorted(lookups)}, got {what!r}")
        return lookups[what]()

    def display(self, *objects: Any) -> None:
        """IPython's display() for worker code: rich output from the display rank, text from others."""
        for obj in objects:
            self.channel.send(("display", mime_bundle(obj, rich=self.display_rank)))

    def serve(self) -> None:
        """Run requests until the kernel says stop or goes away (EOF: the kernel died)."""
        self.inbox = Inbox(self.channel.conn, self._abort, self._send_status).start()
        while True:
            message = self.inbox.get()
            if message is None:
                logger.debug("rank %d: kernel connection closed", self.env.rank)
                return
            kind = message[0]
            if kind == "run":
                self._run_request(message[1])
            elif kind == "barrier":
                import torch.distributed as dist

                self._execute(lambda: (dist.barrier(), NO_VALUE)[1])
            elif kind == "recover":
                self._recover(message[1])
            elif kind == "shutdown":
                return
            else:
                logger.warning("rank %d: unknown request %r ignored", self.env.rank, kind)

    def _abort(self, peer_pids: list[int]) -> None:
        """(Inbox thread) fail every in-flight collective of this rank, even one blocking the cell."""
        abort_collectives(peer_pids, self.env.backend)

    def _send_status(self) -> None:
        """(Inbox thread) this rank's own account of itself, for %dist_status."""
        import torch.distributed as dist

        info = {"state": self.state, "generation": self.generation, "group": dist.is_initialized()}
        self.channel.send(("status", info))

    def _recover(self, request: dict[str, Any]) -> None:
        """Rebuild the default group (the kernel aborted the old one); variables stay."""
        self.state = "rebuilding"
        try:
            rebuild_group(self.env, request["init_method"], self.pg_timeout_s, request["peer_pids"])
        except Exception as exc:
            reply = ("recover_failed", {"generation": request["generation"], "traceback": format_user_traceback(exc)})
        else:
            self.generation = request["generation"]
            reply = ("recovered", {"generation": self.generation})
        finally:
            self.state = "idle"
        self.channel.send(reply)

    def _run_request(self, request: dict[str, Any]) -> None:
        self.display_rank = request["display"]
        filename = f"<cell {request['cell']}>"
        self._execute(lambda: run_source(request["code"], self.namespace, filename))

    def _execute(self, body: Callable[[], Any]) -> None:
        """Run `body` as a cell: busy while it runs, then flush output and report how it went."""
        report: dict[str, Any] = {"status": "ok", "result": None, "error": None}
        started = time.perf_counter()
        failure: BaseException | None = None
        self.channel.busy, self.state = True, "busy"
        try:
            value = body()
        except KeyboardInterrupt as exc:
            value, failure = NO_VALUE, exc
            report.update(status="interrupted", error=_error_info(exc))
        except BaseException as exc:  # SystemExit too: a cell must not end the worker
            value, failure = NO_VALUE, exc
            report.update(status="error", error=_error_info(exc))
        finally:
            self.channel.busy, self.state = False, "idle"
        report["seconds"] = time.perf_counter() - started
        if failure is not None:  # the kernel rebuilds the group if communication was cut short
            report["comm_in_flight"] = comm_in_flight(failure)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            self._flush_figures()
            if value is not NO_VALUE and value is not None:
                self.namespace["_"] = value
                report["result"] = mime_bundle(value, rich=self.display_rank)
        except Exception as exc:  # showing the result failed (a broken __repr__, savefig...)
            report.update(status="error", error=_error_info(exc))
        self.channel.send(("done", report))

    def _flush_figures(self) -> None:
        """Send the figures the cell drew (display rank only), then close them all, like inline."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None or not pyplot.get_fignums():
            return
        if self.display_rank:
            for number in pyplot.get_fignums():
                figure = pyplot.figure(number)
                self.channel.send(("display", {"image/png": _figure_png(figure), "text/plain": repr(figure)}))
        pyplot.close("all")


def _error_info(exc: BaseException) -> dict[str, str]:
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": format_user_traceback(exc)}


def _start(settings: dict[str, Any], channel: Channel) -> Worker:
    """Join the process group described by `settings` and build the rank's namespace."""
    import torch

    from nanoddp import env as nd

    world_size = settings["world_size"]
    env = nd.DistEnv(
        rank=settings["rank"],
        local_rank=settings["rank"],
        world_size=world_size,
        local_world_size=world_size,
        node_rank=0,
        device=torch.device(settings["device"]),
        backend=settings["backend"],
    )
    torch.set_num_threads(settings["num_threads"])
    nd.init(env, init_method=settings["init_method"], timeout=timedelta(seconds=settings["pg_timeout_s"]))
    return Worker(channel, env, settings["pg_timeout_s"])


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process (it takes no arguments); settings arrive as JSON on stdin."""
    settings = json.loads(sys.stdin.read())
    sys.stdin = open(os.devnull)  # noqa: SIM115  (input() in a cell gets EOF, not a hang)
    # The kernel's inline backend cannot work here (no kernel in this process): render headless.
    os.environ["MPLBACKEND"] = "agg"
    # plt.show() has nothing to show under agg; figures are sent when the cell ends instead.
    warnings.filterwarnings("ignore", message="FigureCanvasAgg is non-interactive")
    conn = Client(settings["address"], family="AF_UNIX", authkey=bytes.fromhex(settings["authkey"]))
    channel = Channel(conn)
    signal.signal(signal.SIGINT, channel.on_sigint)
    channel.send(("hello", settings["rank"], os.getpid()))
    try:
        worker = _start(settings, channel)
    except BaseException as exc:
        channel.send(("fatal", format_user_traceback(exc)))
        return 1
    sys.stdout = RankStream(channel, "stdout")
    sys.stderr = RankStream(channel, "stderr")
    channel.send(("ready", {"device": str(worker.env.device)}))
    worker.serve()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    import torch.distributed as dist

    if dist.is_initialized():  # no barrier: a dead peer would make it hang
        dist.destroy_process_group()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
