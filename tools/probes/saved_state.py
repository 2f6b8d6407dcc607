"""Probes 8.x, saved state loads back: `nanoddp.save_state` writes only what
`torch.load(weights_only=True)` reads back (numpy converted, the rest refused before a byte is
written), a file that verifies but does not load is skipped for an older one, by `load_state`
and by `nanoddp train --resume auto` alike, and a longer `--steps` on resume is said, not silent.

Saving and loading run in separate processes, as a crash and a rerun would: nothing of the
saving process's memory can make the load look right.
"""

from __future__ import annotations

import json
import re

from .context import PYTHON, TRAIN_TIMEOUT_S, Ctx, ProbeError, flags, python_snippet, short, snap
from .registry import probe

SAVE_NUMPY = """
import sys
import numpy as np
import nanoddp
array = np.arange(6, dtype=np.float32).reshape(2, 3)
nanoddp.save_state(sys.argv[1], step=1, loss=np.float64(0.25), arr=array)
"""

LOAD_TYPES = """
import json, sys
import torch
import nanoddp
state = nanoddp.load_state(sys.argv[1])
arr = state["arr"]
print(json.dumps({
    "step": [type(state["step"]).__name__, state["step"]],
    "loss": [type(state["loss"]).__name__, state["loss"]],
    "arr": [type(arr).__module__ + "." + type(arr).__name__, arr.tolist() if torch.is_tensor(arr) else repr(arr)],
}))
"""


@probe(
    "8.1",
    "`save_state(dir, step=1, loss=np.float64(0.25), arr=<numpy 2x3 float32>)`, loaded in another process",
    "loads back: step an int, loss a float, arr a torch.Tensor with the same values",
)
def numpy_values_load_back(ctx: Ctx) -> tuple[bool, str]:
    state = ctx.dir / "state"
    python_snippet(ctx, SAVE_NUMPY, state)
    got = json.loads(python_snippet(ctx, LOAD_TYPES, state).strip().splitlines()[-1])
    ok = (
        got["step"] == ["int", 1]
        and got["loss"] == ["float", 0.25]
        and got["arr"] == ["torch.Tensor", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]
    )
    return ok, f"step {got['step']}, loss {got['loss']}, arr {got['arr']}"


SAVE_REFUSED = """
import dataclasses, datetime, json, sys
import nanoddp

@dataclasses.dataclass
class Meta:
    epoch: int

values = {"datetime": {"when": datetime.datetime(2024, 1, 2)}, "dataclass": {"runs": [1, Meta(epoch=2)]}}
try:
    nanoddp.save_state(sys.argv[1], step=1, meta=values[sys.argv[2]])
    print(json.dumps(None))
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""


def refused_before_writing(ctx: Ctx, kind: str, where: str, type_name: str) -> tuple[bool, str]:
    state = ctx.dir / "state"
    error = json.loads(python_snippet(ctx, SAVE_REFUSED, state, kind).strip().splitlines()[-1])
    written = sorted(str(p.relative_to(ctx.dir)) for p in state.rglob("*")) if state.exists() else []
    if error is None:
        return False, f"saved without a word; files: {written}"
    name, message = error
    one_line = "\n" not in message
    names_it = bool(re.search(rf"{re.escape(where)} is a .*{type_name}", message)) and "weights_only" in message
    ok = name == "TypeError" and one_line and names_it and not written
    return ok, f"{name}: `{short(message, 260)}`; one line: {one_line}; files written: {written or 'none'}"


@probe(
    "8.2",
    "`save_state(dir, step=1, meta={'when': datetime(...)})`",
    "TypeError, one line naming meta['when'] and datetime.datetime; nothing written",
)
def datetime_is_refused(ctx: Ctx) -> tuple[bool, str]:
    return refused_before_writing(ctx, "datetime", "meta['when']", "datetime.datetime")


@probe(
    "8.3",
    "`save_state(dir, step=1, meta={'runs': [1, <a dataclass>]})`",
    "TypeError, one line naming meta['runs'][1] and the class; nothing written",
)
def dataclass_is_refused(ctx: Ctx) -> tuple[bool, str]:
    return refused_before_writing(ctx, "dataclass", "meta['runs'][1]", "Meta")


# A file in nanoddp's checksummed framing whose payload torch.save'd a pickled custom class: it
# verifies, and weights_only refuses it (what an older writer, or a hand-made file, leaves).
PLANT_UNLOADABLE = """
import sys
from nanoddp.train.checkpoint import snapshot

