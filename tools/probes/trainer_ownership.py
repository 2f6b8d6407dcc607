"""Probes 10.x, what a Trainer owns it checks and gives back: an optimizer over parameters that
are not the model's is refused; a planted `OUT/.lock` symlink is refused, never followed; and a
Trainer that raised after taking its run dir lets a corrected one in the same process have it.

The Trainer probes run a user's script in one plain process (no torchrun), as a notebook or a
quick experiment would.
"""

from __future__ import annotations

import json
import os

from .context import PYTHON, TRAIN_TIMEOUT_S, Ctx, ProbeError, flags, short
from .registry import probe
from .verdicts import refusal

SETUP = """
import json, os, sys
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
import nanoddp
torch.set_num_threads(1)

def data(n):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x.sum(1) > 0).long())

OPTIONS = dict(loss_fn=nn.functional.cross_entropy, steps=2, batch_size=8, progress=False, engine="single")

def attempt(make):
    try:
        make()
        return None
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
"""

FOREIGN_OPTIMIZER = (
    SETUP
    + """
out = sys.argv[1]
model, other = nn.Linear(4, 2), nn.Linear(4, 2)
foreign_opt = torch.optim.SGD(other.parameters(), lr=0.1)
foreign = attempt(lambda: nanoddp.Trainer(model, foreign_opt, data(32), out=out, **OPTIONS))
mixed_opt = torch.optim.SGD([*model.parameters(), other.bias], lr=0.1)
mixed = attempt(lambda: nanoddp.Trainer(model, mixed_opt, data(32), out=out, **OPTIONS))
print(json.dumps({"foreign": foreign, "mixed": mixed, "out_exists": os.path.exists(out)}))
"""
)


def script_result(ctx: Ctx, code: str, *args: object) -> dict:
    run = ctx.run([PYTHON, "-c", code, *(str(a) for a in args)], TRAIN_TIMEOUT_S)
    if run.rc != 0 or not run.out.strip():
        raise ProbeError(f"the script failed (exit {run.rc}): {short(run.err[-600:])}")
    return json.loads(run.out.strip().splitlines()[-1])


def error_text(error: list[str] | None) -> str:
    return f"{error[0]}: `{short(error[1], 200)}`" if error else "NOT refused"


@probe(
    "10.1",
    "`Trainer(model, SGD(other_model.parameters()), ...)`; and an optimizer over the model's plus one foreign",
    "ValueError, one line each (none of its 2 parameters are the model's / 1 of 3 is not); no run dir made",
)
def foreign_optimizer(ctx: Ctx) -> tuple[bool, str]:
    got = script_result(ctx, FOREIGN_OPTIMIZER, ctx.dir / "run")
    foreign, mixed = got["foreign"], got["mixed"]

    def says(error: list[str] | None, text: str) -> bool:
        return bool(error) and error[0] == "ValueError" and text in error[1] and "\n" not in error[1]

    ok = (
        says(foreign, "none of the optimizer's 2 parameters are the model's")
        and says(mixed, "1 of the optimizer's 3 parameters are not the model's")
        and not got["out_exists"]
    )
    return ok, f"foreign: {error_text(foreign)}; mixed: {error_text(mixed)}; run dir made: {got['out_exists']}"


@probe(
    "10.2",
    "`nanoddp train --out OUT` where OUT/.lock is a planted symlink to another file",
    "exit 2, one line naming .lock as a symbolic link, no worker; the symlink's target untouched",
)
def planted_lock_symlink(ctx: Ctx) -> tuple[bool, str]:
    victim = ctx.dir / "victim.txt"
    victim.write_text("keep me\n")
    out = ctx.dir / "run"
    out.mkdir()
    os.symlink(victim, out / ".lock")
    dangling_target = ctx.dir / "created-by-following"
    dangling = ctx.dir / "dangling"
    dangling.mkdir()
    os.symlink(dangling_target, dangling / ".lock")
    ok, outcome = refusal(ctx.nanoddp("train", *flags(out=out)), r"\.lock is a symbolic link")
    second_ok, _ = refusal(ctx.nanoddp("train", *flags(out=dangling)), r"\.lock is a symbolic link")
    kept = victim.read_text() == "keep me\n" and (out / ".lock").is_symlink()
    created = dangling_target.exists()
    return ok and second_ok and kept and not created, (
        f"{outcome}; target untouched: {kept}; dangling link also refused: {second_ok}, followed: {created}"
    )


RETRY = (
    SETUP
    + """
runs = {}
for name in ("fresh", "mine"):
    out = os.path.join(sys.argv[1], name)
    if name == "mine":  # a dir the user made, with a file of theirs
        os.makedirs(out)
        open(os.path.join(out, "notes.txt"), "w").write("the user's")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = attempt(lambda: nanoddp.Trainer(model, opt, data(4), out=out, **OPTIONS))  # too few samples
    left = sorted(os.listdir(out)) if os.path.isdir(out) else None
    retry = attempt(lambda: nanoddp.Trainer(model, opt, data(32), out=out, **OPTIONS).fit())
    notes = open(os.path.join(out, "notes.txt")).read() if name == "mine" else None
    model_pt = os.path.exists(os.path.join(out, "model.pt"))
    runs[name] = {"first": first, "left": left, "retry": retry, "model": model_pt, "notes": notes}
print(json.dumps(runs))
"""
)


@probe(
    "10.3",
    "`Trainer(...)` raises after taking its run dir (4 samples, batch 8); a corrected Trainer, same process, same out",
    "the retry trains (lock released, not refused naming its own pid); the empty run dir it made was removed, "
    "a user's existing dir kept with its files (its .lock, a lock file kept by design, aside)",
)
def retry_after_failed_construction(ctx: Ctx) -> tuple[bool, str]:
    runs = script_result(ctx, RETRY, ctx.dir)
    fresh, mine = runs["fresh"], runs["mine"]
    ok = (
        fresh["first"] is not None
        and fresh["left"] is None
        and fresh["retry"] is None
        and fresh["model"]
        and mine["first"] is not None
        and [name for name in mine["left"] or [] if name != ".lock"] == ["notes.txt"]
        and mine["notes"] == "the user's"
        and mine["retry"] is None
        and mine["model"]
    )
    return ok, (
        f"first: {error_text(fresh['first'])}; new dir after it: {fresh['left'] if fresh['left'] else 'removed'}; "
        f"retry: {error_text(fresh['retry']) if fresh['retry'] else 'trained'}, model.pt: {fresh['model']}; "
        f"user's dir after the failure: {mine['left']}, retry: "
        f"{error_text(mine['retry']) if mine['retry'] else 'trained'}, model.pt: {mine['model']}"
    )
