"""Probes 1.x, run dir ownership: an earlier run's outputs are never lost or mixed with a new
run's, and two runs never write into one dir.
"""

from __future__ import annotations

import re
import time

from .context import REFUSAL_TIMEOUT_S, TRAIN_TIMEOUT_S, Ctx, ProbeError, flags, nanoddp_argv, short, snap, wait_until
from .observe import digests
from .registry import probe
from .verdicts import refusal


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
