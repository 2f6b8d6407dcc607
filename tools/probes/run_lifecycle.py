"""Probes 7.x, `nanoddp run`'s workers live and die with their launcher: SIGTERM and Ctrl-C end
in one line and 128 + signal, a SIGKILLed launcher takes its workers along and its temp dir is
swept by the next start, and a rank that finished while another runs on is named, not waited on
in silence.

The script is a user's own (`dist.init_process_group("gloo")` and a loop of all_reduce), so
these hold for any script, not only for `nanoddp train`'s workers.
"""

from __future__ import annotations

import os
import signal

from .context import GONE_WITHIN_S, TRAIN_TIMEOUT_S, Ctx, ProbeError, short
from .jobs import LOOP, Job, alive, stale_dirs
from .observe import leftovers
from .registry import probe

STOP_TIMEOUT_S = 60  # torchrun gives its workers up to 30 s after a signal before SIGKILL
GRACE_S = 2


def stopped_by(ctx: Ctx, sig: signal.Signals, group: bool) -> tuple[bool, str]:
    job = Job(ctx, LOOP)
    workers = job.wait_for_workers()
    before = len(job.stderr_lines())
    if group:  # Ctrl-C in a terminal: SIGINT to the foreground process group
        os.killpg(os.getpgid(job.run.pid), sig)
    else:
        os.kill(job.run.pid, sig)
    job.run.wait(STOP_TIMEOUT_S)
    left = alive(workers, GONE_WITHIN_S)
    lines = job.stderr_lines()[before:]
    expected = f"nanoddp run: stopped by {sig.name}"
    traceback = "Traceback" in job.run.out + job.run.err
    tmp_left = leftovers(ctx.tmp)
    ok = job.run.rc == 128 + sig and lines == [expected] and not traceback and not left and not tmp_left
    shown = " // ".join(short(line, 160) for line in lines[-3:])
    return ok, (
        f"exit {job.run.rc}; {len(lines)} line(s) after the launch line: `{shown}`; traceback: {traceback}; "
        f"workers left: {left or 'none'}; left in TMPDIR: {tmp_left or 'nothing'}"
    )


@probe(
    "7.1",
    "SIGTERM to a `nanoddp run` launcher (user script: init_process_group + all_reduce loop)",
    "exit 143, one line `nanoddp run: stopped by SIGTERM`, no traceback, both workers gone, TMPDIR empty",
)
def sigterm_to_run(ctx: Ctx) -> tuple[bool, str]:
    return stopped_by(ctx, signal.SIGTERM, group=False)


@probe(
    "7.2",
    "Ctrl-C (SIGINT to the launcher's process group) of `nanoddp run`",
    "exit 130, one line `nanoddp run: stopped by SIGINT`, no traceback, both workers gone, TMPDIR empty",
)
def ctrl_c_to_run(ctx: Ctx) -> tuple[bool, str]:
    return stopped_by(ctx, signal.SIGINT, group=True)


@probe(
    "7.3",
    "SIGKILL of the `nanoddp run` launcher, then a second `nanoddp run` in the same TMPDIR",
    f"both workers gone within {GONE_WITHIN_S:.0f} s; the killed launcher's nanoddp-run-<pid>-* dir is removed "
    "by the next start, a live process's dir is kept",
)
def sigkill_of_run(ctx: Ctx) -> tuple[bool, str]:
    live = ctx.tmp / f"nanoddp-run-{os.getpid()}-live"  # a live process's dir: must not be swept
    live.mkdir()
    first = Job(ctx, LOOP, name="first")
    workers = first.wait_for_workers()
    os.kill(first.run.pid, signal.SIGKILL)
    first.run.wait(STOP_TIMEOUT_S)
    left = alive(workers, GONE_WITHIN_S)
    stale = stale_dirs(ctx.tmp, first.run.pid)
    second = Job(ctx, LOOP, name="second")
    second.wait_for_workers()
    swept = not stale_dirs(ctx.tmp, first.run.pid)
    kept = live.is_dir()
    second.run.kill()
    ok = len(workers) == 2 and not left and len(stale) == 1 and swept and kept
    return ok, (
        f"workers {[w.pid for w in workers]}: {len(left)} alive {GONE_WITHIN_S:.0f} s after the kill; "
        f"dir left by the kill: {stale or 'none'}; swept by the next start: {swept}; live dir kept: {kept}"
    )


@probe(
    "7.4",
    "rank 0 exits 0 while rank 1 sleeps, `nanoddp run --finished-grace 2`",
    "one line naming rank 0 finished and rank 1 still running; the job keeps waiting (no exit)",
)
def finished_rank_is_named(ctx: Ctx) -> tuple[bool, str]:
    job = Job(ctx, LOOP, "--finished-grace", GRACE_S, script_args=("finish-rank-0",))
    workers = job.wait_for_workers()
    expected = f"nanoddp run: rank 0 finished (exit code 0) but rank 1 still running after {GRACE_S}s"
    seen = job.wait_for_stderr(expected, timeout=120)
    if seen:  # it said so: give it a few more grace periods to show it says it once and waits on
        job.wait_for_stderr("never printed", timeout=3 * GRACE_S)
    lines = [line for line in job.stderr_lines() if line.startswith("nanoddp run: ")]
    waiting = not job.run.done and workers[1].is_running()
    ok = seen and len(lines) == 1 and lines[0].startswith(expected) and waiting
    shown = " // ".join(short(line, 200) for line in lines) or "no `nanoddp run:` line"
    return ok, f"{len(lines)} line(s): `{shown}`; launcher still waiting, rank 1 alive: {waiting}"


@probe(
    "7.5",
    "the same with `--fail-on-early-exit`",
    "exit 1, one line naming both ranks and --fail-on-early-exit, no worker left",
)
def fail_on_early_exit(ctx: Ctx) -> tuple[bool, str]:
    job = Job(ctx, LOOP, "--finished-grace", GRACE_S, "--fail-on-early-exit", script_args=("finish-rank-0",))
    workers = job.wait_for_workers()
    job.run.wait(TRAIN_TIMEOUT_S)
    if job.run.timed_out:
        raise ProbeError(f"the job did not end within {TRAIN_TIMEOUT_S} s: {job.tail()}")
    left = alive(workers, GONE_WITHIN_S)
    lines = [line for line in job.stderr_lines() if line.startswith("nanoddp run: ")]
    expected = (
        f"nanoddp run: rank 0 finished (exit code 0) but rank 1 still running after {GRACE_S}s; "
        "stopping the job (--fail-on-early-exit)"
    )
    traceback = "Traceback" in job.run.out + job.run.err
    ok = job.run.rc == 1 and lines == [expected] and not left and not traceback
    shown = " // ".join(short(line, 200) for line in lines) or "no `nanoddp run:` line"
    return ok, f"exit {job.run.rc}; `{shown}`; traceback: {traceback}; workers left: {left or 'none'}"