class Custom:
    pass

state = snapshot.load(sys.argv[1]) if sys.argv[1] != "-" else {"format": sys.argv[3], "objects": {}}
state["planted"] = Custom()
snapshot.save(sys.argv[2], state)
"""

LOAD_NEWEST = """
import json, sys
import nanoddp
state = nanoddp.load_state(sys.argv[1])
print(json.dumps({"step": state["step"], "note": state["note"]} if state else None))
"""


@probe(
    "8.4",
    "`load_state(dir)` whose newest file verifies but holds a pickled custom class (torch.save)",
    "skips it with one warning line naming the file, loads the newest loadable one",
)
def load_state_skips_unloadable(ctx: Ctx) -> tuple[bool, str]:
    state = ctx.dir / "state"
    python_snippet(ctx, "import sys, nanoddp; nanoddp.save_state(sys.argv[1], step=1, note='good')", state)
    fmt = python_snippet(ctx, "from nanoddp.train.checkpoint import user_state; print(user_state.FORMAT)").strip()
    bad = state / "step-00000002.pt"
    python_snippet(ctx, PLANT_UNLOADABLE, "-", bad, fmt)
    run = ctx.run([PYTHON, "-c", LOAD_NEWEST, str(state)], TRAIN_TIMEOUT_S)
    if run.rc != 0:
        return False, f"load_state raised (exit {run.rc}): {short(run.err.strip().splitlines()[-1] if run.err else '')}"
    got = json.loads(run.out.strip().splitlines()[-1])
    lines = [line for line in run.err.splitlines() if line.strip()]
    naming = [line for line in lines if bad.name in line]
    ok = got == {"step": 1, "note": "good"} and len(lines) == 1 and len(naming) == 1 and "Traceback" not in run.err
    shown = " // ".join(short(line, 220) for line in lines[-3:])
    return ok, f"loaded {got}; {len(lines)} stderr line(s): `{shown}`"


@probe(
    "8.5",
    "`nanoddp train --resume auto` whose newest snapshot verifies (checksum) but fails weights_only loading",
    "exit 0; one line skipping it; resumes from the older valid snapshot and finishes",
)
def resume_auto_skips_unloadable(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out)
    python_snippet(ctx, PLANT_UNLOADABLE, snap(out, 3), snap(out, 3))
    run = ctx.nanoddp("train", *flags(out=out, resume="auto"), timeout=TRAIN_TIMEOUT_S)
    text = run.out + run.err
    skipped = [line for line in text.splitlines() if snap(out, 3).name in line and "resumed from" not in line]
    resumed = f"resumed from {snap(out, 2)}" in text
    traceback = "Traceback" in text
    ok = run.rc == 0 and len(skipped) == 1 and resumed and not traceback
    shown = " // ".join(short(line, 220) for line in skipped[:3]) or "no line names it"
    last = short(run.err.strip().splitlines()[-1], 220) if run.err.strip() else ""
    tail = "" if ok else f"; last line `{last}`"
    return ok, (
        f"exit {run.rc}; {len(skipped)} line(s) naming step-00000003.pt: `{shown}`; "
        f"resumed from step-00000002.pt: {resumed}; traceback: {traceback}{tail}"
    )


@probe(
    "8.6",
    "resume a finished 3-step run with `--steps 6 --resume auto`",
    "exit 0; one line: steps changed from 3 to 6, the schedule re-stretched; trains on to step 6",
)
def more_steps_on_resume(ctx: Ctx) -> tuple[bool, str]:
    out = ctx.dir / "run"
    ctx.trained(out)
    run = ctx.nanoddp("train", *flags(out=out, steps=6, resume="auto"), timeout=TRAIN_TIMEOUT_S)
    if run.timed_out:
        raise ProbeError(f"the resumed run did not end within {TRAIN_TIMEOUT_S} s")
    lines = [line for line in (run.out + run.err).splitlines() if "steps changed" in line]
    said = re.compile(r"steps changed from 3 to 6 on resume: the warmup-cosine schedule is re-stretched over 6 steps")
    finished = snap(out, 6).is_file()
    ok = run.rc == 0 and len(lines) == 1 and bool(said.search(lines[0])) and finished
    shown = " // ".join(short(line, 240) for line in lines[:3]) or "no `steps changed` line"
    return ok, f"exit {run.rc}; {len(lines)} line(s): `{shown}`; step 6 snapshot: {finished}"
