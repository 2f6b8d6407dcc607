"""Probes 3.x, collectives: an invalid call on one rank fails the same way on every rank and
leaves the group usable; the notebook's stop button mid-collective (its own tests).
"""

from __future__ import annotations

import json

from .context import PYTHON, REFUSAL_TIMEOUT_S, Ctx, short
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
