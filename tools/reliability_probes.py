"""Reliability probes of issue 23, re-run the way a careless or unlucky user would run them.

    python tools/reliability_probes.py [--json FILE] [--only TEXT]

Every probe runs real `nanoddp` commands (or a small script of its own that calls the API) as
subprocesses, in a fresh temp dir of its own that is removed afterwards, and checks what it can
observe: exit codes, the exact line printed (and that it is one line, with no traceback), files
on disk, processes and listening sockets (psutil). Each subprocess starts in its own session
with a timeout; its session and every descendant seen while it ran (torchrun's workers run in
sessions of their own) are killed when the probe ends, so nothing outlives the script.

Prints a markdown table `| # | case | expected | outcome | verdict |` (progress goes to stderr),
optionally writes the rows as JSON (`--json FILE`); `--only TEXT` runs the cases whose number or
name contains TEXT. Exit code 0 when no row FAILs, 1 otherwise. The whole set takes several
minutes on 2 CPU cores; run it alone (the interrupt probes time real training steps).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import psutil

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
FAST_S = 15.0  # a refusal in the launcher: imports and checks, no worker start-up
REFUSAL_TIMEOUT_S = 120
TRAIN_TIMEOUT_S = 300
SUITE_TIMEOUT_S = 900
GONE_WITHIN_S = 5.0  # "every worker gone within a few seconds"
WORKER_MODULE = "nanoddp.train"  # torchrun's workers run `python -m nanoddp.train`
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
INTERRUPT_LINE = re.compile(r"nanoddp: interrupted at step (\d+); snapshot saved; rerun the same command to continue")
FAILURE_LINE = re.compile(r"^nanoddp: rank (\d+) failed: (.*) \(full log: (.*)\)$", re.M)
# GPT, 2 blocks of width 32, on 16-byte windows of 1900 bytes of stdlib text: milliseconds a step.
TINY = {
    "nproc": 2,
    "text_max_bytes": 1900,
    "seq_len": 16,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "d_ff": 64,
    "batch_size": 8,
    "steps": 3,
    "warmup_steps": 1,
    "snapshot_every": 1,
    "eval_every": 0,
    "log_every": 10,
}
LONG = {"steps": 400, "snapshot_every": 10, "log_every": 50}  # long enough to be hit mid-run


def flags(**overrides: object) -> list[str]:
    """TINY's flags with `overrides` (a None value drops the flag), plus --no-progress."""
    values = {**TINY, **overrides}
    argv: list[str] = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return [*argv, "--no-progress"]


def nanoddp_argv(*args: object) -> list[str]:
    return [PYTHON, "-m", "nanoddp", *(str(a) for a in args)]


def snap(out: Path, step: int) -> Path:
    return out / "snapshots" / f"step-{step:08d}.pt"


def short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProbeError(Exception):
    """A probe could not reach the state it checks (e.g. its setup run failed)."""


# --- subprocesses ----------------------------------------------------------------------------


