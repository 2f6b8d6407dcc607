"""Probes 12.x, what nanoddp writes survives another user and bad luck: a link planted at a save's
temporary name or at `metrics.jsonl` is never written through; two jobs saving sharded state to
one path never destroy each other's checkpoints; a NaN loss on one rank costs no good snapshot
and never reaches `model.pt`; a full disk names the file it could not write.
"""

from __future__ import annotations

import json
import shutil

from .context import PYTHON, TRAIN_TIMEOUT_S, Ctx, ProbeError, flags, python_snippet, short, snap
from .registry import probe
from .verdicts import refusal

VICTIM_TEXT = "the victim's own file\n"

# The other user guessed the pid: the old writer's temporary name was `.state.pt.tmp-<pid>`.
SAVE_THROUGH_PLANTED = """
import os, sys
from pathlib import Path
import torch, nanoddp
out, victim = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
(out / f".state.pt.tmp-{os.getpid()}").symlink_to(victim)
nanoddp.save_state(out / "state.pt", step=1, weights=torch.ones(3))
print(victim.read_text() == sys.argv[3], (out / "state.pt").is_symlink())
"""


def _victim(ctx: Ctx):
    victim = ctx.dir / "victim-home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return victim


@probe(
    "12.1",
    "another user plants `.state.pt.tmp-<pid>` -> the victim's `~/.bashrc`, then `save_state(DIR/state.pt)`",
    "the victim's file untouched; state.pt a regular file",
)
def planted_temp_link(ctx: Ctx) -> tuple[bool, str]:
    victim = _victim(ctx)
    untouched, is_link = python_snippet(ctx, SAVE_THROUGH_PLANTED, ctx.dir / "shared", victim, VICTIM_TEXT).split()
    return untouched == "True" and is_link == "False", f"victim untouched: {untouched}; state.pt a link: {is_link}"


@probe(
    "12.2",
    "`nanoddp train` whose OUT/metrics.jsonl is a planted link to the victim's file",
    "refused before any worker: exit 2, one line naming metrics.jsonl as a symbolic link; the victim's file untouched",
)
def planted_metrics_link(ctx: Ctx) -> tuple[bool, str]:
    victim, out = _victim(ctx), ctx.dir / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(victim)
    ok, outcome = refusal(ctx.nanoddp("train", *flags(out=out)), r"metrics\.jsonl is a symbolic link")
    untouched = victim.read_text() == VICTIM_TEXT
    return ok and untouched, f"{outcome}; victim untouched: {untouched}"


# One job of 2 ranks: 30 sharded (ZeRO-1) saves to one path, each recorded as saved or refused,
# and each saved one loaded back at once by the same job (the other job may replace it later).
SAVE_LOOP = """
import json, os, sys, time
import torch, nanoddp
SAVES = 30

def rank_main(env, path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    opt = nanoddp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)
    ready = os.path.join(os.path.dirname(path), "ready")  # both jobs start saving together
    if env.rank == 0:
        os.makedirs(ready, exist_ok=True)
        open(os.path.join(ready, str(os.getpid())), "w").close()
    while len(os.listdir(ready) if os.path.isdir(ready) else []) < 2:
        time.sleep(0.05)
    outcomes = []
    for i in range(SAVES):
        net(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        try:
            nanoddp.save_state(path, model=net, optimizer=opt, step=i)
            outcomes.append("saved")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    return outcomes

if __name__ == "__main__":
    got = nanoddp.launch(rank_main, 2, args=(sys.argv[1],), backend="gloo", timeout=240)
    print(json.dumps(got[0]))
"""

LOAD_BACK = """
import sys, torch, nanoddp
net = torch.nn.Linear(64, 64)
state = nanoddp.load_state(sys.argv[1], model=net)
print(int(state["step"]))
"""


@probe(
    "12.3",
    "two 2-rank jobs save sharded (ZeRO-1) state to one path 30 times each, at once",
    "each save succeeds or is refused (SaveInProgress) on every rank; the file loads at the end",
)
def concurrent_sharded_saves(ctx: Ctx) -> tuple[bool, str]:
    script = ctx.dir / "save_loop.py"
    script.write_text(SAVE_LOOP)
    target = ctx.dir / "shared" / "state.pt"
    jobs = [ctx.start([PYTHON, str(script), str(target)]) for _ in range(2)]
    for job in jobs:
        job.wait(TRAIN_TIMEOUT_S)
    if any(job.rc != 0 for job in jobs):
        bad = next(job for job in jobs if job.rc != 0)
        return False, f"a job failed (exit {bad.rc}): {short(bad.err[-400:])}"
    outcomes = [json.loads(job.out.strip().splitlines()[-1]) for job in jobs]
    kinds = {o for job in outcomes for o in job}
    step = int(python_snippet(ctx, LOAD_BACK, target).strip().splitlines()[-1])
    counts = ", ".join(f"{o.count('saved')} saved, {len(o) - o.count('saved')} refused" for o in outcomes)
    return kinds <= {"saved", "SaveInProgress"}, f"{counts}; state.pt loads (step {step}); outcomes {sorted(kinds)}"


