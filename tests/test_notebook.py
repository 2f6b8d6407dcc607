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
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from jupyter_client import AsyncKernelManager, KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from nanoddp.notebook import check_devices, parse_ranks, placement
from nanoddp.notebook.worker import NO_VALUE, run_source

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "notebook_ddp.ipynb"
KERNEL_NAME = "nanoddp-test"
WORLD_SIZE = 2


def _kernel_kwargs(tmp_path: Path) -> dict:
    """Keyword arguments for a KernelManager whose kernel is this venv's python."""
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nanoddp tests",
        "language": "python",
        "env": {"IPYTHONDIR": str(tmp_path / "ipython")},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return {
        "kernel_name": KERNEL_NAME,
        "kernel_spec_manager": KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
        "connection_file": str(tmp_path / "connection.json"),
    }


def _execute_notebook(nb: nbformat.NotebookNode, tmp_path: Path, cwd: Path, timeout: int = 300) -> None:
    """Run every cell with nbclient on our kernel; raises CellExecutionError on a failed cell
    (cells tagged "raises-exception" may fail)."""

    class Client(NotebookClient):
        def create_kernel_manager(self):
            self.km = AsyncKernelManager(**_kernel_kwargs(tmp_path))
            return self.km

    Client(nb, timeout=timeout, resources={"metadata": {"path": str(cwd)}}).execute()