class Watched:
    """A subprocess in its own session: stdout and stderr collected in the background, and every
    descendant recorded (with its latest command line) while it runs."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.argv = argv
        self.started = time.monotonic()
        self.ended: float | None = None
        self.timed_out = False
        self.seen: dict[int, tuple[psutil.Process, str]] = {}
        self._out: list[str] = []
        self._err: list[str] = []
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self._err), daemon=True),
        ]
        for thread in [*self._readers, threading.Thread(target=self._watch, daemon=True)]:
            thread.start()

    @staticmethod
    def _read(stream: IO[str], lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def _watch(self) -> None:
        while True:
            self.record()
            if self.popen.poll() is not None:
                self.ended = time.monotonic()
                return
            time.sleep(0.1)

    def record(self) -> None:
        """Add the current descendants to `seen` (refreshing their command lines)."""
        try:
            children = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            proc = self.seen.get(child.pid, (child, ""))[0]
            try:
                self.seen[child.pid] = (proc, " ".join(child.cmdline()))
            except psutil.Error:
                self.seen.setdefault(child.pid, (proc, "?"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def done(self) -> bool:
        return self.popen.poll() is not None

    @property
    def rc(self) -> int | None:
        return self.popen.returncode

    @property
    def out(self) -> str:
        return "".join(self._out)

    @property
    def err(self) -> str:
        return "".join(self._err)

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def descendants(self) -> list[psutil.Process]:
        return [proc for proc, _ in self.seen.values()]

    def workers(self) -> list[psutil.Process]:
        return [proc for proc, cmd in self.seen.values() if WORKER_MODULE in cmd]

    def wait(self, timeout: float) -> int | None:
        """Wait for the exit (killing everything on timeout) and for the output to be read."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
        self.ended = self.ended or time.monotonic()
        for reader in self._readers:
            reader.join(timeout=5)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the session (while its leader is unreaped its id cannot be reused) and every
        descendant seen (psutil checks each one's identity before sending)."""
        self.record()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        for proc in self.descendants():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


class Ctx:
    """One probe's world: a fresh temp dir (with a private TMPDIR inside) and its subprocesses."""

    active: list[Ctx] = []

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="nanoddp-probe-"))
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.procs: list[Watched] = []
        Ctx.active.append(self)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS and not k.startswith("TORCHELASTIC_")}
        return {**env, "TMPDIR": str(self.tmp)}

    def start(self, argv: list[str], cwd: Path | None = None) -> Watched:
        proc = Watched(argv, cwd or self.dir, self.env())
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float, cwd: Path | None = None) -> Watched:
        proc = self.start(argv, cwd)
        proc.wait(timeout)
        return proc

    def nanoddp(self, *args: object, timeout: float = REFUSAL_TIMEOUT_S, cwd: Path | None = None) -> Watched:
        return self.run(nanoddp_argv(*args), timeout, cwd)

    def trained(self, out: Path, **overrides: object) -> Watched:
        """A finished tiny run in `out` (setup for a probe); ProbeError if it fails."""
        run = self.nanoddp("train", *flags(out=out, **overrides), timeout=TRAIN_TIMEOUT_S)
        if run.rc != 0:
            raise ProbeError(f"setup run failed (exit {run.rc}): {short(run.err[-600:])}")
        return run

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self in Ctx.active:
            Ctx.active.remove(self)


def close_all() -> None:
    for ctx in list(Ctx.active):
        ctx.close()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ProbeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def python_snippet(ctx: Ctx, code: str, *args: object, timeout: float = 120) -> str:
    """Run `code` with `python -c` in a subprocess; return its stdout (ProbeError on failure)."""
    run = ctx.run([PYTHON, "-c", code, *(str(a) for a in args)], timeout)
    if run.rc != 0:
        raise ProbeError(f"helper script failed (exit {run.rc}): {short(run.err[-600:])}")
    return run.out


def digests(folder: Path, skip: tuple[str, ...] = (".lock",)) -> dict[str, str]:
    """sha256 of every file under `folder` (relative names), `skip` names left out."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in skip
    }


def listening(proc: psutil.Process) -> list[str]:
    """'ip:port' of every listening TCP socket of `proc`."""
    connections = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN]


def ip_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def leftovers(folder: Path) -> list[str]:
    """What is left in a TMPDIR; torchinductor_<user> is torch's shared kernel cache, meant to stay."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


# --- verdict helpers -------------------------------------------------------------------------


def refusal(run: Watched, *needles: str, code: int = 2) -> tuple[bool, str]:
    """A launcher refusal: exit `code`, exactly one stderr line (nothing on stdout) matching every
    regex in `needles`, no traceback, no worker seen, within FAST_S."""
    lines = run.err.splitlines()
    workers = run.workers()
    problems = []
    if run.rc != code:
        problems.append(f"exit {run.rc}")
    if len(lines) != 1 or run.out.strip():
        problems.append("not one line")
    if "Traceback" in run.out + run.err:
        problems.append("traceback printed")
    missing = [n for n in needles if not re.search(n, run.err)]
    if missing:
        problems.append(f"does not name {missing}")
    if workers or "nanoddp: torchrun" in run.err:
        problems.append(f"{len(workers)} worker(s) started")
    if run.seconds > FAST_S:
        problems.append(f"slow ({run.seconds:.1f} s > {FAST_S:.0f} s)")
    stdout = f" + {len(run.out.splitlines())} on stdout" if run.out.strip() else ""
    status = f"exit {run.rc}, {len(lines)} line(s){stdout}, {run.seconds:.1f} s, {len(workers)} worker(s)"
    if problems:
        status += f" [{'; '.join(problems)}]"
    shown = " // ".join(short(line, 200) for line in lines[-4:])
    return not problems, f"{status}: `{shown}`"


# --- the probes ------------------------------------------------------------------------------


@dataclass
class Probe:
    num: str
    case: str
    expected: str
    fn: Callable[[Ctx], tuple[bool | None, str]]


@dataclass
class Row:
    num: str
    case: str
    expected: str
    outcome: str
    verdict: str  # OK, FAIL, SKIP
    seconds: float


PROBES: list[Probe] = []


