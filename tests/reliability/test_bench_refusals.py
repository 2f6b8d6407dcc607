"""Benchmarks refuse bad input before they measure anything, and a failure midway leaves nothing.

Every refusal runs `nanoddp bench ...` in this process with every way of starting a child
(`subprocess.Popen`, `multiprocessing`) replaced by a recorder: it must exit 2 with one line
naming the flag, the value and the rule, start no child, leave the temp dir empty and create no
output. The failure tests plant a failing step or child run (plain Python, no training) and check
that every process the benchmark started is gone and its temp dir removed.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from nanoddp.bench import restarts, wan
from nanoddp.cli import main

LIVENESS_S = 60  # waits for a planted child to start or to be gone: liveness only, never a timing


@pytest.fixture
def no_children(monkeypatch, tmp_path):
    """Every child start recorded (and refused); the temp dir an empty one of this test's."""
    started: list[str] = []

    def refuse_start(*args, **kwargs):
        started.append(repr(args[:2]))
        raise AssertionError(f"a child was started: {args[:2]}")

    monkeypatch.setattr(subprocess, "Popen", refuse_start)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_start)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return started, temp


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's refusals exit; the benchmarks' own checks return
        return int(exc.code or 0)


def _places(tmp_path: Path) -> dict[str, str]:
    """Paths the bad inputs name: a planted link, a directory, a file, a missing directory."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    (tmp_path / "link.json").symlink_to(victim)
    (tmp_path / "adir").mkdir()
    (tmp_path / "bench.json").write_text("{}")
    (tmp_path / "doc.md").symlink_to(victim)
    return {"tmp": str(tmp_path), "missing": str(tmp_path / "missing" / "out.json")}


REFUSALS = [
    (["restarts", "--max-delay", "nan"], "argument --max-delay: must be a finite number >= 0, got 'nan'"),
    (["restarts", "--max-delay", "inf"], "argument --max-delay: must be a finite number >= 0, got 'inf'"),
    (["restarts", "--max-delay", "-1"], "argument --max-delay: must be a finite number >= 0, got '-1'"),
    (["restarts", "--trials", "-1"], "argument --trials: must be an integer >= 0, got '-1'"),
    (["restarts", "--cost-trials", "-1"], "argument --cost-trials: must be an integer >= 0, got '-1'"),
    (["restarts", "--trials", "0", "--cost-trials", "0"], "--trials and --cost-trials are both 0"),
    (["restarts", "--json", "{missing}"], "{missing}: the directory {tmp}/missing does not exist"),
    (["restarts", "--json", "{tmp}/adir"], "argument --json: {tmp}/adir is a directory"),
    (["restarts", "--json", "{tmp}/link.json"], "argument --json: {tmp}/link.json is a symbolic link"),
    (["wan", "--plot", "/sys/nanoddp-bench.png"], "cannot write in /sys"),
    (["wan", "--json", "{tmp}/bench.json/x.json"], "{tmp}/bench.json is not a directory"),
    (["wan", "--train-args", "--bogus-flag 3"], "unrecognized arguments: --bogus-flag 3"),
    (["wan", "--train-args", "--lr nan"], "lr must be a finite number, got nan"),
    (["wan", "--train-args", "--batch-size 7"], "batch_size=7 (global) must be divisible by world_size"),
    (["wan", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["wan", "--bandwidth", "fast"], "--bandwidth must be a number and a unit"),
    (["wan", "--bogus"], "unrecognized arguments: --bogus"),
    (["wan", "--lrs", "1e-3"], "expected two or more distinct positive learning rates, comma-separated"),
    (["wan", "--lrs", "1e-3,x"], "argument --lrs: expected two or more distinct positive learning rates"),
    (["wan", "--lrs", "1e-3,-1"], "argument --lrs: expected two or more distinct positive learning rates"),
    (["wan", "--lrs", "1e-3,2e-3", "--train-args", "--lr 1e-3"], "--train-args may not give one too"),
    (["wan", "--sync-every", "50", "--fragments", "4"], "sync_every must be a multiple of fragments"),
    (["wan", "--fragments", "2", "--sync-every", "4", "--sync-delay", "2"], "sync_delay"),
    (["collectives", "--iters", "nan"], "argument --iters: must be an integer >= 1, got 'nan'"),
    (["collectives", "--json", "{missing}"], "the directory {tmp}/missing does not exist"),
    (["zero", "--warmup", "-1"], "argument --warmup: must be an integer >= 0, got '-1'"),
    (["zero", "--nproc", "0"], "--nproc needs world sizes >= 1"),
    (["zero", "--nproc", "two"], "--nproc must be comma-separated integers"),
    (["zero", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["train", "--memory-plot", "{tmp}/adir"], "argument --memory-plot: {tmp}/adir is a directory"),
    (["train", "--trace", "{tmp}/bench.json/traces"], "{tmp}/bench.json is not a directory"),
    (["train", "--block", "0"], "argument --block: must be an integer >= 1, got '0'"),
    (["report", "{tmp}/none.json"], "argument FILE.json: {tmp}/none.json does not exist"),
    (["report", "{tmp}/bench.json", "--plot", "{tmp}/link.json"], "{tmp}/link.json is a symbolic link"),
    (["render", "{tmp}/doc.md"], "{tmp}/doc.md is a symbolic link"),
]


@pytest.mark.parametrize("argv, message", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_a_bad_flag_is_one_line_before_any_child(argv, message, no_children, tmp_path, capsys):
    started, temp = no_children
    places = _places(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [word.format(**places) for word in argv]
    assert _exit_code(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nanoddp bench {argv[0]}: error: "), err
    assert message.format(**places) in err and "Traceback" not in err
    assert started == [] and list(temp.iterdir()) == []  # no child, no temp dir
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output file, none created
    assert (tmp_path / "victim.txt").read_text() == "not yours"


def test_the_command_line_refuses_with_exit_code_2_and_no_temp_dir(tmp_path):
    """The same, through the real `nanoddp` command: exit code, stderr, the temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    argv = [sys.executable, "-m", "nanoddp", "bench", "restarts", "--max-delay", "nan", "--json", f"{tmp_path}/r.json"]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(temp)}, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "nanoddp bench restarts: error: argument --max-delay: must be a finite number >= 0, got 'nan' "
        "(see nanoddp bench restarts --help)"
    ]
    assert list(temp.iterdir()) == [] and not (tmp_path / "r.json").exists()


