"""The tutorial examples run end to end (real subprocesses, small settings) and show what they claim."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from nanoddp.models import MLPClassifier
from nanoddp.train.checkpoint import snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(args: list[str], timeout: float = 150.0, env: dict[str, str] | None = None) -> str:
    """Run a command in its own process group; past `timeout`, kill it and every descendant."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun puts each worker in a session of its own, out of reach of killpg: walk the tree
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args[0]} timed out after {timeout}s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text, re.M)]


@pytest.mark.timeout(200)
def test_collectives_match_torch_and_trace_the_ring():
    out = run([str(EXAMPLES / "collectives.py"), "--nproc", "4"])
    assert "rank 0: sent [0.0] to 1, received [300.0] from 3" in out
    verdicts = re.findall(r"same as torch.distributed on every rank: (\w+)", out)
    assert verdicts == ["True"] * 8, out  # broadcast ... reduce_scatter_tensor
    assert "rank 3: [30.0, 31.0] -> [60.0, 64.0]" in out  # all_reduce(SUM) of [10r, 10r+1]
    trace = out.split("ring all-reduce, step by step")[1].split("== 4. subgroups")[0]
    steps = re.split(r"^-- share-(?:reduce|only) step \d.*$", trace, flags=re.M)
    assert len(steps) == 7, out  # the start, 3 share-reduce steps, 3 share-only steps
    full = "'0+1+2+3'"
    complete = [[line.count(full) for line in block.splitlines() if line.strip().startswith("rank")] for block in steps]
    # After share-reduce step k no chunk is complete until k = 3, when each rank owns exactly one;
    # every share-only step then hands each rank one more finished chunk.
    assert complete == [[0] * 4, [0] * 4, [0] * 4, [1] * 4, [2] * 4, [3] * 4, [4] * 4], complete
    assert "equal to torch's all_reduce: True" in out
    assert "rank 2: member, group rank 1 of [0, 2]: value 2 -> 2" in out
    assert "rank 1: not a member: value 1 -> 1" in out


@pytest.mark.timeout(200)
def test_manual_modes_match_ddp(tmp_path):
    steps = 3
    out = run(
        [
            str(EXAMPLES / "manual_vs_ddp.py"),
            "--nproc",
            "3",
            "--steps",
            str(steps),
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--out",
            str(tmp_path),
        ]
    )
    rows = re.findall(r"^\s*(\d+) \|\s+(\S+) \|\s+(\S+) \|\s+(\S+)$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(steps)), out
    for _, *losses in rows:
        losses = [float(x) for x in losses]
        assert max(losses) - min(losses) < 1e-4, losses
        assert 5.5 < losses[0] < 7.0  # random tokens over 512 ids: about ln(512) = 6.24
    weights = {name: snapshot.load(tmp_path / f"{name}.pt") for name in ("ddp", "manual_allreduce", "manual_rs_ag")}
    for name, state in weights.items():
        assert not any(key.startswith("module.") for key in state["model"]), name
        torch.testing.assert_close(state["model"], weights["ddp"]["model"], atol=1e-4, rtol=0)
        assert state["losses"] == pytest.approx([float(r[1]) for r in rows], abs=1e-4)


@pytest.mark.timeout(200)
def test_simple_ddp_checks_replicas_and_accumulates():
    out = run([str(EXAMPLES / "simple_ddp.py"), "--nproc", "2", "--steps", "5", "--batch-size", "16"])
    assert "different seeds -> ValueError on ranks [0, 1]" in out
    assert "'net.0.weight' differs from rank 0's" in out
    assert "same seed -> SimpleDDP accepted the model" in out
    assert "rank 1: 718 samples, indices [1, 3, 5, 7, 9]" in out and "disjoint: True" in out
    assert out.count("no sync (inside no_sync)") == 3 and "micro-batch 3: backward, then ALL-REDUCE" in out
    (diff,) = floats(r"single-process grad\| = (\S+)$", out)
    assert diff < 1e-6
    assert len(floats(r"^[12] process\(es\):\s+(\S+) ms/step", out)) == 2


@pytest.mark.timeout(200)
def test_spawn_train_saves_module_state_dict(tmp_path):
    out = run([str(EXAMPLES / "spawn_train.py"), "--nproc", "2", "--epochs", "2", "--out", str(tmp_path)])
    orders = re.findall(r"without set_epoch (\[.*?\]), (\[.*?\]) \| with set_epoch (\[.*?\]), (\[.*?\])$", out, re.M)
    assert len(orders) == 2
    for same_a, same_b, epoch0, epoch1 in orders:
        assert same_a == same_b == epoch0 and epoch0 != epoch1
    assert "1437 distinct of 1437 samples" in out
    assert "'module.net.0.weight'" in out and "Missing key(s)" in out
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = MLPClassifier()
    model.load_state_dict(state)  # plain keys: loads into an unwrapped model
    (reloaded,) = floats(r"plain MLPClassifier: val accuracy (\S+)%", out)
    (trained,) = floats(r"\(trained model: (\S+)%\)", out)
    assert reloaded == trained > 50.0  # 10 classes: chance is 10%


@pytest.mark.timeout(240)
def test_torchrun_restart_resumes_from_snapshot(tmp_path):
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--log-dir",  # else torchelastic leaves a torchelastic_* directory in /tmp
            str(tmp_path / "torchrun-logs"),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            str(EXAMPLES / "torchrun_snapshot.py"),
            "--steps",
            "8",
            "--snapshot-every",
            "3",
            "--crash-at-step",
            "5",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--out",
            str(tmp_path),
        ],
        timeout=220,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )  # as the example's docstring says
    assert "rank 1: simulated crash after step 5 (restart 0)" in out
    assert "resumed from step-00000003.pt at step 3 (restart 1)" in out
    assert "training finished at step 8" in out
    before, after = out.split("resumed from")
    first = dict(re.findall(r"^step (\d+) \| loss (\S+)", before, re.M))
    second = dict(re.findall(r"^step (\d+) \| loss (\S+)", after, re.M))
    # Rank 0 prints step 4 before it joins step 5's gradient all-reduce, so step 4 is always
    # logged; its step-5 line races rank 1's exit (torchrun may stop rank 0 before it prints).
    assert "4" in first and set(first) <= {str(s) for s in range(1, 6)}
    assert set(second) == {str(s) for s in range(4, 9)}
    for step in {"4", "5"} & set(first):  # the same batches, the same weights
        assert first[step] == second[step]
    final = snapshot.load(snapshot.snapshot_path(tmp_path / "snapshots", 8))
    assert final["step"] == 8 and final["sampler"]["position"] == 8 * 4 * 2


@pytest.mark.timeout(400)
def test_own_loop_state_resumes_bitwise_and_gathers_exact_metrics(tmp_path):
    args = ["--steps", "20", "--crash-at-step", "10", "--out", str(tmp_path)]
    out = run([str(EXAMPLES / "own_loop_state.py"), *args], timeout=380)
    assert "crashed: rank 1 failed: RuntimeError: simulated crash after step 10" in out
    assert "resumed from step 8" in out  # the newest state before the crash (saved every 4 steps)
    assert "crash + resume == uninterrupted, bitwise: True" in out
    distributed, single = map(float, re.search(r"accuracy on 2 ranks (\S+) \| one process (\S+)", out).groups())
    assert distributed == single > 0.6  # XOR of quadrants: chance is 0.5
    final = snapshot.load(snapshot.snapshot_path(tmp_path / "uninterrupted", 20))
    assert final["objects"]["step"]["state"] == 20
    assert not any(k.startswith("module.") for k in final["objects"]["model"]["state"])