def probe(num: str, case: str, expected: str):
    def register(fn: Callable[[Ctx], tuple[bool | None, str]]) -> Callable[[Ctx], tuple[bool | None, str]]:
        PROBES.append(Probe(num, case, expected, fn))
        return fn

    return register


# 1. Run dir ownership


@probe("1.1", "`--resume never` into a dir holding an earlier run", "exit 2, one line, nothing deleted or changed")
def resume_never_on_an_earlier_run(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out)
    before = digests(out)
    run = ctx.nanoddp("train", *flags(out=out, resume="never"))
    ok, outcome = refusal(run, "already holds snapshots")
    after = digests(out)
    kept = after == before
    return ok and kept, f"{outcome}; {len(before)} files {'untouched' if kept else f'CHANGED: {sorted(after)}'}"


@probe(
    "1.2",
    "the same with `--overwrite`",
    "exit 0; old snapshots, model and logs moved intact to OUT/previous-*/",
)
def overwrite_moves_aside(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out)
    before = digests(out)
    run = ctx.nanoddp("train", *flags(out=out, resume="never"), "--overwrite", timeout=TRAIN_TIMEOUT_S)
    aside = sorted(out.glob("previous-*"))
    moved = digests(aside[0]) if len(aside) == 1 else {}
    new = sorted(p.name for p in (out / "snapshots").glob("step-*.pt"))
    ok = run.rc == 0 and moved == before and "earlier outputs moved to" in run.err and len(new) == 3
    where = aside[0].name if aside else "no previous-* dir"
    same = "all intact" if moved == before else f"differ: {sorted(moved)} vs {sorted(before)}"
    return ok, f"exit {run.rc}; {len(before)} files -> {where}/ ({same}); new run wrote {len(new)} snapshots"


