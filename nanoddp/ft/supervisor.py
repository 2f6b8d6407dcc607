"""The launcher of a fault-tolerant run: the quorum service, and one supervised process per replica.

`nanoddp run --on-failure continue` and `nanoddp train --on-failure continue` both launch here.
Why not torchrun's agent: it restarts every local worker when one fails, so the survivors would
die with the lost rank, which is exactly what per-step fault tolerance avoids. Here the launcher
is the supervisor. It runs torchft's Lighthouse (the quorum service; `nanoddp.ft.quorum_service`)
inside the launcher's process, on threads of torchft's own, starts one process per replica
(each in a session of its own, forked from a server that imported it once:
`nanoddp.ft.replica_process`) and watches them: a replica that dies is replaced, up to
`max_restarts` times per replica, by a process with the same replica id and a higher attempt
number, which joins the running group at a step boundary and receives its state
from a peer (`FaultTolerant`). The others are never touched. The first replacement is a warm
spare (`nanoddp.ft.spare`), started with the run and waiting with its imports done; the ones
after it are forked from the same server, their imports done too.

A hung replica is ended too: every replica marks each step boundary it reaches (a file in the
launcher's private directory); one that has marked nothing for the collective timeout and more
while another has (the others went on without it) is SIGKILLed, and so replaced like a dead one.
The run ends when a replica finishes (exit 0) and the rest have finished too, or have not within
the collective timeout more: those are killed, and a replacement that never reached a step (it
has nobody left to join) at once. A replica that exits with `STOPPED_EXIT_CODE` stopped the run
on purpose (`nanoddp.ft.stopped`: its line says why): it is not replaced, the run ends the same
way, and its exit code is the run's; unless another replica marks a step after it (within the
collective timeout) or finishes: then it stopped alone, a failed replica (`_stopped_alone`).

[Note: the launcher never ends the last holder] What a kill can take is the committed state of a
replica that holds it while no other live one does. The hung-replica kill needs another replica
to have marked a step within the timeout: a quorum formed without the silent one, and a quorum
needs a majority (`placement.majority`), so at 2 replicas it never happens, and at more (or
with a smaller `--min-replicas`) the group that went on holds the state (a commit needs every
member), or found nobody holding it and resumed from a snapshot itself (`FaultTolerant`)
before the kill: at 3 replicas or more, a holder that stopped heartbeating (hung) while two
replacements formed such a group is given up at the quorum's heartbeat timeout, not the
collective timeout. The end-of-run kills follow a replica that finished (the state is written)
or a stop. A stop is one group's verdict, reached by all its members at once; the one verdict a
member reaches alone, the same error thrice, came from a replica whose peers went on: that is
the stop the launcher no longer takes for the run's.
Nothing outlives the run: SIGTERM/SIGINT stop every replica (SIGTERM, then SIGKILL), each
replica dies with the launcher even if the launcher is SIGKILLed (it asks Linux for that with
the launcher's pid, `ReplicaEnv.launcher_pid`), and each replica's own children go with it.
Every line a replica prints is prefixed `[replica k] `.

Across hosts each host runs its own launcher (`nanoddp.ft.placement`): it supervises only its
host's replicas (ids K*P .. K*P+P-1), node 0's also runs the quorum service, and one that finds
the run under way (its host was lost and is started again) starts its replicas as joiners
(`nanoddp.ft.quorum_service`). A host lost whole is no launcher's to replace: the others' quorum
leaves its replicas out and goes on. A grower (a host past the starting count, `--max-replicas`,
never node 0) joins alike, to a run under way or not at all: finding none (not started, ended, or
no answer within GROWER_WAIT_S) is one line and exit 1, never a wait nor a run of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanoddp import hosts
from nanoddp.base import processes
from nanoddp.base.limits import STOP_GRACE_S
from nanoddp.env import SOCKET_INTERFACE_VARS
from nanoddp.ft.placement import Placement
from nanoddp.ft.quorum_service import QuorumServiceUnavailable, open_quorum_service
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.replica_process import ReplicaProcess, copy_output, start_fork_server, start_process
from nanoddp.ft.stopped import STOPPED_EXIT_CODE
from nanoddp.tempdirs import make_private_dir

POLL_S = 0.05
BEATS_PREFIX = "nanoddp-ft-beats-"  # the launcher's private dir of step marks, named by its pid
STARTUP_GRACE_S = 120.0  # a replica's first step mark may take this long (imports, data, joining)
GROWER_WAIT_S = 10.0  # a grower's wait for the quorum service: the run it grows is under way, or none is
SILENT_MARGIN_S = 2.0  # past the collective timeout: the others' quorum (join timeout) comes first


@dataclass
class Replica:
    """One replica id and the process that currently plays it."""

    replica: int
    attempt: int = 0
    proc: ReplicaProcess | None = None
    exitcode: int | None = None  # of the current process, once it ended
    started: float = 0.0  # time.time() when the current process started (or took this replica)
    killed: bool = False  # the launcher has SIGKILLed the current process (said once)
    stopped_at: float | None = None  # time.time() when the current process exited with STOPPED_EXIT_CODE
    copiers: list[threading.Thread] = field(default_factory=list)
    prefix: list[str] = field(default_factory=lambda: [""])  # read by the copiers: a spare changes it


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@dataclass(frozen=True)
class Launch:
    """What to run: `command` on each of `nproc` replicas, and how to supervise them."""

    command: Sequence[str]
    nproc: int
    max_restarts: int
    timeout_s: float
    """The collective timeout: past it a silent replica is lost, and the end waits no longer."""
    out: str | None = None
    """Where the replicas write `metrics.jsonl`."""
    name: str = "nanoddp run"
    """How the launcher's own lines begin."""
    warm_spare: bool = True
    """Start a spare with the run (`nanoddp.ft.spare`) to be the first replacement, when there
    may be one (`max_restarts` > 0) and the replicas run `python -m MODULE`."""
    placement: Placement | None = None
    """Where the replicas sit and listen across hosts; None: one node of `nproc` replicas."""
    wait_s: float = 600.0
    """Across hosts: how long a launcher waits for another's quorum service (`--rdzv-timeout`)."""
    on_found: Callable[[], None] | None = None
    """Called once the quorum service is found, before any replica starts (a check that needs
    node 0 up: `nanoddp train`'s shared OUT); its ValueError ends the launch."""

    @property
    def where(self) -> Placement:
        return self.placement or Placement.one_node(self.nproc)