def _text(cell) -> str:
    """Everything a cell showed as text: streams, results, and error tracebacks."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


def _stream(cell, name: str) -> str:
    return "".join(out.text for out in cell.outputs if out.output_type == "stream" and out.name == name)


def _error(cell):
    errors = [out for out in cell.outputs if out.output_type == "error"]
    return errors[0] if errors else None


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
    _execute_notebook(nb, tmp_path, tmp_path)
    cells = {name: cell for (name, _, _), cell in zip(MAGICS_CELLS, nb.cells, strict=True)}
    for name, _, may_fail in MAGICS_CELLS:
        assert may_fail or _error(cells[name]) is None, f"cell {name!r} failed:\n{_text(cells[name])}"

    for rank in range(WORLD_SIZE):  # the status table: rank, pid, device, state, memory
        assert re.search(rf"^{rank}\s+\d+\s+cpu\s+idle\s+\d+ MiB$", _text(cells["init"]), re.M)
    hello_out, hello_err = _stream(cells["hello"], "stdout"), _stream(cells["hello"], "stderr")
    for rank in range(WORLD_SIZE):
        assert f"[rank {rank}] hello from {rank} of {WORLD_SIZE}\n" in hello_out
        assert f"[rank {rank}] to stderr from {rank}\n" in hello_err  # stderr stays stderr
        # get(...) as in the notebook tutorials, and the namespace names; the last expression's value per rank
        assert f"[rank {rank}] ({WORLD_SIZE}, {rank}, {rank}, {rank}, True, {rank}, {rank})\n" in hello_out
    assert "to stderr" not in hello_out
    expected_sum = float(sum(range(1, WORLD_SIZE + 1)))
    for rank in range(WORLD_SIZE):
        assert f"[rank {rank}] sum {expected_sum}" in _text(cells["allreduce"])
    assert _text(cells["subset"]) == "[rank 1] only 1\n"
    assert "[rank 0] has marker False" in _text(cells["subset_check"])
    assert "[rank 1] has marker True" in _text(cells["subset_check"])
    assert "Warning: this cell seems to call a collective" in _text(cells["warn"])
    assert "[rank 0] no hang" in _text(cells["warn"])

    error = _error(cells["error"])
    assert error.ename == "DistributedCellError" and "rank 1: ValueError: boom on one" in error.evalue
    assert "stopped ranks [0]" in error.evalue
    tb = "\n".join(error.traceback)
    assert "[rank 1] ValueError: boom on one" in tb and "raise ValueError('boom on one')" in tb
    assert "rank 0 -----" not in tb  # rank 0 did not fail
    assert "[rank 0] before 0" in _text(cells["error"])
    assert "[rank 0] 0\n" in _text(cells["usable"]) and "[rank 1] 10\n" in _text(cells["usable"])

    html = [o for o in cells["html"].outputs if o.output_type == "display_data"]
    assert [o.data["text/html"] for o in html] == ["<b>rank 0</b>"]  # rich output from rank 0 only
    assert "[rank 1] <__main__.Badge" in _text(cells["html"])  # text only from other ranks
    pngs = [o for o in cells["figure"].outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1

    assert "timed out after 1.0s" in _error(cells["timeout"]).evalue
    assert "[rank 0] alive 0" in _text(cells["after_timeout"])
    assert "[rank 1] alive 1" in _text(cells["after_timeout"])
    assert "[rank 0] auto 0" in _text(cells["auto"]) and "[rank 1] auto 1" in _text(cells["auto"])
    assert _text(cells["local"]) == "local False\n"
    assert "All 2 ranks reached the barrier" in _text(cells["sync"])

    crash = _error(cells["crash"])
    assert "rank 1" in crash.evalue and "exited with code 3" in "\n".join(crash.traceback)
    assert re.search(r"^1\s+\d+\s+cpu\s+dead \(exited with code 3\)", _text(cells["status"]), re.M)
    assert "Stopping the previous workers" in _text(cells["restart"])
    assert "[rank 1] restarted 1.0" in _text(cells["after_restart"])  # sum of ranks 0 + 1
    assert "alive after shutdown: []" in _text(cells["gone"])
    # The transport: a private (0700) directory, and the socket is gone once every worker is in.
    assert "mode 0o700 files ['store']" in _text(cells["pids1"])
    first = json.loads(re.search(r"pids (\[.*\])", _text(cells["pids1"])).group(1))
    second = json.loads(re.search(r"pids (\[.*\])", _text(cells["pids2"])).group(1))
    assert len(set(first + second)) == 2 * WORLD_SIZE and not any(_alive(p) for p in first + second)


# ----------------------------------------------------------------------------- interrupt & kernel death
def _run(kc, code: str, timeout: float = 120, until=None):
    """Execute `code`; return (reply content, stdout+stderr text). `until(text)` -> True triggers
    an early return after that output appears (the cell keeps running)."""
    msg_id = kc.execute(code)
    text = ""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += content["text"]
            if until is not None and until(text):
                return msg_id, text
        elif kind == "status" and content["execution_state"] == "idle":
            break
    return kc.get_shell_msg(timeout=timeout)["content"], text


def _finish(kc, msg_id: str, timeout: float = 60):
    """Wait for the reply of an already-started execution."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def test_interrupt_then_kernel_death(tmp_path):
    km = KernelManager(**_kernel_kwargs(tmp_path))
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    pids: list[int] = []
    try:
        kc.wait_for_ready(timeout=120)
        reply, text = _run(kc, f"%load_ext nanoddp.notebook\n%dist_init --num-processes {WORLD_SIZE}")
        assert reply["status"] == "ok", text
        loop = "%%distributed\ni = 0\nprint('looping', flush=True)\nwhile True:\n    i += 1"
        both_looping = lambda t: all(f"[rank {r}] looping" in t for r in range(WORLD_SIZE))  # noqa: E731
        msg_id, _ = _run(kc, loop, until=both_looping)
        km.interrupt_kernel()
        reply = _finish(kc, msg_id)
        assert reply["status"] == "error" and reply["ename"] == "CellInterrupted", reply
        reply, text = _run(kc, "%%distributed\nprint('after', i > 0)\nimport os\nos.getpid()")
        assert reply["status"] == "ok", text
        for rank in range(WORLD_SIZE):
            assert f"[rank {rank}] after True" in text
        pids = [int(p) for p in re.findall(r"\[rank \d\] (\d+)\n", text)]
        assert len(pids) == WORLD_SIZE and all(_alive(p) for p in pids)
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
    _execute_notebook(nb, tmp_path, ROOT, timeout=120)  # per cell: a hang fails, not stalls
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    failed = [cell for cell in code if _error(cell) is not None]
    assert [cell.metadata.get("tags") for cell in failed] == [["raises-exception"]]  # only the seed demo
    assert "replicas differ" in _error(failed[0]).evalue and "on ranks [1]" in _error(failed[0]).evalue
    text = "".join(_text(cell) for cell in code)
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
@pytest.mark.timeout(900)  # about 3 minutes on an idle 2-core machine (more the first time: conversion)
def test_smollm2_notebook_fine_tunes_from_distributed_cells(tmp_path):
    from nanoddp.models import smollm2_missing

    if smollm2_missing():
        pytest.skip(smollm2_missing())
    nb = nbformat.read(SMOLLM2_EXAMPLE, as_version=4)
    _execute_notebook(nb, tmp_path, ROOT, timeout=400)  # per cell; the load and the steps take longest
    text = "".join(_text(cell) for cell in nb.cells if cell.cell_type == "code")
    before = float(re.search(r"\[rank 0\] eval loss before: (\S+)", text).group(1))
    after = float(re.search(r"\[rank 0\] eval loss after: (\S+)", text).group(1))
    assert after < before, text
    for when in ("before", "after"):  # a greedy continuation of the prompt, printed by rank 0
        sample = re.search(rf"\[rank 0\] sample {when}:\n\[rank 0\] def is_palindrome\(text\):\n(.+)", text)
        assert sample and sample.group(1).strip(), text
    assert "[rank 1] replicas identical" in text and "Stopped 2 workers" in text
