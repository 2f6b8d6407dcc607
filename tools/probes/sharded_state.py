"""Probes 9.x, sharded state: a ZeRO-2 model saved with `nanoddp.save_state` by one 2-rank
`nanoddp run` job and loaded by another gives each rank its own piece back, and a damaged rank
shard file is the same one-line error on both ranks, never a hang.

The two ranks' pieces have the same shape and unmistakable values (rank r holds 100 r + 0..7),
so a load that hands rank 0's piece to rank 1 (a half-swap) cannot pass for a correct one.
"""

from __future__ import annotations

import json

from .context import TRAIN_TIMEOUT_S, Ctx, ProbeError, short
from .jobs import Job
from .registry import probe

# argv: PIDDIR PATH MODE. "save": set this rank's piece to 100 * rank + 0..7, save. "load": load
# into a model freshly built (other values), report this rank's piece or the error it raised.
ZERO2_STATE = """
import json, sys
import torch
import torch.distributed as dist
import torch.nn as nn
import nanoddp
from nanoddp.parallel.zero.stage2 import zero2
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = zero2(nn.Linear(4, 4, bias=False))  # 16 elements: 8 per rank, the same shape on both
path, mode = sys.argv[2], sys.argv[3]
if mode == "save":
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0) + 100 * rank)
    nanoddp.save_state(path, model=model, step=1)
    result = {"piece": model.weight.detach().tolist()}
else:
    try:
        state = nanoddp.load_state(path, model=model)
        result = {"piece": model.weight.detach().tolist(), "step": state["step"]}
    except Exception as exc:
        result = {"error": [type(exc).__name__, str(exc)]}
print("STATE " + json.dumps({"rank": rank, **result}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""
HANG_TIMEOUT_S = 30  # a rank left in a collective is reported (and the job ended) by the watchdog


def zero2_job(ctx: Ctx, mode: str, name: str) -> tuple[Job, dict[int, dict]]:
    path = ctx.dir / "zero2.pt"
    job = Job(ctx, ZERO2_STATE, "--collective-timeout", HANG_TIMEOUT_S, script_args=(path, mode), name=name)
    job.run.wait(TRAIN_TIMEOUT_S)
    reports = {}
    for line in job.run.out.splitlines():
        if "STATE " in line:
            report = json.loads(line.split("STATE ", 1)[1])
            reports[report["rank"]] = report
    return job, reports


def own_piece(rank: int) -> list[float]:
    return [float(100 * rank + i) for i in range(8)]


def saved(ctx: Ctx) -> None:
    job, reports = zero2_job(ctx, "save", "save")
    if job.run.rc != 0 or sorted(reports) != [0, 1]:
        raise ProbeError(f"the saving job failed (exit {job.run.rc}): {job.tail()}")


@probe(
    "9.1",
    "ZeRO-2 model (`zero2(nn.Linear(4, 4))`, same-shaped pieces) saved by one 2-rank `nanoddp run` job, "
    "loaded by another",
    "exit 0; each rank gets its own piece back (rank 1 holds 100..107, not rank 0's 0..7)",
)
def zero2_round_trip(ctx: Ctx) -> tuple[bool, str]:
    saved(ctx)
    job, reports = zero2_job(ctx, "load", "load")
    got = {rank: report.get("piece", report.get("error")) for rank, report in sorted(reports.items())}
    ok = job.run.rc == 0 and got == {0: own_piece(0), 1: own_piece(1)}
    shown = "; ".join(f"rank {rank}: {short(str(value), 120)}" for rank, value in got.items()) or "no rank reported"
    swapped = " [HALF-SWAP]" if got.get(1) == own_piece(0) else ""
    return ok, f"exit {job.run.rc}; {shown}{swapped}"


@probe(
    "9.2",
    "the same checkpoint with one byte of rank 1's shard file flipped, loaded at 2 ranks",
    "the same one-line error on both ranks, naming rank1-of-2; no hang (job ends, exit 0 here: the script catches)",
)
def damaged_shard_file(ctx: Ctx) -> tuple[bool, str]:
    saved(ctx)
    shards = sorted(ctx.dir.glob("zero2.pt.*rank1-of-2*"))
    if len(shards) != 1:
        raise ProbeError(f"expected one rank-1 shard file, found {[p.name for p in ctx.dir.iterdir()]}")
    raw = bytearray(shards[0].read_bytes())
    raw[-3] ^= 0xFF
    shards[0].write_bytes(bytes(raw))
    job, reports = zero2_job(ctx, "load", "load")
    errors = [reports.get(rank, {}).get("error") for rank in (0, 1)]
    messages = [e[1] if e else None for e in errors]
    same = errors[0] is not None and errors[0] == errors[1]
    one_line = same and "\n" not in messages[0]
    names = same and "rank1-of-2" in messages[0]
    hang = job.run.timed_out or "hang" in job.run.err.lower()
    ok = job.run.rc == 0 and same and one_line and names and not hang
    if same:
        shown = f"both ranks: {errors[0][0]}: `{short(messages[0], 240)}`"
    else:
        shown = "; ".join(f"rank {r}: {short(str(reports.get(r, 'no report')), 160)}" for r in (0, 1))
    return ok, f"exit {job.run.rc}, {job.run.seconds:.0f} s; {shown}; hang: {hang}"
