"""Notebook mode, tested through a real Jupyter kernel (ipykernel) and real worker processes.

Each kernel and each worker pool costs seconds to start, so one notebook carries most checks.
The kernel runs this interpreter (`sys.executable`) through a kernelspec written to tmp_path,
and IPython's profile lives in tmp_path too: nothing in the user's home is read or written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import nbformat
import psutil
import pytest
from helpers import (
    ROOT,
    WIDEN_ABORT_WINDOW,
    WORLD_SIZE,
    cell_error,
    cell_text,
    execute_notebook,
    finish_cell_until_idle,
    kernel_kwargs,
    run_cell,
)
from jupyter_client import KernelManager

from nanoddp.notebook import check_devices, parse_ranks, placement
from nanoddp.notebook.worker import NO_VALUE, run_source

EXAMPLE = ROOT / "examples" / "notebook_ddp.ipynb"


def _stream(cell, name: str) -> str:
    return "".join(out.text for out in cell.outputs if out.output_type == "stream" and out.name == name)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----------------------------------------------------------------------------- pure helpers
def test_run_source_matches_ipython_semantics():
    ns: dict = {}
    assert run_source("a = 2\na * 21", ns, "<t1>") == 42
    assert run_source("b = 1", ns, "<t2>") is NO_VALUE
    assert run_source("a + 1;", ns, "<t3>") is NO_VALUE  # trailing ';' hides the value
    assert run_source("def f(x):\n    return x + a\nf(1)", ns, "<t4>") == 3
    with pytest.raises(ZeroDivisionError):
        run_source("x = 1\n1 / 0", ns, "<t5>")


def test_parse_ranks():
    assert parse_ranks("[0,2]", 3) == [0, 2]
    assert parse_ranks(" 1 ", 3) == [1]
    assert parse_ranks("2, 0 ,2", 3) == [0, 2]
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=r"outside the pool's ranks 0..1"):
        parse_ranks("[0,2]", 2)
    with pytest.raises(UsageError, match="integers"):
        parse_ranks("[a]", 2)
    with pytest.raises(UsageError, match="needs ranks"):
        parse_ranks("[]", 2)


def test_placement_of_ranks_on_devices():
    from IPython.core.error import UsageError

    assert placement(2, "1,2", None) == ("nccl", ["cuda:1", "cuda:2"])  # the notebook tutorials' --gpu-ids 1,2
    assert placement(2, "0,1", "gloo") == ("gloo", ["cuda:0", "cuda:1"])
    assert placement(3, None, "gloo") == ("gloo", ["cpu", "cpu", "cpu"])
    with pytest.raises(UsageError, match="lists 1 GPUs for 2 processes"):
        placement(2, "0", None)
    with pytest.raises(UsageError, match="must be integers"):
        placement(2, "0,x", None)
    check_devices(["cpu", "cpu"], gpu_count=0)
    check_devices(["cuda:0", "cuda:1"], gpu_count=2)
    with pytest.raises(UsageError, match=r"GPUs \[1, 2\] do not exist: this machine has 1"):
        check_devices(["cuda:1", "cuda:2"], gpu_count=1)


# ----------------------------------------------------------------------------- magics in a notebook
MAGICS_CELLS = [
    ("load", "%load_ext nanoddp.notebook", False),
    ("init", f"%dist_init --num-processes {WORLD_SIZE}", False),
    (
        "hello",
        '%%distributed\nimport sys\nprint(f"hello from {rank} of {world_size}")\n'
        'print(f"to stderr from {rank}", file=sys.stderr)\n'
        'get("ws"), get("rank"), get("grank"), get("lrank"), get("pg") is dist.group.WORLD, local_rank, env.rank',
        False,
    ),
    (
        "allreduce",
        "%%distributed\nt = torch.tensor([float(rank + 1)])\ndist.all_reduce(t)\nprint('sum', t.item())",
        False,
    ),
    ("subset", "%%rank [1]\nmarker = 'set on one'\nprint('only', rank)", False),
    ("subset_check", "%%distributed\nprint('has marker', 'marker' in dir())", False),
    ("warn", "%%rank 0\nif False:\n    dist.all_reduce(t)\nprint('no hang')", False),
    (
        "error",
        # rank 0 would loop forever: rank 1's failure must stop it (as if in a collective with rank 1)
        "%%distributed\nprint('before', rank, flush=True)\nif rank == 1:\n    raise ValueError('boom on one')\n"
        "while True:\n    pass",
        True,
    ),
    ("usable", "%%distributed\nrank * 10", False),
    (
        "html",
        "%%distributed\nclass Badge:\n    def _repr_html_(self):\n        return f'<b>rank {rank}</b>'\nBadge()",
        False,
    ),
    ("figure", "%%distributed\nimport matplotlib.pyplot as plt\nplt.plot([0, rank + 1]);", False),
    ("timeout", "%%distributed --timeout 1\nimport time\ntime.sleep(120)", True),
    ("after_timeout", "%%distributed\nprint('alive', rank)", False),
    ("mode_on", "%dist_mode", False),
    ("auto", "print('auto', rank)", False),
    ("mode_off", "%dist_mode", False),
    ("local", "print('local', 'rank' in dir())", False),
    ("sync", "%sync", False),
    (
        "pids1",
        "import os, stat\nfrom nanoddp.notebook import current_pool\nfirst = current_pool().pids()\n"
        "print('pids', first)\nprivate = current_pool()._dir\n"
        "print('mode', oct(stat.S_IMODE(os.stat(private).st_mode)), 'files', sorted(os.listdir(private)))",
        False,
    ),
    ("crash", "%%rank [1]\nimport os\nos._exit(3)", True),
    ("status", "%dist_status", False),
    ("restart", f"%dist_init --num-processes {WORLD_SIZE} --backend gloo", False),
    (
        "after_restart",
        "%%distributed\nt = torch.ones(1) * rank\ndist.all_reduce(t)\nprint('restarted', t.item())",
        False,
    ),
    ("pids2", "everyone = first + current_pool().pids()\nprint('pids', current_pool().pids())", False),
    ("shutdown", "%dist_shutdown", False),
    (
        "gone",
        "import psutil\nprint('alive after shutdown:', [p for p in everyone if psutil.pid_exists(p)])",
        False,
    ),
]


def test_magics_in_a_real_kernel(tmp_path):
    nb = nbformat.v4.new_notebook()
    for _, source, may_fail in MAGICS_CELLS:
        cell = nbformat.v4.new_code_cell(source)
        if may_fail:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    execute_notebook(nb, tmp_path, tmp_path)
    cells = {name: cell for (name, _, _), cell in zip(MAGICS_CELLS, nb.cells, strict=True)}
    for name, _, may_fail in MAGICS_CELLS:
        assert may_fail or cell_error(cells[name]) is None, f"cell {name!r} failed:\n{cell_text(cells[name])}"

    for rank in range(WORLD_SIZE):  # the status table: rank, pid, device, state, memory
        assert re.search(rf"^{rank}\s+\d+\s+cpu\s+idle\s+\d+ MiB$", cell_text(cells["init"]), re.M)
    for name in ("init", "restart"):  # startup says what it did and nothing of its own socket's wake-up
        assert "Broken pipe" not in cell_text(cells[name]) and "ignored a connection" not in cell_text(cells[name])
    hello_out, hello_err = _stream(cells["hello"], "stdout"), _stream(cells["hello"], "stderr")
    for rank in range(WORLD_SIZE):
        assert f"[rank {rank}] hello from {rank} of {WORLD_SIZE}\n" in hello_out
        assert f"[rank {rank}] to stderr from {rank}\n" in hello_err  # stderr stays stderr
        # get(...) as in the notebook tutorials, and the namespace names; the last expression's value per rank
        assert f"[rank {rank}] ({WORLD_SIZE}, {rank}, {rank}, {rank}, True, {rank}, {rank})\n" in hello_out
    assert "to stderr" not in hello_out
    expected_sum = float(sum(range(1, WORLD_SIZE + 1)))
    for rank in range(WORLD_SIZE):
        assert f"[rank {rank}] sum {expected_sum}" in cell_text(cells["allreduce"])
    assert cell_text(cells["subset"]) == "[rank 1] only 1\n"
    assert "[rank 0] has marker False" in cell_text(cells["subset_check"])
    assert "[rank 1] has marker True" in cell_text(cells["subset_check"])
    assert "Warning: this cell seems to call a collective" in cell_text(cells["warn"])
    assert "[rank 0] no hang" in cell_text(cells["warn"])

    error = cell_error(cells["error"])
    assert error.ename == "DistributedCellError" and "rank 1: ValueError: boom on one" in error.evalue
    assert "stopped ranks [0]" in error.evalue
    tb = "\n".join(error.traceback)
    assert "[rank 1] ValueError: boom on one" in tb and "raise ValueError('boom on one')" in tb
    assert "rank 0 -----" not in tb  # rank 0 did not fail
    assert "[rank 0] before 0" in cell_text(cells["error"])
    assert "[rank 0] 0\n" in cell_text(cells["usable"]) and "[rank 1] 10\n" in cell_text(cells["usable"])

    html = [o for o in cells["html"].outputs if o.output_type == "display_data"]
    assert [o.data["text/html"] for o in html] == ["<b>rank 0</b>"]  # rich output from rank 0 only
    assert "[rank 1] <__main__.Badge" in cell_text(cells["html"])  # text only from other ranks
    pngs = [o for o in cells["figure"].outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1

    assert "timed out after 1.0s" in cell_error(cells["timeout"]).evalue
    assert "[rank 0] alive 0" in cell_text(cells["after_timeout"])
    assert "[rank 1] alive 1" in cell_text(cells["after_timeout"])
    assert "[rank 0] auto 0" in cell_text(cells["auto"]) and "[rank 1] auto 1" in cell_text(cells["auto"])
    assert cell_text(cells["local"]) == "local False\n"
    assert "All 2 ranks reached the barrier" in cell_text(cells["sync"])

    crash = cell_error(cells["crash"])
    assert "rank 1" in crash.evalue and "exited with code 3" in "\n".join(crash.traceback)
    assert re.search(r"^1\s+\d+\s+cpu\s+dead \(exited with code 3\)", cell_text(cells["status"]), re.M)
    assert "Stopping the previous workers" in cell_text(cells["restart"])
    assert "[rank 1] restarted 1.0" in cell_text(cells["after_restart"])  # sum of ranks 0 + 1
    assert "alive after shutdown: []" in cell_text(cells["gone"])
    # The transport: a private (0700) directory, and the socket is gone once every worker is in.
    assert "mode 0o700 files ['store']" in cell_text(cells["pids1"])
    first = json.loads(re.search(r"pids (\[.*\])", cell_text(cells["pids1"])).group(1))
    second = json.loads(re.search(r"pids (\[.*\])", cell_text(cells["pids2"])).group(1))
    assert len(set(first + second)) == 2 * WORLD_SIZE and not any(_alive(p) for p in first + second)


def test_interrupt_then_kernel_death(tmp_path):
    km = KernelManager(**kernel_kwargs(tmp_path))
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    pids: list[int] = []
    try:
        kc.wait_for_ready(timeout=120)
        reply, text = run_cell(kc, f"%load_ext nanoddp.notebook\n%dist_init --num-processes {WORLD_SIZE}")
        assert reply["status"] == "ok", text
        # the next cell follows the interrupted one's end at once, and deterministically so
        assert run_cell(kc, WIDEN_ABORT_WINDOW)[0]["status"] == "ok"
        loop = "%%distributed\ni = 0\nprint('looping', flush=True)\nwhile True:\n    i += 1"
        both_looping = lambda t: all(f"[rank {r}] looping" in t for r in range(WORLD_SIZE))  # noqa: E731
        msg_id, _ = run_cell(kc, loop, until=both_looping)
        km.interrupt_kernel()
        reply = finish_cell_until_idle(kc, msg_id)
        assert reply["status"] == "error" and reply["ename"] == "CellInterrupted", reply
        reply, text = run_cell(kc, "%%distributed\nprint('after', i > 0)\nimport os\nos.getpid()")
        assert reply["status"] == "ok", text
        for rank in range(WORLD_SIZE):
            assert f"[rank {rank}] after True" in text
        pids = [int(p) for p in re.findall(r"\[rank \d\] (\d+)\n", text)]
        assert len(pids) == WORLD_SIZE and all(_alive(p) for p in pids)
        # The kernel dies while a cell runs: a worker in a cell reads no channel, so only its tie
        # to the kernel (not the connection's end) can stop it before the cell would end.
        sleeping = "%%distributed\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)"
        run_cell(kc, sleeping, until=lambda t: all(f"[rank {r}] sleeping" in t for r in range(WORLD_SIZE)))
    finally:
        kc.stop_channels()
        # SIGKILL: no atexit, no shutdown message; the workers must notice on their own.
        os.kill(km.provisioner.pid, signal.SIGKILL)
        km.shutdown_kernel(now=True)  # reaps the kernel, removes the connection file
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "workers outlived their kernel"


# ----------------------------------------------------------------------------- the example notebook
def test_example_notebook_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(EXAMPLE, as_version=4)
    execute_notebook(nb, tmp_path, ROOT, timeout=120)  # per cell: a hang fails, not stalls
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    failed = [cell for cell in code if cell_error(cell) is not None]
    assert [cell.metadata.get("tags") for cell in failed] == [["raises-exception"]]  # only the seed demo
    assert "replicas differ" in cell_error(failed[0]).evalue and "on ranks [1]" in cell_error(failed[0]).evalue
    text = "".join(cell_text(cell) for cell in code)
    for claim in (
        "[rank 0] replicas identical",
        "[rank 1] replicas still identical after training",
        "[rank 0] SimpleDDP on 2 ranks == 1 process on the global batch",
        "[rank 1] nanoddp.DistributedDataParallel == torch DistributedDataParallel == SimpleDDP",
        "ours == torch's == SimpleDDP, replicas identical",
        "[rank 0] speed-up",
        "Stopped 2 workers",
        "notebook_launch: 2 ranks == 1 process on the global batch",
    ):
        assert claim in text, f"{claim!r} missing from the notebook's output"


# ----------------------------------------------------------------------------- the SmolLM2 notebook
SMOLLM2_EXAMPLE = ROOT / "examples" / "notebook_smollm2.ipynb"


@pytest.mark.slow
@pytest.mark.timeout(900)  # minutes: a real fine-tune in two workers (longer the first time: conversion)
def test_smollm2_notebook_fine_tunes_from_distributed_cells(tmp_path):
    from nanoddp.models import smollm2_missing

    if smollm2_missing():
        pytest.skip(smollm2_missing())
    nb = nbformat.read(SMOLLM2_EXAMPLE, as_version=4)
    execute_notebook(nb, tmp_path, ROOT, timeout=400)  # per cell; the load and the steps take longest
    text = "".join(cell_text(cell) for cell in nb.cells if cell.cell_type == "code")
    before = float(re.search(r"\[rank 0\] eval loss before: (\S+)", text).group(1))
    after = float(re.search(r"\[rank 0\] eval loss after: (\S+)", text).group(1))
    assert after < before, text
    for when in ("before", "after"):  # a greedy continuation of the prompt, printed by rank 0
        sample = re.search(rf"\[rank 0\] sample {when}:\n\[rank 0\] def is_palindrome\(text\):\n(.+)", text)
        assert sample and sample.group(1).strip(), text
    assert "[rank 1] replicas identical" in text and "Stopped 2 workers" in text