@probe(
    "1.3",
    "two concurrent runs on the same `--out`",
    "the second exits 2 at once, one line naming the holder's pid; the first keeps running",
)
def concurrent_runs_on_one_dir(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    first = ctx.start(nanoddp_argv("train", *flags(out=out, steps=3000, snapshot_every=0)))
    lock = out / ".lock"
    wait_until(
        lambda: first.done or (lock.exists() and lock.read_text().strip() == str(first.pid)),
        REFUSAL_TIMEOUT_S,
        "the first run to lock its dir",
    )
    if first.done:
        raise ProbeError(f"the first run ended early (exit {first.rc}): {short(first.err[-400:])}")
    second = ctx.nanoddp("train", *flags(out=out, steps=3000, snapshot_every=0))
    ok, outcome = refusal(second, rf"in use by another run \(pid {first.pid}\)")
    alive = not first.done
    return ok and alive, f"holder pid {first.pid}; {outcome}; first run {'still running' if alive else 'ENDED'}"


@probe(
    "1.4",
    "two runs without `--out` started in the same second",
    "both finish, in two distinct runs/<time>-<suffix> dirs",
)
def default_names_are_distinct(ctx: Ctx) -> tuple[bool, str]:
    notes = []
    for attempt in range(1, 4):
        cwd = ctx.dir / f"attempt{attempt}"
        cwd.mkdir()
        time.sleep(1 - time.time() % 1)  # start both at the top of a second
        runs = [ctx.start(nanoddp_argv("train", *flags(nproc=1, steps=1)), cwd=cwd) for _ in range(2)]
        for run in runs:
            run.wait(TRAIN_TIMEOUT_S)
        dirs = sorted(p.name for p in (cwd / "runs").iterdir()) if (cwd / "runs").is_dir() else []
        finished = [d for d in dirs if (cwd / "runs" / d / "model.pt").is_file()]
        codes = [run.rc for run in runs]
        if codes != [0, 0] or len(finished) != 2:
            return False, f"exits {codes}; runs/: {dirs}; with model.pt: {finished}"
        if dirs[0][:15] == dirs[1][:15]:
            return True, f"exits [0, 0]; same second, distinct dirs: {dirs[0]}, {dirs[1]} (attempt {attempt})"
        notes.append(f"{dirs[0]} / {dirs[1]}")
    return False, f"could not start two runs in one second in 3 tries (distinct anyway: {'; '.join(notes)})"


@probe("1.5", "`--resume PATH` on an empty dir", "exit 2, one line: no valid snapshot in PATH")
def resume_from_an_empty_dir(ctx: Ctx) -> tuple[bool, str]:
    empty = ctx.dir / "empty"
    empty.mkdir()
    run = ctx.nanoddp("train", *flags(out=ctx.dir / "run", resume=empty))
    return refusal(run, "no valid snapshot", re.escape(str(empty)))


@probe("1.6", "`--resume DIR` holding only corrupt snapshots", "exit 2, one line: no valid snapshot")
def resume_from_corrupt_snapshots(ctx: Ctx) -> tuple[bool, str]:
    corrupt = ctx.dir / "corrupt"
    (corrupt / "snapshots").mkdir(parents=True)
    snap(corrupt, 5).write_bytes(b"garbage")
    snap(corrupt, 10).write_bytes(b"")
    run = ctx.nanoddp("train", *flags(out=ctx.dir / "run", resume=corrupt))
    return refusal(run, "no valid snapshot")


@probe(
    "1.7",
    "resume a run with another seq_len and dataset",
    "exit 2, one line naming both differing fields",
)
def resume_another_config(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out)
    run = ctx.nanoddp("train", *flags(out=out, seq_len=32, data="synthetic"))
    return refusal(run, r"seq_len: 16 -> 32", r"data: 'text' -> 'synthetic'")


@probe("1.8", "`--resume auto` on an empty dir", "exit 0, says it starts fresh, trains from step 0")
def resume_auto_on_an_empty_dir(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    out.mkdir()
    run = ctx.nanoddp("train", *flags(out=out, resume="auto"), timeout=TRAIN_TIMEOUT_S)
    said = [line for line in run.err.splitlines() if "starting fresh" in line]
    first = snap(out, 1).is_file()
    ok = run.rc == 0 and any("no snapshot to resume" in line for line in said) and first
    return ok, f"exit {run.rc}; {short(' / '.join(said)) or 'no starting-fresh line'}; step 1 snapshot: {first}"


# 2. Interrupts


def interrupted_run(ctx: Ctx, sig: signal.Signals, group: bool = False) -> tuple[Watched, list[str], dict]:
    """Start a LONG run, signal the agent after its first snapshot, wait for the end. Returns the
    run, its argv and what was observed (workers, survivors, the snapshot at the printed step)."""
    out = ctx.dir / "run"
    argv = nanoddp_argv("train", *flags(out=out, **LONG))
    run = ctx.start(argv)
    wait_until(lambda: run.done or snap(out, 10).exists(), TRAIN_TIMEOUT_S, "the first snapshot")
    if run.done:
        raise ProbeError(f"the run ended before the signal (exit {run.rc}): {short(run.err[-400:])}")
    run.record()
    workers = run.workers()
    if group:  # Ctrl-C in a terminal: SIGINT to the foreground process group
        os.killpg(os.getpgid(run.pid), sig)
    else:
        os.kill(run.pid, sig)
    run.wait(TRAIN_TIMEOUT_S)
    _, alive = psutil.wait_procs(run.descendants(), timeout=GONE_WITHIN_S)
    lines = [line for line in run.err.splitlines() if line.strip()]
    match = INTERRUPT_LINE.fullmatch(lines[-1]) if lines else None
    step = int(match.group(1)) if match else None
    saved = None
    if step is not None and snap(out, step).is_file():
        code = "import sys; from nanoddp.train import snapshot; print(snapshot.load(sys.argv[1]).get('interrupted'))"
        saved = python_snippet(ctx, code, snap(out, step)).strip()
    seen = {
        "workers": len(workers),
        "alive": alive,
        "step": step,
        "saved": saved,
        "interrupt_lines": sum("interrupted" in line for line in lines),
        "traceback": "Traceback" in run.out + run.err,
        "last": lines[-1] if lines else "",
    }
    return run, argv, seen


def interrupt_verdict(run: Watched, sig: signal.Signals, seen: dict) -> tuple[bool, str]:
    ok = (
        run.rc == 128 + sig
        and seen["step"] is not None
        and seen["saved"] == str(int(sig))
        and seen["interrupt_lines"] == 1
        and not seen["traceback"]
        and seen["workers"] == 2
        and not seen["alive"]
    )
    snapshot = f"snapshot of step {seen['step']} marked {seen['saved']}" if seen["step"] else "no step printed"
    return ok, (
        f"exit {run.rc}; last line `{short(seen['last'])}` ({seen['interrupt_lines']} such line); {snapshot}; "
        f"traceback: {seen['traceback']}; {seen['workers']} workers seen, {len(seen['alive'])} left"
    )


@probe(
    "2.1",
    "SIGTERM to the `nanoddp train` agent mid-run",
    "exit 143, one 'interrupted at step N; snapshot saved; ...' line, step N snapshot, no traceback, no worker left",
)
def sigterm_to_the_agent(ctx: Ctx) -> tuple[bool, str]:
    run, _, seen = interrupted_run(ctx, signal.SIGTERM)
    return interrupt_verdict(run, signal.SIGTERM, seen)


@probe(
    "2.2",
    "Ctrl-C (SIGINT to the agent's process group) mid-run",
    "exit 130, the same one line, step N snapshot, no traceback, no worker left",
)
def sigint_to_the_agent(ctx: Ctx) -> tuple[bool, str]:
    run, _, seen = interrupted_run(ctx, signal.SIGINT, group=True)
    return interrupt_verdict(run, signal.SIGINT, seen)


@probe(
    "2.3",
    "rerun the same command after a SIGTERM",
    "exit 0, resumes from the step N snapshot, finishes all steps",
)
def rerun_resumes(ctx: Ctx) -> tuple[bool, str]:
    first, argv, seen = interrupted_run(ctx, signal.SIGTERM)
    if first.rc != 128 + signal.SIGTERM or seen["step"] is None:
        return False, f"the interrupt itself failed: exit {first.rc}, last line `{short(seen['last'])}`"
    rerun = ctx.run(argv, TRAIN_TIMEOUT_S)
    out = ctx.dir / "run"
    resumed = f"resumed from {snap(out, seen['step'])}" in rerun.out + rerun.err
    finished = snap(out, LONG["steps"]).is_file() and (out / "model.pt").is_file()
    ok = rerun.rc == 0 and resumed and finished
    return ok, (
        f"interrupted at step {seen['step']}; rerun exit {rerun.rc}, 'resumed from step-{seen['step']:08d}.pt': "
        f"{resumed}, step {LONG['steps']} snapshot and model.pt: {finished}"
    )


@probe(
    "2.4",
    "SIGKILL of the agent mid-run",
    f"every worker gone within {GONE_WITHIN_S:.0f} s",
)
def sigkill_of_the_agent(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    run = ctx.start(nanoddp_argv("train", *flags(out=out, **LONG)))
    wait_until(lambda: run.done or snap(out, 10).exists(), TRAIN_TIMEOUT_S, "the first snapshot")
    if run.done:
        raise ProbeError(f"the run ended before the kill (exit {run.rc})")
    run.record()
    workers = run.workers()
    pids = [w.pid for w in workers]
    os.kill(run.pid, signal.SIGKILL)
    killed = time.monotonic()
    run.popen.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=GONE_WITHIN_S)
    took = time.monotonic() - killed
    ok = len(workers) == 2 and not alive
    return ok, f"workers {pids} recorded; after the kill {len(alive)} alive ({took:.1f} s)"


# 3. Collectives

INVALID_ON_ONE_RANK = """
import json

import torch

import nanoddp
from nanoddp import comm
from nanoddp.comm import ReduceOp


def rank_fn(env):
    torch.set_num_threads(1)
    op = ReduceOp.AVG if env.rank == 1 else ReduceOp.SUM
    try:
        comm.all_reduce(torch.ones(4, dtype=torch.int64), op=op)
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    after = torch.ones(4)
    comm.all_reduce(after)
    return {"error": error, "after": after.tolist()}


if __name__ == "__main__":
    print(json.dumps(nanoddp.launch(rank_fn, 2, backend="gloo", timeout=120)))
"""


@probe(
    "3.1",
    "int64 all_reduce with AVG on rank 1, SUM on rank 0",
    "the same ValueError text on both ranks; the next all_reduce works",
)
def invalid_on_one_rank(ctx: Ctx) -> tuple[bool, str]:
    script = ctx.dir / "invalid_on_one_rank.py"
    script.write_text(INVALID_ON_ONE_RANK)
    run = ctx.run([PYTHON, str(script)], REFUSAL_TIMEOUT_S)
    if run.rc != 0:
        return False, f"exit {run.rc}: {short(run.err[-600:])}"
    results = json.loads(run.out.strip().splitlines()[-1])
    errors = [r["error"] for r in results]
    same = all(e is not None and e[0] == "ValueError" for e in errors) and errors[0] == errors[1]
    works = all(r["after"] == [2.0] * 4 for r in results)
    if same:
        shown = f"both ranks: {short(': '.join(errors[0]))}"
    else:
        shown = "; ".join(f"rank {i}: {short(': '.join(e), 160) if e else 'no error'}" for i, e in enumerate(errors))
    return same and works, f"{shown}; next all_reduce {'= 2 on both ranks' if works else [r['after'] for r in results]}"


def pytest_row(ctx: Ctx, *args: str) -> tuple[bool, str]:
    """Run some of the repo's tests. --basetemp stays short: tests that point a notebook's TMPDIR
    at their tmp_path bind a Unix socket there, and socket paths are limited to 107 bytes."""
    argv = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(ctx.dir / "pt"), *args]
    run = ctx.run(argv, SUITE_TIMEOUT_S, cwd=REPO)
    lines = [line for line in run.out.splitlines() if line.strip()]
    summary = lines[-1] if lines else short(run.err[-300:])
    timed = f" (killed after {SUITE_TIMEOUT_S} s)" if run.timed_out else ""
    failed = [short(line, 300) for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return run.rc == 0, f"pytest exit {run.rc}{timed}: {short(summary)}" + "".join(f"; {f}" for f in failed)


@probe(
    "3.2",
    "notebook stop button (tests/multiproc/test_notebook_interrupt.py)",
    "pytest passes",
)
def notebook_interrupt_tests(ctx: Ctx) -> tuple[bool, str]:
    return pytest_row(ctx, "tests/multiproc/test_notebook_interrupt.py", "-x")


# 4. Fail before workers start

BEFORE_WORKERS = "exit 2, one line naming it, no traceback, < 15 s, no worker"


@probe("4.1", "`--out` is an existing file", BEFORE_WORKERS)
def out_is_a_file(ctx: Ctx) -> tuple[bool, str]:
    a_file = ctx.dir / "afile"
    a_file.write_text("x")
    return refusal(ctx.nanoddp("train", *flags(out=a_file)), re.escape(str(a_file)), "is a file")


@probe("4.2", "`--out` read-only", BEFORE_WORKERS)
def out_is_read_only(ctx: Ctx) -> tuple[bool | None, str]:
    """chmod 555 does not stop root, so as root the dir is made immutable (chattr +i), which does."""
    read_only = ctx.dir / "ro"
    read_only.mkdir()
    as_root = os.geteuid() == 0
    if as_root and subprocess.run(["chattr", "+i", str(read_only)], capture_output=True).returncode != 0:
        return None, "skipped (root, and chattr +i is not available here)"
    if not as_root:
        read_only.chmod(0o555)
    try:
        return refusal(ctx.nanoddp("train", *flags(out=read_only / "run")), "not writable|[Pp]ermission|[Rr]ead-only")
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(read_only)], capture_output=True)
        else:
            read_only.chmod(0o755)


