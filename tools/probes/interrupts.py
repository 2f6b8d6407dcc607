"""Probes 2.x, interrupts: SIGTERM, Ctrl-C and SIGKILL of the `nanoddp train` agent mid-run end
with a snapshot, one line and no worker left, and the same command resumes.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from .context import (
    GONE_WITHIN_S,
    INTERRUPT_LINE,
    LONG,
    TRAIN_TIMEOUT_S,
    Ctx,
    ProbeError,
    flags,
    nanoddp_argv,
    python_snippet,
    short,
    snap,
    wait_until,
)
from .registry import probe
from .watched import Watched


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
        code = (
            "import sys; from nanoddp.train.checkpoint import snapshot; "
            "print(snapshot.train_state(snapshot.load(sys.argv[1]), sys.argv[1]).get('interrupted'))"
        )
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
