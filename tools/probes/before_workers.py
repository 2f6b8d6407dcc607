"""Probes 4.x, bad input fails before any worker starts: one line naming what is wrong, no
traceback, within seconds; a worker that fails later names its rank and its log.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from .context import FAILURE_LINE, TRAIN_TIMEOUT_S, Ctx, flags, python_snippet, short, snap
from .registry import probe
from .verdicts import refusal

BEFORE_WORKERS = "exit 2, one line naming it, no traceback, < 30 s, no worker"


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
        "import sys; from nanoddp.train.checkpoint import snapshot; s = snapshot.load(sys.argv[1]); "
        "s['objects']['optimizer']['state'] = {'state': {}, 'param_groups': []}; snapshot.save(sys.argv[2], s)"
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