@probe("4.3", "corrupt `--resume` file", BEFORE_WORKERS)
def corrupt_resume_file(ctx: Ctx) -> tuple[bool, str]:
    bad = ctx.dir / "bad.pt"
    bad.write_bytes(b"not a snapshot at all\n")
    return refusal(ctx.nanoddp("train", *flags(out=ctx.dir / "run", resume=bad)), re.escape(str(bad)), "snapshot")


@probe("4.4", "`--resume` a snapshot of another model size (d_model 32 -> 64)", BEFORE_WORKERS)
def snapshot_of_another_size(ctx: Ctx) -> tuple[bool, str]:
    source = ctx.dir / "small"
    ctx.trained(source)
    run = ctx.nanoddp("train", *flags(out=ctx.dir / "run", d_model=64, resume=snap(source, 3)))
    return refusal(run, "d_model|does not fit")


@probe("4.5", "`--lr nan`", BEFORE_WORKERS)
def lr_nan(ctx: Ctx) -> tuple[bool, str]:
    return refusal(ctx.nanoddp("train", *flags(out=ctx.dir / "run", lr="nan")), r"\blr\b", "nan")


@probe("4.6", "`--grad-clip nan`", BEFORE_WORKERS)
def grad_clip_nan(ctx: Ctx) -> tuple[bool, str]:
    return refusal(ctx.nanoddp("train", *flags(out=ctx.dir / "run", grad_clip="nan")), "grad[_-]clip", "nan")