class Supervisor:
    """Starts, watches and replaces the replicas of one fault-tolerant run."""

    def __init__(self, launch: Launch, lighthouse: str, beats: str, join: bool = False) -> None:
        self.launch, self.lighthouse, self.beats, self.join = launch, lighthouse, beats, join
        self.where = launch.where
        self.replicas = [Replica(self.where.first + i) for i in range(self.where.nproc)]
        self.spare: Replica | None = None  # the warm spare while it waits (its `replica` is unused)

    def _environ(self, replica: Replica) -> dict[str, str]:
        """The variables that make a process `replica` (`ReplicaEnv`), and across hosts gloo's and
        nccl's interface (the host's towards the quorum service) unless the user chose one."""
        environ = ReplicaEnv(
            lighthouse=self.lighthouse,
            replica=replica.replica,
            replicas=self.where.replicas,
            max_replicas=self.where.max_replicas,
            attempt=replica.attempt,
            timeout_s=self.launch.timeout_s,
            out=self.launch.out,
            launcher_pid=os.getpid(),
            beats=self.beats,
            address=self.where.address,
            min_replicas=self.where.min_replicas,
            join=self.join,
            host_slot=replica.replica - self.where.first,
            host_replicas=self.where.nproc,
        ).to_environ()
        if self.where.interface is not None:
            for name in SOCKET_INTERFACE_VARS:
                if name not in os.environ:
                    environ[name] = self.where.interface
        return environ

    def _popen(self, holder: Replica, command: Sequence[str], environ: dict[str, str], spare: bool) -> None:
        """Start `command` as `holder`'s process, its output copied with `holder`'s prefix."""
        environ = {**os.environ, **environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        proc = start_process(command, environ, stdin_pipe=spare)
        holder.proc, holder.exitcode, holder.started, holder.killed = proc, None, time.time(), False
        holder.stopped_at = None
        holder.copiers = copy_output(proc, holder.prefix)

    def start(self, replica: Replica) -> None:
        """Start a process for `replica`: its first, or a replacement (the spare used already)."""
        replica.prefix[0] = f"[replica {replica.replica}] "
        self._popen(replica, self.launch.command, self._environ(replica), spare=False)

    def start_spare(self) -> None:
        """Start the warm spare, if this launch has one (see `Launch.warm_spare`)."""
        command = _spare_command(list(self.launch.command))
        if not self.launch.warm_spare or self.launch.max_restarts < 1 or command is None:
            return
        self.spare = Replica(-1, prefix=["[spare] "])
        self._popen(self.spare, command, {}, spare=True)

    def _take_spare(self, replica: Replica) -> bool:
        """Make the waiting spare `replica`'s process; False if there is none (or it died)."""
        waiting, self.spare = self.spare, None
        if waiting is None or waiting.proc is None or waiting.proc.poll() is not None:
            return False
        try:
            waiting.proc.stdin.write((json.dumps(self._environ(replica)) + "\n").encode())  # type: ignore[union-attr]
            waiting.proc.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:  # it died just now
            return False
        replica.proc, replica.exitcode, replica.started, replica.killed = waiting.proc, None, time.time(), False
        replica.stopped_at = None
        replica.copiers, replica.prefix = waiting.copiers, waiting.prefix
        replica.prefix[0] = f"[replica {replica.replica}] "
        return True

    def watch(self) -> int:
        """Run until the end (see the module docstring); return the exit code of the run."""
        for replica in self.replicas:
            self.start(replica)
        self.start_spare()
        finished_at: float | None = None
        while True:
            for replica in self.replicas:
                self._poll(replica)
            self._stopped_alone()
            if self._over() and finished_at is None:
                finished_at = time.monotonic()
            running = [r for r in self.replicas if r.exitcode is None]
            if not running:
                break
            if finished_at is None:
                self._end_silent(running)
            else:
                self._end_unjoined(running)
                running = [r for r in running if r.exitcode is None]
                if not running:
                    break
            if finished_at is not None and time.monotonic() - finished_at > self.launch.timeout_s:
                for replica in running:
                    self._say(f"replica {replica.replica} did not finish with the others: stopped")
                self.stop(signal.SIGKILL)
                break
            time.sleep(POLL_S)
        self._dismiss_spare()
        for replica in self.replicas:
            for copier in replica.copiers:
                copier.join(timeout=STOP_GRACE_S)
        if self.stopped:
            return STOPPED_EXIT_CODE  # the replica said why
        if self.finished:
            return 0
        self._say("no replica finished")
        return 1

    @property
    def stopped(self) -> bool:
        """A replica stopped the run on purpose (`nanoddp.ft.stopped`) and nobody went on
        without it (`_stopped_alone`)."""
        return any(r.stopped_at is not None for r in self.replicas) and not self._stop_pending()

    @property
    def finished(self) -> bool:  # a replica finished the run (exit 0)
        return any(r.exitcode == 0 for r in self.replicas)

    def _stop_pending(self) -> bool:
        """A replica stopped the run at most the collective timeout ago, and others still run:
        they may be stopping with it (its group's members stop at the same point) or going on
        without it (`_stopped_alone`); wait and see."""
        stops = [r.stopped_at for r in self.replicas if r.stopped_at is not None]
        running = any(r.exitcode is None for r in self.replicas)
        return bool(stops) and running and time.time() - min(stops) <= self.launch.timeout_s

    def _stopped_alone(self) -> None:
        """[Note: a stop is the group's] Every member of a group raises `RunStopped` at the same
        point, so after a real stop no replica marks a step again, nor finishes (whenever its exit
        is seen). One that does went on without the stopper, whose same error try after try was its
        own (a replacement's bad setting, say): not the run's stop, and the replicas holding the
        state must not be ended for it; the stopper is a failed replica, replaced as one."""
        for replica in self.replicas:
            at = replica.stopped_at
            if at is not None and (
                self.finished or any(self._last_mark(r) > at for r in self.replicas if r.exitcode is None)
            ):
                replica.stopped_at = None
                self._replace(replica, f"replica {replica.replica} stopped the run while the others went on without it")

    def _over(self) -> bool:
        """The run has ended for every replica: one finished, or one stopped it."""
        return self.stopped or self.finished

    def _dismiss_spare(self) -> None:
        """The run is over: end the spare's input, which ends it (SIGKILL if it lingers)."""
        waiting, self.spare = self.spare, None
        if waiting is None or waiting.proc is None:
            return
        with contextlib.suppress(BrokenPipeError):
            waiting.proc.stdin.close()  # type: ignore[union-attr]
        try:
            waiting.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_session(waiting.proc, signal.SIGKILL)
            waiting.proc.wait()
        for copier in waiting.copiers:
            copier.join(timeout=STOP_GRACE_S)

    def _poll(self, replica: Replica) -> None:
        if replica.exitcode is not None or replica.proc is None:
            return
        code = replica.proc.poll()
        if code is None:
            return
        replica.exitcode = code
        _kill_session(replica.proc, signal.SIGKILL)  # whatever it started goes with it
        if code == STOPPED_EXIT_CODE:
            replica.stopped_at = time.time()  # the run's stop, unless others go on (`_stopped_alone`)
        if code in (0, STOPPED_EXIT_CODE) or self._over():  # one stopped the run, or finished:
            return  # a replacement would meet what stopped the run, or have nobody to join
        self._replace(replica, f"replica {replica.replica} failed ({_describe_exit(code)})")

    def _replace(self, replica: Replica, failed: str) -> None:
        """Start `replica`'s next attempt (the warm spare if there is one), if it has one left."""
        if replica.attempt >= self.launch.max_restarts:
            self._say(f"{failed}; no restarts left")
            return
        if self.finished:  # a replacement would have nobody to join
            self._say(f"{failed}; the others had finished")
            return
        replica.attempt += 1
        if self._take_spare(replica):
            self._say(f"{failed}; the warm spare is replacement {replica.attempt}")
            return
        self._say(f"{failed}; starting replacement {replica.attempt}")
        self.start(replica)

    def _last_mark(self, replica: Replica) -> float:
        """When `replica`'s current process last marked a step boundary (its start, before the first)."""
        try:
            mark = os.stat(os.path.join(self.beats, f"replica-{replica.replica}")).st_mtime
        except FileNotFoundError:
            return replica.started
        return mark if mark >= replica.started else replica.started  # an older process's mark

    def _end_silent(self, running: list[Replica]) -> None:
        """SIGKILL a replica that has marked no step boundary for the collective timeout and more
        while another has (the others left it out: a hang), so that it is replaced like a dead one.
        A group that is stalled as a whole is left alone: nobody is silent *alone* then."""
        now = time.time()
        marks = {r.replica: self._last_mark(r) for r in running}
        newest = max(marks.values())
        for replica in (r for r in running if not r.killed):
            grace = STARTUP_GRACE_S if marks[replica.replica] == replica.started else 0.0
            silent_s = now - marks[replica.replica]
            if silent_s > self.launch.timeout_s + SILENT_MARGIN_S + grace and now - newest < self.launch.timeout_s:
                self._say(f"replica {replica.replica} marked no step for {silent_s:.0f} s while the others did: killed")
                _kill_session(replica.proc, signal.SIGKILL)
                replica.killed = True  # until `_poll` sees it gone: said once

    def _end_unjoined(self, running: list[Replica]) -> None:
        """Once the run has finished, a replacement that never reached a step has nobody left to
        join: stop it now rather than after the timeout."""
        for replica in running:
            if self._last_mark(replica) == replica.started:
                self._say(f"replacement {replica.attempt} of replica {replica.replica} had not joined: stopped")
                _kill_session(replica.proc, signal.SIGKILL)
                replica.proc.wait()  # type: ignore[union-attr]
                replica.exitcode = replica.proc.returncode  # type: ignore[union-attr]

    def stop(self, sig: signal.Signals) -> None:
        """Signal every running replica's session and the spare's (after SIGTERM: SIGKILL the rest)."""
        holders = [*self.replicas, *([self.spare] if self.spare is not None else [])]
        running = [r for r in holders if r.proc is not None and r.proc.poll() is None]
        processes.stop([r.proc for r in running if r.proc is not None], whole_group=True, first=sig)
        for replica in running:
            replica.exitcode = replica.proc.returncode  # type: ignore[union-attr]

    def _say(self, line: str) -> None:
        print(f"{self.launch.name}: {line}", file=sys.stderr, flush=True)


def _spare_command(replica_command: list[str]) -> list[str] | None:
    """`nanoddp.ft.spare`'s command for replicas started as `python -m MODULE ARGS...`, else None.
    (Named, not imported: `python -m nanoddp.ft.spare` must find the module not yet loaded.)"""
    if len(replica_command) < 3 or replica_command[1] != "-m":
        return None
    return [replica_command[0], "-m", "nanoddp.ft.spare", *replica_command[2:]]


def _grower_line(where: Placement, url: str | None) -> str:
    """A grower that found no run under way (the module docstring): why, and what to do. `url`:
    the quorum service's, which answered but has formed no group yet; None: it did not answer."""
    last = where.first + where.nproc - 1
    if url is None:
        address, port = where.lighthouse or ("?", 0)
        why = f"its quorum service at {hosts.url_host(address)}:{port} does not answer within {GROWER_WAIT_S:g} s"
    else:
        why = f"the run at {url} has not formed its first group"
    return (
        f"--node-rank {where.node_rank} grows a run under way (replicas {where.first}..{last}, past the "
        f"{where.replicas} it starts with) but found none: {why}; start a growing host while the run trains "
        "(after its first step, before its last), with the run's --rdzv-endpoint or --lighthouse"
    )


def _kill_session(proc: ReplicaProcess | None, sig: signal.Signals) -> None:
    if proc is None:
        return
    processes.signal_group(proc, sig)  # the replica leads its session's group (start_new_session)


def supervise(launch: Launch) -> int:
    """Start (or find) the quorum service and start the replicas, supervise them, and take every
    process down on the way out (a signal included); return the run's exit code."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's services log every quorum at info
    where = launch.where
    try:
        service = open_quorum_service(where, min(launch.wait_s, GROWER_WAIT_S) if where.grows else launch.wait_s)
    except QuorumServiceUnavailable as exc:
        print(f"{launch.name}: {_grower_line(where, None) if where.grows else exc}", file=sys.stderr, flush=True)
        return 1
    if where.grows and not service.under_way:
        print(f"{launch.name}: {_grower_line(where, service.url)}", file=sys.stderr, flush=True)
        return 1
    if launch.on_found is not None:
        launch.on_found()  # another launcher's service: nothing of ours to shut down
    if service.under_way:
        print(f"{launch.name}: the run is under way at {service.url}: replicas {launch.where.first}.."
              f"{launch.where.first + launch.where.nproc - 1} join it", file=sys.stderr, flush=True)  # fmt: skip
    beats = make_private_dir(BEATS_PREFIX)
    start_fork_server(launch.command)  # before the first replica (and any thread of ours beside it)
    supervisor = Supervisor(launch, service.url, beats, join=service.under_way)
    stopped: list[signal.Signals] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopped.append(signal.Signals(signum))
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.watch()
    except KeyboardInterrupt:
        sig = stopped[0] if stopped else signal.SIGINT
        supervisor.stop(signal.SIGTERM)
        print(f"{launch.name}: stopped by {sig.name}", file=sys.stderr, flush=True)
        return 128 + sig
    finally:
        supervisor.stop(signal.SIGKILL)
        service.shutdown()
        shutil.rmtree(beats, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
