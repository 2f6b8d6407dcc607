"""The kernel side of notebook mode: a pool of worker processes and the protocol to drive them.

Transport: one `multiprocessing.connection` Unix socket in a fresh private directory
(`tempfile.mkdtemp`, mode 0700), authenticated with a random 32-byte key
(`secrets.token_bytes`) that reaches the workers on their stdin. Nothing listens on a network
interface, and a process that cannot read the directory cannot even reach the socket. The
process group rendezvous is a `file://` store in the same directory, so no port is used.

Recovery: after a cell that may have left communication half-done (a rank stopped or failed
inside a collective, or still blocked in one), `rebuild` sends every worker "abort" (its inbox
thread shuts the connections to the other workers, failing whatever is in flight) and then
"recover" with the next generation's rendezvous file, `store-g<G>`: a fresh default group on
every rank, nothing read from the old one (see `nanoddp.notebook.recovery`).

The pool knows nothing of IPython: output goes to a `sink` object (`stream(rank, name, text)`,
`display(rank, bundle)`), so the magics decide how it looks.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from multiprocessing.connection import Connection, Listener
from typing import Any

import psutil

from nanoddp.base.processes import stop
from nanoddp.notebook.handshake import (
    DIR_PREFIX,
    PoolError,
    accept_workers,
    remove_stale_dirs,
    socket_dir_parent,
    wait_connections,
    wait_ready,
)
from nanoddp.notebook.outcome import DROP, CellOutcome, Sink
from nanoddp.notebook.worker_processes import WorkerHandle, catch_sigint, start_worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # N pythons importing torch at once on few, shared cores can take a while
INTERRUPT_GRACE_S = 5.0  # after forwarding SIGINT, how long to wait for the cell to stop
# After one rank fails, how long the others get to finish (or raise the same error: bad input
# raises on every rank) before they are interrupted.
PEER_FAILURE_GRACE_S = 2.0
IDLE_WAIT_S = 1.0  # before a new request: how long ranks still busy get before SIGINT (+ grace)
SHUTDOWN_GRACE_S = 10.0  # then SIGTERM, then SIGKILL
POLL_S = 0.1
# Recovery (see nanoddp.notebook.recovery): how long ranks get to leave their aborted cell, and
# then to join the new group (a file rendezvous: well under a second when every rank is there).
ABORT_WAIT_S = 10.0
REBUILD_TIMEOUT_S = 120.0
STATUS_TIMEOUT_S = 5.0  # a worker whose control thread does not answer in time is "unresponsive"


class WorkerPool:
    """N worker processes, one per rank, each with the default process group initialised."""

    def __init__(
        self,
        num_processes: int,
        backend: str,
        devices: Sequence[str],
        num_threads: int,
        pg_timeout_s: float,
    ):
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        if len(devices) != num_processes:
            raise ValueError(f"need one device per process: {num_processes} processes, devices {list(devices)}")
        self.num_processes = num_processes
        self.backend = backend
        self.devices = list(devices)
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.workers: list[WorkerHandle] = []
        self.generation = 1  # of the default process group; each rebuild starts the next one
        self._needs_rebuild = False  # a rebuild was due and did not complete
        self._replies: dict[int, tuple] = {}  # rank -> its latest control reply (status, recovered)
        self._dir: str | None = None
        self._listener: Listener | None = None

    # ----------------------------------------------------------------- start
    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Spawn the workers and wait until every one has joined the process group."""
        remove_stale_dirs()
        # mode 0700: private to this user; named by our pid so a later start can remove it if
        # this process is killed before its own cleanup runs
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=socket_dir_parent())
        address = os.path.join(self._dir, "sock")
        authkey = secrets.token_bytes(32)
        # No authkey here: Listener.accept would run the handshake inline, so one connection that
        # sends nothing would block every worker behind it. Each is authenticated on its own
        # thread with a deadline instead (handshake.authenticate).
        self._listener = Listener(address, family="AF_UNIX")
        try:
            for rank in range(self.num_processes):
                settings = {
                    "rank": rank,
                    "world_size": self.num_processes,
                    "backend": self.backend,
                    "device": self.devices[rank],
                    "num_threads": self.num_threads,
                    "pg_timeout_s": self.pg_timeout_s,
                    "init_method": f"file://{os.path.join(self._dir, 'store')}",
                    "address": address,
                    "authkey": authkey.hex(),
                }
                self.workers.append(WorkerHandle(rank, start_worker(settings)))
            accept_workers(self._listener, address, authkey, self.workers, time.monotonic() + timeout_s)
            self._listener = None  # closed: every worker is in
            wait_ready(self.workers, time.monotonic() + timeout_s)
        except BaseException:
            self.shutdown(grace_s=2.0)
            raise

    # ----------------------------------------------------------------- run
    def run(
        self,
        code: str,
        ranks: Sequence[int],
        sink: Sink,
        cell: int = 0,
        timeout_s: float | None = None,
    ) -> CellOutcome:
        """Run `code` on `ranks`; stream output to `sink` as it comes; return each rank's report.

        The lowest listed rank is the display rank: the only one whose rich output (figures,
        HTML) the notebook shows.
        """
        self.wait_idle(sink)
        self._require_alive(ranks)
        display_rank = min(ranks)
        for rank in ranks:
            request = {"code": code, "cell": cell, "display": rank == display_rank}
            self._send(rank, ("run", request))
        return self._settle(self._collect(ranks, sink, timeout_s), sink)

    def barrier(self, sink: Sink, timeout_s: float | None = None) -> CellOutcome:
        """dist.barrier() on every rank."""
        self.wait_idle(sink)
        ranks = list(range(self.num_processes))
        self._require_alive(ranks)
        for rank in ranks:
            self._send(rank, ("barrier",))
        return self._settle(self._collect(ranks, sink, timeout_s), sink)

    def wait_idle(self, sink: Sink) -> None:
        """Before new work: a rank still busy with an earlier cell, or a rebuild that did not
        complete, would pair the next collective with a stale one; rebuild first (or fail)."""
        if self._needs_rebuild or any(w.busy and w.alive for w in self.workers):
            self.rebuild(sink)
            sink.stream(0, "stderr", f"process group rebuilt (generation {self.generation}) before this cell\n")

    # ----------------------------------------------------------------- recovery
    def _settle(self, outcome: CellOutcome, sink: Sink) -> CellOutcome:
        """After a cell: if any rank may have left communication half-done (interrupted or failed
        inside a collective, or still blocked in one), abort it everywhere and rebuild the group."""
        dirty = any(report.get("comm_in_flight") for report in outcome.reports.values())
        if not (dirty or any(w.busy for w in self.workers)) or not all(w.alive for w in self.workers):
            return outcome  # nothing in flight, or a dead rank: only %dist_init can help then
        try:
            late = self.rebuild(sink)
        except PoolError as exc:
            outcome.recovery_error = str(exc)
            return outcome
        outcome.reports.update(late.reports)
        outcome.died.update(late.died)
        outcome.rebuilt = self.generation
        return outcome

    def rebuild(self, sink: Sink) -> CellOutcome:
        """Abort every rank's in-flight collectives, then give every rank a fresh default group.

        Returns the reports of cells that only ended because of the abort. Raises PoolError
        (and the next request tries again) when a rank does not leave its cell or join."""
        self._require_alive(range(self.num_processes))
        directory = self._dir
        if directory is None:  # workers, hence a dir (shutdown clears both): not reached
            raise PoolError("no workers: run %dist_init first")
        self._needs_rebuild = True
        pids = self.pids()
        for worker in self.workers:  # read by each worker's inbox thread, even mid-collective
            worker.connection.send(("abort", pids))
        busy = [w.rank for w in self.workers if w.busy]
        late = self._collect(busy, sink, ABORT_WAIT_S) if busy else CellOutcome()
        still_busy = [w.rank for w in self.workers if w.busy]
        if still_busy or late.died:
            raise PoolError(
                f"ranks {still_busy or sorted(late.died)} did not leave the interrupted cell after its "
                "collectives were aborted; interrupt again, or restart the workers with %dist_init"
            )
        self.generation += 1
        request = {
            "generation": self.generation,
            "init_method": f"file://{os.path.join(directory, f'store-g{self.generation}')}",
            "peer_pids": pids,
        }
        for worker in self.workers:
            worker.connection.send(("recover", request))
        replies = self._await_replies(("recovered", "recover_failed"), REBUILD_TIMEOUT_S, sink, self.generation)
        failed = {r: m for r, m in replies.items() if m[0] != "recovered"}
        missing = sorted(set(range(self.num_processes)) - set(replies))
        if failed or missing:
            why = "; ".join(f"rank {r}:\n{m[1]['traceback']}" for r, m in sorted(failed.items()))
            raise PoolError(f"rebuilding the process group failed (no answer from ranks {missing}) {why}")
        for worker in self.workers:
            worker.generation = self.generation
        self._needs_rebuild = False
        return late

    def _await_replies(
        self, kinds: tuple[str, ...], timeout_s: float, sink: Sink, generation: int | None = None
    ) -> dict[int, tuple]:
        """Each live rank's reply of one of `kinds` (for `generation`), within timeout_s; output
        that a cell still running prints meanwhile goes to `sink`."""
        pending = {w.rank for w in self.workers if w.alive}
        for rank in pending:
            self._replies.pop(rank, None)
        outcome, replies = CellOutcome(), {}
        deadline = time.monotonic() + timeout_s
        with catch_sigint() as sigint:  # a stop press gives up waiting (between messages)
            while pending and time.monotonic() < deadline and not sigint.count:
                self._pump(pending, outcome, sink)
                for rank in list(pending):
                    reply = self._replies.get(rank)
                    if reply is None or reply[0] not in kinds:
                        continue
                    if generation is None or reply[1].get("generation") == generation:
                        replies[rank] = reply
                        pending.discard(rank)
                pending -= set(outcome.died)
        return replies

    def _require_alive(self, ranks: Sequence[int]) -> None:
        if not self.workers:
            raise PoolError("no workers: run %dist_init first")
        dead = [f"rank {r} {self.workers[r].death}" for r in ranks if not self.workers[r].alive]
        if dead:
            raise PoolError(f"{'; '.join(dead)}; restart the pool with %dist_init")

    def _send(self, rank: int, message: tuple) -> None:
        worker = self.workers[rank]
        worker.connection.send(message)
        worker.busy = True

    def _collect(self, ranks: Sequence[int], sink: Sink, timeout_s: float | None) -> CellOutcome:
        """Pump messages until every rank reports; forward interrupts and the timeout as SIGINT.

        When one rank fails, the others are interrupted too after PEER_FAILURE_GRACE_S (like
        `nanoddp.launch` stopping the job): a rank waiting for the failed one would hang the cell.
        """
        outcome = CellOutcome()
        pending = set(ranks)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stopping_since: float | None = None  # when we asked the workers to stop
        failed_since: float | None = None  # when the first rank raised or died
        with catch_sigint() as sigint:
            while pending:
                now = time.monotonic()
                if failed_since is None and outcome.failed_ranks:
                    failed_since = now
                peer_failed = failed_since is not None and now - failed_since > PEER_FAILURE_GRACE_S
                if stopping_since is None and (sigint.count or peer_failed or (deadline and now > deadline)):
                    outcome.interrupted = sigint.count > 0
                    outcome.timed_out = not outcome.interrupted and failed_since is None
                    self._interrupt(pending)
                    stopping_since = now
                gave_up = stopping_since is not None and now - stopping_since > INTERRUPT_GRACE_S
                if sigint.count > 1 or gave_up:
                    break  # still busy: the next request waits for them (wait_idle)
                self._pump(pending, outcome, sink)
                pending -= set(outcome.reports) | set(outcome.died)
        return outcome

    def _pump(self, pending: set[int], outcome: CellOutcome, sink: Sink) -> None:
        """Handle whatever the pending ranks have sent within POLL_S (reports go into `outcome`,
        control replies into `_replies`; the caller decides which ranks are finished)."""
        conns = {self.workers[r].connection: r for r in pending}
        for conn in wait_connections(conns, POLL_S):
            rank = conns[conn]
            worker = self.workers[rank]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                try:
                    worker.process.wait(timeout=SHUTDOWN_GRACE_S)  # EOF: it is exiting; reap it
                except subprocess.TimeoutExpired:
                    stop([worker.process])
                worker.alive  # noqa: B018  (records the exit code in worker.death)
                worker.busy = False
                outcome.died[rank] = worker.death or "closed its connection"
                pending.discard(rank)
                continue
            kind = message[0]
            if kind == "stream":
                sink.stream(rank, message[1], message[2])
            elif kind == "display":
                sink.display(rank, message[1])
            elif kind == "done":
                worker.busy = False
                outcome.reports[rank] = message[1]
            else:  # "status", "recovered", "recover_failed"
                self._replies[rank] = message

    def _interrupt(self, ranks: set[int]) -> None:
        """SIGINT the busy workers: KeyboardInterrupt in their cell (between bytecodes)."""
        for rank in ranks:
            worker = self.workers[rank]
            if worker.alive and worker.busy:
                with suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGINT)

    # ----------------------------------------------------------------- status & shutdown
    def status(self, sink: Sink | None = None) -> list[dict[str, Any]]:
        """One row per worker: rank, pid, device, state, group generation, RSS in MiB.

        State and generation are what each worker says about itself (answered by its inbox
        thread, so a rank blocked in a collective still answers "busy"); output a stuck cell
        prints meanwhile goes to `sink`."""
        for worker in self.workers:
            if worker.alive:
                with suppress(OSError):
                    worker.connection.send(("status",))
        replies = self._await_replies(("status",), STATUS_TIMEOUT_S, sink or DROP)
        rows = []
        for worker in self.workers:
            rss_mib, generation = None, None
            if worker.alive:
                reply = replies.get(worker.rank)
                state = "unresponsive" if reply is None else reply[1]["state"]
                if reply is not None:
                    generation = reply[1]["generation"] if reply[1]["group"] else 0
                with suppress(psutil.Error):
                    rss_mib = psutil.Process(worker.process.pid).memory_info().rss / 2**20
            else:
                state = f"dead ({worker.death})"
            row = {"rank": worker.rank, "pid": worker.process.pid, "device": worker.device, "state": state}
            rows.append({**row, "generation": generation, "rss_mib": rss_mib})
        return rows

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask every worker to leave the group and exit; SIGTERM/SIGKILL the ones that don't.

        Busy workers get SIGINT (and their collectives are aborted) so they finish their cell and
        read the request. Every process is waited for, so none is left behind, not even as a zombie.
        """
        pids = self.pids()
        for worker in self.workers:  # abort first: a rank blocked in a collective then leaves it
            if worker.conn is not None and worker.alive:
                with suppress(OSError):
                    worker.conn.send(("abort", pids))
                    worker.conn.send(("shutdown",))
        self._interrupt({w.rank for w in self.workers})
        self._drain_until_exit(time.monotonic() + grace_s)
        lingering = [w for w in self.workers if w.process.poll() is None]
        for worker in lingering:
            logger.warning(
                "rank %d did not exit in %.0fs; terminating pid %d", worker.rank, grace_s, worker.process.pid
            )
        stop([w.process for w in lingering])  # one grace for all of them together
        for worker in self.workers:
            if worker.conn is not None:
                worker.conn.close()
        self.workers = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _drain_until_exit(self, deadline: float) -> None:
        """Read and drop late output while waiting, so no worker blocks on a full socket."""
        open_conns: list[Connection] = [w.conn for w in self.workers if w.conn is not None and w.alive]
        while time.monotonic() < deadline and any(w.process.poll() is None for w in self.workers):
            for conn in wait_connections(open_conns, POLL_S) if open_conns else []:
                try:
                    conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
            if not open_conns:
                time.sleep(POLL_S)