@probe("4.7", "`--collective-timeout inf`", BEFORE_WORKERS)
def collective_timeout_inf(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.nanoddp("train", *flags(out=ctx.dir / "run", collective_timeout="inf"))
    return refusal(run, "collective[_-]timeout", "inf")


@probe("4.8", "`--d-model 30 --n-heads 4` (not divisible)", BEFORE_WORKERS)
def heads_do_not_divide(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.nanoddp("train", *flags(out=ctx.dir / "run", d_model=30, n_heads=4))
    return refusal(run, "d_model", "n_heads", "divisible")


@probe("4.9", "`--data empty.txt` (an empty file)", BEFORE_WORKERS)
def empty_data_file(ctx: Ctx) -> tuple[bool, str]:
    (ctx.dir / "empty.txt").write_text("")
    return refusal(ctx.nanoddp("train", *flags(out=ctx.dir / "run", data="empty.txt")), "empty.txt", "empty")


@probe("4.10", "malformed TOML `--config`", BEFORE_WORKERS + "; names the file")
def malformed_toml(ctx: Ctx) -> tuple[bool, str]:
    config = ctx.dir / "c.toml"
    config.write_text("steps = [\n")
    run = ctx.nanoddp("train", "--config", config, *flags(out=ctx.dir / "run"))
    return refusal(run, re.escape(str(config)), "toml")


@probe("4.11", "malformed JSON `--config`", BEFORE_WORKERS + "; names the file")
def malformed_json(ctx: Ctx) -> tuple[bool, str]:
    config = ctx.dir / "c.json"
    config.write_text('{"steps": ')
    run = ctx.nanoddp("train", "--config", config, *flags(out=ctx.dir / "run"))
    return refusal(run, re.escape(str(config)), "json")


@probe("4.12", "unknown flag `nanoddp train --bogus`", "exit 2, `train`'s usage (not the top-level one), no traceback")
def unknown_flag(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.nanoddp("train", "--bogus")
    usage = run.err.startswith("usage: nanoddp train")
    named = "nanoddp train: error: unrecognized arguments: --bogus" in run.err
    ok = run.rc == 2 and usage and named and "Traceback" not in run.err and not run.workers()
    last = run.err.strip().splitlines()[-1] if run.err.strip() else ""
    return ok, f"exit {run.rc}, {run.seconds:.1f} s; starts with train's usage: {usage}; last line `{short(last)}`"


@probe("4.13", "`nanoddp sample --top-k 0`", "exit 2, one line naming --top-k, no traceback")
def sample_top_k_0(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out, steps=1)
    return refusal(ctx.nanoddp("sample", "--run", out, "--top-k", 0), "top-k")


@probe(
    "4.14",
    "a worker raises during training (snapshot whose optimizer state does not load)",
    "exit 1, one line per failed rank with OUT/logs/rank<r>.log (which holds the traceback), no traceback printed",
)
def worker_failure(ctx: Ctx) -> tuple[bool, str]:
    source = ctx.dir / "source"
    ctx.trained(source)
    bad = ctx.dir / "bad.pt"
    code = (
        "import sys; from nanoddp.train import snapshot; s = snapshot.load(sys.argv[1]); "
        "s['optimizer'] = {'state': {}, 'param_groups': []}; snapshot.save(sys.argv[2], s)"
    )
    python_snippet(ctx, code, snap(source, 3), bad)
    out = ctx.dir / "run"
    run = ctx.nanoddp("train", *flags(out=out, resume=bad), "--max-restarts", 0, timeout=TRAIN_TIMEOUT_S)
    failed = FAILURE_LINE.findall(run.err)
    ranks = [int(rank) for rank, _, _ in failed]
    logs_ok = all(
        log == str(out / "logs" / f"rank{rank}.log") and Path(log).is_file() and "Traceback" in Path(log).read_text()
        for rank, _, log in failed
    )
    printed_traceback = "Traceback" in run.out + run.err
    ok = run.rc == 1 and failed and len(ranks) == len(set(ranks)) <= 2 and logs_ok and not printed_traceback
    first = f"`{short(f'nanoddp: rank {failed[0][0]} failed: {failed[0][1]} (full log: {failed[0][2]})', 200)}`"
    shown = first if failed else "no per-rank line"
    return bool(ok), (
        f"exit {run.rc}; {len(failed)} rank line(s) for ranks {ranks}, e.g. {shown}; "
        f"logs hold the traceback: {logs_ok}; traceback on the console: {printed_traceback}"
    )


# 5. Private by default


@probe(
    "5.1",
    "listening TCP sockets of a `nanoddp train` agent and its workers",
    "all on 127.0.0.1 / ::1",
)
def train_listens_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    run = ctx.start(nanoddp_argv("train", *flags(out=out, **LONG)))
    wait_until(lambda: run.done or snap(out, 10).exists(), TRAIN_TIMEOUT_S, "the first snapshot")
    if run.done:
        raise ProbeError(f"the run ended before the check (exit {run.rc})")
    run.record()
    workers = run.workers()
    sockets = {"agent": listening(psutil.Process(run.pid))}
    for worker in workers:
        sockets[f"worker {worker.pid}"] = listening(worker)
    addresses = [a for found in sockets.values() for a in found]
    public = [a for a in addresses if ip_of(a) not in LOOPBACK]
    ok = len(workers) == 2 and bool(addresses) and not public
    shown = "; ".join(f"{who}: {', '.join(found) or 'none'}" for who, found in sockets.items())
    return ok, f"{shown}" + (f"; NOT loopback: {public}" if public else "")


INIT_LISTENERS = """
import json

import psutil
import torch

import nanoddp

nanoddp.init()  # one process, no MASTER_ADDR
torch.distributed.all_reduce(torch.ones(1))
me = psutil.Process()
connections = me.net_connections(kind="tcp") if hasattr(me, "net_connections") else me.connections("tcp")
print(json.dumps(sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN)))
nanoddp.cleanup()
"""


@probe("5.2", "`nanoddp.init()` in one process without MASTER_ADDR", "listens on loopback only (or not at all)")
def init_listens_on_loopback(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.run([PYTHON, "-c", INIT_LISTENERS], REFUSAL_TIMEOUT_S)
    if run.rc != 0:
        return False, f"exit {run.rc}: {short(run.err[-600:])}"
    addresses = json.loads(run.out.strip().splitlines()[-1])
    public = [a for a in addresses if ip_of(a) not in LOOPBACK]
    return not public, f"listening: {', '.join(addresses) or 'none'}" + (f"; NOT loopback: {public}" if public else "")


# 6. No leftovers


@probe(
    "6.1",
    "`nanoddp bench restarts --trials 1` with a fresh TMPDIR",
    "trial passes; TMPDIR empty afterwards (no nanoddp-kill-*, nothing else but torch's torchinductor_ cache)",
)
def bench_restarts_leaves_nothing(ctx: Ctx) -> tuple[bool, str]:
    report = ctx.dir / "restarts.json"
    run = ctx.nanoddp("bench", "restarts", "--trials", 1, "--max-delay", 0.5, "--json", report, timeout=SUITE_TIMEOUT_S)
    passed = json.loads(report.read_text()).get("passed") if report.is_file() else None
    left = leftovers(ctx.tmp)
    ok = run.rc == 0 and passed == 1 and not left
    return ok, f"exit {run.rc}, {run.seconds:.0f} s, trials passed: {passed}; left in TMPDIR: {left or 'nothing'}"


@probe("6.2", "`nanoddp train` with a fresh TMPDIR", "TMPDIR empty afterwards")
def train_leaves_nothing(ctx: Ctx) -> tuple[bool, str]:
    run = ctx.trained(ctx.dir / "run")
    left = leftovers(ctx.tmp)
    return not left, f"exit {run.rc}; left in TMPDIR: {left or 'nothing'}"


@probe(
    "6.3",
    "notebook socket dir of a SIGKILLed kernel (tests/reliability/test_reliability_leftovers.py)",
    "pytest -k socket_dir_of_a_killed_kernel passes",
)
def notebook_dir_of_a_killed_kernel(ctx: Ctx) -> tuple[bool, str]:
    return pytest_row(ctx, "tests/reliability/test_reliability_leftovers.py", "-k", "socket_dir_of_a_killed_kernel")


# --- driver ----------------------------------------------------------------------------------


def run_probe(item: Probe) -> Row:
    ctx = Ctx()
    started = time.monotonic()
    try:
        ok, outcome = item.fn(ctx)
        verdict = "SKIP" if ok is None else "OK" if ok else "FAIL"
    except Exception as exc:  # a probe that cannot reach its state is a failed row, not a crash
        verdict, outcome = "FAIL", f"probe error: {type(exc).__name__}: {short(str(exc), 400)}"
    finally:
        ctx.close()
    return Row(item.num, item.case, item.expected, outcome, verdict, round(time.monotonic() - started, 1))


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: list[Row]) -> str:
    lines = ["| # | case | expected | outcome | verdict |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.num} | {cell(row.case)} | {cell(row.expected)} | {cell(row.outcome)} | {row.verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    parser.add_argument("--only", metavar="TEXT", help="run only the cases whose number or name contains TEXT")
    args = parser.parse_args(argv)
    chosen = [p for p in PROBES if not args.only or args.only.lower() in f"{p.num} {p.case}".lower()]
    if not chosen:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    atexit.register(close_all)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the cleanup
    started = time.monotonic()
    rows = []
    try:
        for item in chosen:
            print(f"[{item.num}] {item.case} ...", file=sys.stderr, flush=True)
            rows.append(run_probe(item))
            print(f"[{item.num}] {rows[-1].verdict} ({rows[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    finally:
        close_all()
    total = time.monotonic() - started
    counts = {v: sum(r.verdict == v for r in rows) for v in ("OK", "FAIL", "SKIP")}
    print(table(rows))
    print(f"\n{counts['OK']} OK, {counts['FAIL']} FAIL, {counts['SKIP']} skipped; {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