def test_wan_help_gives_the_default_link(capsys):
    assert _exit_code(["bench", "wan", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert "(default: 100mbit)" in help_text and "(default: 1000)" in help_text
    assert "(default: 20ms under --link shaper; none under --link netns, which refuses a nonzero one)" in help_text
    assert "Default: netns where this process is root with ip and tc, else shaper" in help_text


# Where namespaces can be made (None) and where they cannot: the link each asks for is refused in
# one line, or a latency netns cannot give; the machine running the suite decides nothing.
NO_NAMESPACES = "making network namespaces needs root"
LINK_REFUSALS = [
    (NO_NAMESPACES, ["--link", "netns"], f"--link netns needs network namespaces and tc qdiscs, which cannot be "
                                         f"made here ({NO_NAMESPACES}); use --link shaper"),
    (None, ["--link", "netns", "--latency", "20ms"], "--latency 20ms cannot be simulated under --link netns: this "
                                                    "kernel has no netem"),
    (None, ["--latency", "5ms"], "--latency 5ms cannot be simulated under --link netns"),  # netns by default
    (None, ["--link", "netns", "--latency", "soon"], "--latency must be a number and a unit"),
]  # fmt: skip


@pytest.mark.parametrize("reason, flags, message", LINK_REFUSALS, ids=[" ".join(f) for _, f, _ in LINK_REFUSALS])
def test_a_link_that_cannot_be_had_is_one_line_before_any_child(reason, flags, message, no_children, monkeypatch,
                                                                capsys):  # fmt: skip
    started, temp = no_children
    monkeypatch.setattr(wan, "shaping_unavailable_reason", lambda: reason)
    assert _exit_code(["bench", "wan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoddp bench wan: error: ") and message in err, err
    assert started == [] and list(temp.iterdir()) == []


# --- a failure midway --------------------------------------------------------------------------

# A stand-in for `nanoddp train`: it starts a "worker" in a session of its own (as torchrun does),
# records both pids, then trains (sleeps) until it is killed.
FAKE_TRAIN = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()} {worker.pid}\\n")
time.sleep(300)
"""


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"the fake run never started ({path})"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by init
    except psutil.NoSuchProcess:
        return True


def _assert_all_gone(pids_file: Path) -> None:
    """Every pid the fake runs wrote is gone; any left is killed here before the test fails."""
    pids = [int(p) for line in pids_file.read_text().splitlines() for p in line.split()]
    deadline = time.monotonic() + LIVENESS_S  # SIGKILL is asynchronous
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if not _gone(p)]
    for pid in left:
        psutil.Process(pid).kill()
    assert len(pids) == 2 and left == []


def test_a_trial_that_fails_midway_ends_its_run_and_removes_the_temp_dir(tmp_path, monkeypatch):
    """`bench restarts`: the reference run passes; the first trial's kill step fails while the
    trial's run (and its worker, in a session of its own) is training."""
    temp, pids = tmp_path / "tmp", tmp_path / "pids"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    model = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, model)
    copy_model = "import shutil, sys, os; os.makedirs(sys.argv[1]); shutil.copy(sys.argv[2], sys.argv[1] + '/model.pt')"

    def fake_argv(out: Path, max_restarts: int) -> list[str]:
        if max_restarts == 0:  # the reference: finishes at once with its parameters
            return [sys.executable, "-c", copy_model, str(out), str(model)]
        return [sys.executable, "-c", FAKE_TRAIN, str(pids)]

    def failing_kill(proc, out, rng, max_delay_s):
        _wait_for(pids)
        raise RuntimeError("planted: the kill step failed")

    monkeypatch.setattr(restarts, "_argv", fake_argv)
    monkeypatch.setattr(restarts, "_kill_random_worker", failing_kill)
    with pytest.raises(RuntimeError, match="planted"):
        main(["bench", "restarts", "--trials", "2", "--cost-trials", "0"])
    _assert_all_gone(pids)
    assert list(temp.iterdir()) == []


def test_a_run_that_fails_is_reported_without_a_traceback_and_nothing_is_left(tmp_path, monkeypatch, capsys):
    """`bench wan`: the first run exits 1; the benchmark stops there (no second run), says why
    in its output's tail, exits 1, and leaves no temp dir."""
    temp, starts = tmp_path / "tmp", tmp_path / "starts"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    fail = "import sys; open(sys.argv[1], 'a').write('x'); print('planted: out of memory'); sys.exit(1)"
    monkeypatch.setattr(wan, "train_argv", lambda engine, args, out, lr=None: [sys.executable, "-c", fail, str(starts)])
    assert main(["bench", "wan", "--link", "shaper", "--steps", "2", "--sync-every", "1", "--eval-every", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoddp bench wan: error: ") and "failed (exit 1)" in err
    assert "planted: out of memory" in err and "Traceback" not in err
    assert starts.read_text() == "x" and list(temp.iterdir()) == []


# node 1 of a netns run: waits until node 0's stand-in is up, then fails
FAILING_NODE = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("planted: node 1 lost its disk")
sys.exit(1)
"""


@pytest.mark.skipif(wan.shaping_unavailable_reason() is not None, reason=f"netns: {wan.shaping_unavailable_reason()}")
@pytest.mark.timeout(180)
def test_a_netns_node_that_fails_ends_the_other_and_leaves_no_host(tmp_path, monkeypatch, capsys):
    """`bench wan --link netns`: node 1 exits 1 while node 0 trains (sleeps, a worker in a session
    of its own): node 0 is ended at once rather than left waiting for it, node 1's failure is the
    one reported, and no process, namespace or temp dir is left."""
    temp, pids = tmp_path / "tmp", tmp_path / "pids"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def stand_in(engine, args, out, launch=wan.LOCAL_LAUNCH, lr=None):
        script = FAILING_NODE if launch[launch.index("--node-rank") + 1] == "1" else FAKE_TRAIN
        return [sys.executable, "-c", script, str(pids)]

    monkeypatch.setattr(wan, "train_argv", stand_in)
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    started = time.monotonic()
    assert main(["bench", "wan", "--link", "netns", "--steps", "2", "--sync-every", "1", "--eval-every", "1"]) == 1
    assert time.monotonic() - started < 120  # not the stand-in's 300 s sleep
    error = capsys.readouterr().err  # the stand-in's script spans lines
    assert error.startswith(f"nanoddp bench wan: error: `ip netns exec nanoddp-{os.getpid()}-")
    assert error.split()[7].endswith("-1")  # node 1's host
    assert "` failed (exit 1):\nplanted: node 1 lost its disk\n" in error and "Traceback" not in error
    _assert_all_gone(pids)
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {name for name in after - before if name.startswith(f"nanoddp-{os.getpid()}-")}
    assert list(temp.iterdir()) == []
