"""Probes 3.x, collectives: an invalid call on one rank fails the same way on every rank and
leaves the group usable; the notebook's stop button mid-collective (its own tests); the hang
watchdog of `nanoddp run` lets go of an async collective that completed without a wait().
"""

from __future__ import annotations

import json

from .context import PYTHON, REFUSAL_TIMEOUT_S, TRAIN_TIMEOUT_S, Ctx, short
from .jobs import Job
from .registry import probe
from .verdicts import pytest_row

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


@probe(
    "3.2",
    "notebook stop button (tests/multiproc/test_notebook_interrupt.py)",
    "pytest passes",
)
def notebook_interrupt_tests(ctx: Ctx) -> tuple[bool, str]:
    return pytest_row(ctx, "tests/multiproc/test_notebook_interrupt.py", "-x")


# torch's async all_reduce finished by polling is_completed(), never wait()ed on; then idle past
# the watchdog's timeout, then one more all_reduce: a watchdog still holding the first one would
# report a hang every rank arrived at, and kill the job with its hang exit code.
POLLED_ASYNC = """
import sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
value = torch.ones(10)
work = dist.all_reduce(value, async_op=True)
deadline = time.monotonic() + 60
while not work.is_completed():
    assert time.monotonic() < deadline, "all_reduce never completed"
    time.sleep(0.01)
time.sleep(float(sys.argv[2]) + 3)
after = torch.ones(1)
dist.all_reduce(after)
print(f"POLLED rank {dist.get_rank()} sum {value[0].item():g} next {after.item():g}", flush=True)
dist.destroy_process_group()
"""
COLLECTIVE_TIMEOUT_S = 3


@probe(
    "3.3",
    f"torch async all_reduce finished by polling is_completed(), `nanoddp run --collective-timeout "
    f"{COLLECTIVE_TIMEOUT_S}`, idle past the timeout",
    "exit 0 (not the watchdog's 86), no hang report, both ranks finish with the right sums",
)
def polled_async_collective(ctx: Ctx) -> tuple[bool, str]:
    job = Job(
        ctx,
        POLLED_ASYNC,
        "--collective-timeout",
        COLLECTIVE_TIMEOUT_S,
        script_args=(COLLECTIVE_TIMEOUT_S,),
    )
    job.run.wait(TRAIN_TIMEOUT_S)
    done = sorted(line.split("POLLED ", 1)[1] for line in job.run.out.splitlines() if "POLLED " in line)
    right = done == ["rank 0 sum 2 next 2", "rank 1 sum 2 next 2"]
    reports = [line for line in job.run.err.splitlines() if "nanoddp run:" in line or "hang" in line.lower()]
    ok = job.run.rc == 0 and right and not reports
    shown = " // ".join(short(line, 200) for line in reports[-2:])
    timed = f" (killed after {TRAIN_TIMEOUT_S} s)" if job.run.timed_out else ""
    return ok, f"exit {job.run.rc}{timed}; ranks done: {done or 'none'}" + (f"; `{shown}`" if shown else "")