# `nanoddp run` a Trainer whose loss is NaN on rank 1 from step 3 of 8, snapshots every 2, keep 3.
NAN_SCRIPT = """
import sys
import torch, torch.nn.functional as F
import nanoddp
env = nanoddp.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
x = torch.randn(128, 6, generator=torch.Generator().manual_seed(0))
calls = [0]
def loss_fn(logits, target):
    calls[0] += 1
    loss = F.cross_entropy(logits, target)
    return loss * float("nan") if env.rank == 1 and calls[0] >= 3 else loss
trainer = nanoddp.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
    torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()), loss_fn=loss_fn, out=sys.argv[1],
    steps=8, batch_size=8, snapshot_every=2, keep_snapshots=3, progress=False, on_nan=sys.argv[2])
trainer.fit()
"""

FINITE = """
import sys, torch
from nanoddp.train.checkpoint import snapshot
paths = sys.argv[1:]
states = [snapshot.load(p)["objects"]["model"]["state"] if "step-" in p else torch.load(p) for p in paths]
print(all(all(v.isfinite().all() for v in s.values()) for s in states))
"""


def _nan_run(ctx: Ctx, on_nan: str):
    script, out = ctx.dir / "nan_loss.py", ctx.dir / f"run-{on_nan}"
    script.write_text(NAN_SCRIPT)
    run = ctx.nanoddp("run", "--nproc", 2, script, out, on_nan, timeout=TRAIN_TIMEOUT_S)
    steps = sorted(int(p.stem.split("-")[1]) for p in (out / "snapshots").glob("step-*.pt") if ".shards" not in p.name)
    return run, out, steps


@probe(
    "12.4",
    "a Trainer under `nanoddp run`, loss NaN on rank 1 from step 3 of 8, snapshots every 2, keep 3 (--on-nan stop)",
    "exit non-zero, one line naming step 3 and rank 1; snapshot 2 kept and finite; no model.pt",
)
def nan_stops(ctx: Ctx) -> tuple[bool, str]:
    run, out, steps = _nan_run(ctx, "stop")
    named = "step 3: the loss is NaN or inf on rank(s) 1" in run.err
    finite = steps == [2] and python_snippet(ctx, FINITE, snap(out, 2)).strip() == "True"
    ok = run.rc not in (0, None) and named and finite and not (out / "model.pt").exists()
    return (
        ok,
        f"exit {run.rc}, snapshots {steps}, finite {finite}, model.pt {(out / 'model.pt').exists()}: named {named}",
    )


@probe(
    "12.5",
    "the same with `on_nan='skip'`",
    "exit 0; snapshots 4, 6, 8 and the newest finite one (2) kept; every snapshot and model.pt finite",
)
def nan_skips(ctx: Ctx) -> tuple[bool, str]:
    run, out, steps = _nan_run(ctx, "skip")
    if run.rc != 0:
        return False, f"exit {run.rc}: {short(run.err[-400:])}"
    finite = python_snippet(ctx, FINITE, *(snap(out, s) for s in steps), out / "model.pt").strip() == "True"
    return steps == [2, 4, 6, 8] and finite, f"exit 0, snapshots {steps}, all finite (model.pt too): {finite}"


FULL_DISK = """
import sys, torch
from nanoddp.train.checkpoint import snapshot
try:
    snapshot.save(sys.argv[1], {"w": torch.zeros(1 << 20)})
except OSError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


@probe(
    "12.6",
    "a 4 MB snapshot written to a 256 kB filesystem (a private tmpfs)",
    "OSError naming the snapshot's own path (not a temp name) and 'No space left'",
)
def full_disk(ctx: Ctx) -> tuple[bool | None, str]:
    if shutil.which("unshare") is None:
        return None, "unshare is not available: no private tmpfs to fill"
    mount, script = ctx.dir / "mnt", ctx.dir / "full.py"
    mount.mkdir()
    script.write_text(FULL_DISK)
    command = f"mount -t tmpfs -o size=256k tmpfs {mount} && {PYTHON} {script} {mount}/ckpt/step-00000001.pt"
    run = ctx.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", command], 120)
    if run.rc != 0:
        raise ProbeError(f"could not mount a private tmpfs (exit {run.rc}): {short(run.err)}")
    line = run.out.strip()
    return f"{mount}/ckpt/step-00000001.pt: No space left" in line, f"`{short(line)}`"
