"""`nanoddp.notebook_launch`: a function defined where spawn cannot import it (`python -c`, a
Jupyter cell) runs on 2 gloo ranks, its results match the single-process value, and a failing
rank surfaces as `LaunchError` exactly as with `launch`.

The functions under test must live in a `__main__` that spawned children cannot import, so they
are defined in a `python -c` subprocess or in a real kernel's cell, never in this module (which
the children *can* import, and cloudpickle would then send by reference).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import nbformat
import pytest
import torch
from helpers import ROOT, cell_error, cell_text, execute_notebook

import nanoddp

SCRIPT_TIMEOUT_S = 180  # torch imports in 3 processes on shared cores: seconds, rarely a minute

ALL_REDUCE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    import torch.distributed as dist
    import nanoddp
    from nanoddp.base.files import atomic_write_bytes

    @dataclasses.dataclass
    class Shard:  # a class of __main__: travels by value, and comes back as this very class
        rank: int
        summed: list

    SCALE = 0.5  # a __main__ global the function reads

    def all_reduce_rows(env, rows):
        torch.set_num_threads(1)
        x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * (env.rank + 1) * SCALE  # (rows, 3)
        dist.all_reduce(x)
        return Shard(env.rank, x.tolist())

    try:
        nanoddp.launch(all_reduce_rows, 2, args=(2,), backend="gloo", timeout=120)
        by_reference = "no error"
    except nanoddp.LaunchError as err:
        by_reference = str(err)
    results = nanoddp.notebook_launch(all_reduce_rows, 2, args=(2,), backend="gloo", timeout=120)
    report = {
        "by_reference": by_reference,
        "ranks": [r.rank for r in results],
        "same_class": all(type(r) is Shard for r in results),
        "summed": [r.summed for r in results],
    }
    atomic_write_bytes(sys.argv[1], json.dumps(report).encode())
    """
)

# Run after ALL_REDUCE_SCRIPT in the same `python -c` (one interpreter start for both claims).
FAILING_SCRIPT = textwrap.dedent(
    """
    import multiprocessing

    def uneven(env):
        torch.set_num_threads(1)
        if env.rank == 1:
            raise ValueError(f"rank {env.rank} has an empty shard")
        dist.barrier()  # rank 0 waits here for a peer that is gone: launch must stop it

    try:
        nanoddp.notebook_launch(uneven, 2, backend="gloo", timeout=120)
    except nanoddp.LaunchError as err:
        print("failed rank:", err.rank)
        print("details:", err.details)
    print("children left:", len(multiprocessing.active_children()))
    """
)


@pytest.fixture(scope="module")
def python_c_run(tmp_path_factory) -> tuple[dict, str]:
    """`python -c` of the all-reduce script then the failing one: (the all-reduce report, stdout).
    A timeout kills it, and its ranks die with it (PDEATHSIG)."""
    out = tmp_path_factory.mktemp("python_c") / "report.json"
    code = ALL_REDUCE_SCRIPT + FAILING_SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_function_from_python_c_runs_on_two_ranks(python_c_run):
    report, _ = python_c_run
    # The problem notebook_launch solves: spawn cannot import __main__.all_reduce_rows.
    assert "exited with code 1" in report["by_reference"], report["by_reference"]
    assert report["ranks"] == [0, 1] and report["same_class"]
    # Single-process reference: the sum over ranks of what each contributed. Small integers
    # times 0.5, summed in pairs, are exact in float32, so the comparison is bitwise.
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # (rows, 3)
    expected = sum(rows * (rank + 1) * 0.5 for rank in range(2))
    for summed in report["summed"]:
        torch.testing.assert_close(torch.tensor(summed), expected, rtol=0, atol=0)


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_failing_rank_from_python_c_is_a_launch_error(python_c_run):
    _, out = python_c_run
    assert "failed rank: 1" in out, out
    assert "ValueError: rank 1 has an empty shard" in out, out
    assert 'File "<string>"' in out and "in uneven" in out, out  # the traceback of the user's function
    assert "children left: 0" in out, out


def test_unpicklable_capture_is_a_clear_value_error():
    lock = threading.Lock()  # cannot be pickled: a child could not get a copy of it

    def uses_lock(env):
        with lock:
            return env.rank

    with pytest.raises(ValueError, match=r"notebook_launch cannot serialise fn=.*uses_lock.*create locks"):
        nanoddp.notebook_launch(uses_lock, 2, backend="gloo", timeout=10)


# ----------------------------------------------------------------------------- a real kernel
KERNEL_CELLS = [
    (
        "define",
        """
        import multiprocessing
        import torch
        import torch.distributed as dist
        import nanoddp

        def contribution(env, n):  # used by the function below, defined in another cell
            return torch.full((n,), float(env.rank + 1))  # (n,)
        """,
        False,
    ),
    (
        "run",
        """
        def all_reduce_cell(env, n):
            torch.set_num_threads(1)
            x = contribution(env, n)  # (n,)
            dist.all_reduce(x)
            return x.tolist()

        print("results:", nanoddp.notebook_launch(all_reduce_cell, 2, args=(3,), backend="gloo", timeout=120))
        """,
        False,
    ),
    (
        "fail",
        """
        def broken(env):
            torch.set_num_threads(1)
            if env.rank == 1:
                raise RuntimeError("rank one gives up")  # the line the traceback must show
            dist.barrier()

        nanoddp.notebook_launch(broken, 2, backend="gloo", timeout=120)
        """,
        True,
    ),
    ("left", 'print("children left:", len(multiprocessing.active_children()))', False),
]


@pytest.mark.timeout(300)
def test_function_from_a_jupyter_cell(tmp_path):
    cells = {}
    nb = nbformat.v4.new_notebook()
    for name, source, raises in KERNEL_CELLS:
        cell = nbformat.v4.new_code_cell(textwrap.dedent(source).strip())
        if raises:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
        cells[name] = cell
    execute_notebook(nb, tmp_path, ROOT, timeout=150)  # per cell: a hang fails, not stalls
    assert "results: [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]" in cell_text(cells["run"])  # 1 + 2 on every element
    error = cell_error(cells["fail"])
    assert error is not None and error.ename == "LaunchError", cell_text(cells["fail"])
    assert "rank 1 failed: RuntimeError: rank one gives up" in error.evalue
    # The cell's own source line, shipped to the children with the function.
    assert 'raise RuntimeError("rank one gives up")  # the line the traceback must show' in error.evalue
    assert "children left: 0" in cell_text(cells["left"])
