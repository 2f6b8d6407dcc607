"""Trainer: engines agree with a single process, resume is bit-identical, the CLI checks input,
and `nanoddp train` runs end to end through torchrun."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import TINY, generate_by_full_recompute, run_on_ranks, train_tiny, trainer_params

from nanoddp import cli
from nanoddp.base.records import TRAINER_STEP_FIELDS, read_records
from nanoddp.bench.training_run import run_training
from nanoddp.env import DistEnv
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import build_model
from nanoddp.train.data.datasets import BYTE_VOCAB, DataSpec
from nanoddp.train.trainer import Trainer

ENGINES = ["torch", "nanoddp", "allreduce", "rs_ag"]  # "single" is the reference itself
RESUME_STOP, RESUME_END = 9, 20  # stop mid-epoch 0, finish in epoch 1


def _ws2_worker(env: DistEnv, tmp: str) -> dict:
    """Everything that needs two ranks, in one launch (process start-up dominates the cost)."""
    out = {}
    for engine in ENGINES:
        for accum in (1, 2):
            config = replace(TINY, engine=engine, grad_accum=accum, out=f"{tmp}/{engine}-{accum}")
            trainer = train_tiny(config, env)
            out[f"{engine}-accum{accum}"] = trainer_params(trainer)
            out[f"{engine}-accum{accum}-val"] = trainer.evaluate()
    for engine in ("torch", "nanoddp", "zero1"):  # zero1: nanoddp's DDP with a ZeroRedundancyOptimizer
        base = replace(TINY, engine=engine, steps=RESUME_END, snapshot_every=5)
        whole = train_tiny(replace(base, out=f"{tmp}/whole-{engine}"), env)
        train_tiny(replace(base, out=f"{tmp}/split-{engine}"), env, stop_after=RESUME_STOP)
        resumed = Trainer.from_config(replace(base, out=f"{tmp}/split-{engine}", resume="auto"), env)
        assert resumed.step == RESUME_STOP and resumed.sampler.epoch == 0 and resumed.sampler.position > 0
        resumed.train()
        assert resumed.sampler.epoch == 1
        for key, value in trainer_params(whole).items():  # bitwise, on every rank
            assert torch.equal(value, resumed.module.state_dict()[key]), (engine, key)
        out[f"resume-{engine}"] = trainer_params(whole)
    bf16 = train_tiny(replace(TINY, amp="bf16", steps=2, out=f"{tmp}/bf16"), env)
    out["bf16-loss"] = bf16.evaluate()
    out["bf16-weights"] = trainer_params(bf16)
    return out


@pytest.fixture(scope="module")
def ws2_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ws2")
    return run_on_ranks(_ws2_worker, 2, str(tmp), timeout=300)[0], tmp


def test_engines_match_a_single_process_full_batch(ws2_results, tmp_path):
    results, _ = ws2_results
    reference = train_tiny(replace(TINY, engine="single", out=str(tmp_path)), DistEnv.single_process("gloo"))
    expected, expected_val = trainer_params(reference), reference.evaluate()
    assert expected_val > 0
    for engine in ENGINES:
        for accum in (1, 2):  # accumulation over 2 micro-batches changes nothing but memory
            torch.testing.assert_close(results[f"{engine}-accum{accum}"], expected, rtol=1e-4, atol=1e-5)
            # the validation loss covers both ranks' uneven shards, weighted by sample count
            assert results[f"{engine}-accum{accum}-val"] == pytest.approx(expected_val, rel=1e-4)
    assert torch.isfinite(torch.tensor(results["bf16-loss"]))
    # The reference: the same weights evaluated in float32, in one process over the same 5 samples.
    fp32 = Trainer.from_config(
        replace(TINY, engine="single", out=str(tmp_path / "fp32")), DistEnv.single_process("gloo")
    )
    fp32.module.load_state_dict(results["bf16-weights"])
    # BF16_EVAL_RTOL: bf16 keeps 8 significant bits, so autocast rounds each matmul's inputs by up
    # to 2^-9 (0.2 %) relative; those errors are independent per token and average out over the 80
    # tokens of the mean loss: measured 1e-5 .. 6e-5 relative (seeds 1, 2, 3, 1337). 1e-3 leaves a
    # 15x margin; one more bf16 rounding of the loss itself (steps of 2^-5 near 5.4) could exceed it.
    BF16_EVAL_RTOL = 1e-3
    assert results["bf16-loss"] == pytest.approx(fp32.evaluate(), rel=BF16_EVAL_RTOL)


def test_a_run_resumed_from_an_older_snapshot_records_each_step_once(tmp_path):
    """A run killed after step 3 whose newest snapshot is step 2 (one process, in this one): the
    resumed run drops step 3's record and logs it again, so its records are the uninterrupted
    run's, step for step and loss for loss (resume is bitwise)."""
    env, threads = DistEnv.single_process("gloo"), torch.get_num_threads()
    config = replace(TINY, engine="single", snapshot_every=2, resume="auto")
    try:
        train_tiny(replace(config, out=str(tmp_path / "straight")), env)
        train_tiny(replace(config, out=str(tmp_path / "killed")), env, stop_after=3)
        snapshot.snapshot_path(tmp_path / "killed" / "snapshots", 3).unlink()  # killed before step 3's snapshot
        assert [r["step"] for r in read_records(tmp_path / "killed")] == [1, 2, 3]
        train_tiny(replace(config, out=str(tmp_path / "killed")), env)
    finally:
        torch.set_num_threads(threads)
    resumed, straight = read_records(tmp_path / "killed"), read_records(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_resume_is_bit_identical_and_zero_matches(ws2_results):
    results, tmp = ws2_results  # the bitwise checks ran on the ranks; here: ZeRO vs plain AdamW
    torch.testing.assert_close(results["resume-zero1"], results["resume-nanoddp"], rtol=1e-5, atol=1e-6)
    records = read_records(tmp / "split-torch")
    assert [r["step"] for r in records] == list(range(1, RESUME_END + 1))  # no step logged twice
    assert all(set(TRAINER_STEP_FIELDS) <= set(r) for r in records) and records[0]["world_size"] == 2
    # stock torch DDP has no comm hook, so nothing in the trainer times it; nanoddp DDP is timed
    assert all(r["comm_time_s"] is None and r["comm_exposed_s"] is None for r in records)
    ours = read_records(tmp / "split-nanoddp")
    assert all(r["comm_time_s"] is not None for r in ours)
    # nanoddp DDP's timeline also says how much of it backward waited for: never more than all of it
    assert all(0 <= r["comm_exposed_s"] <= r["comm_time_s"] for r in ours)
    assert json.loads((tmp / "whole-zero1" / "config.json").read_text())["engine"] == "zero1"


def test_resume_skips_corrupt_snapshot_and_changes_world_size(ws2_results, tmp_path):
    _, tmp = ws2_results
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(tmp / "split-torch", run_dir)
    newest = snapshot.snapshot_path(run_dir / "snapshots", RESUME_END)
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated: must be skipped with a warning
    config = replace(TINY, engine="single", steps=RESUME_END, snapshot_every=5, out=str(run_dir), resume="auto")
    trainer = Trainer.from_config(config, DistEnv.single_process("gloo"))  # ws 2 -> 1
    assert trainer.step == 15
    assert trainer.sampler.epoch == 1 and trainer.sampler.position == 8 * (15 - 14)
    trainer.train()
    exported = torch.load(run_dir / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in exported)
    assert json.loads((run_dir / "config.json").read_text())["engine"] == "single"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "steps must be > 0"),
        (["--batch-size", "15", "--nproc", "2"], "must be divisible by world_size x grad_accum"),
        (["--data", "/no/such/file.txt"], "does not exist"),
        (["--engine", "single", "--nproc", "2"], "engine 'single' runs one process"),
        (["--model", "mlp"], "does not fit data"),
    ],
)
def test_bad_input_fails_in_the_launcher(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2  # before torchrun starts anything
    assert message in capsys.readouterr().err


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_bad_config_file_and_tiny_dataset(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("steps = 5\nlearning_rate = 0.1\n")
    assert cli.main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    assert "unknown key(s) ['learning_rate']" in capsys.readouterr().err
    (tmp_path / "tiny.txt").write_text("x" * 200)
    assert (
        cli.main(
            ["train", "--data", str(tmp_path / "tiny.txt"), "--seq-len", "64", "--nproc", "4", "--batch-size", "4"]
        )
        == 2
    )
    assert "training set has 2 samples but the world size is 4" in capsys.readouterr().err


def test_nanoddp_train_end_to_end_through_torchrun(tmp_path):
    """`nanoddp train --steps 20` on 2 processes via torchrun; the copy task's loss falls."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "nanoddp",
        "train",
        "--steps",
        "20",
        "--data",
        "copy",
        "--seq-len",
        "32",
        "--d-model",
        "64",
        "--n-layers",
        "2",
        "--n-heads",
        "4",
        "--d-ff",
        "128",
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "5",
        "--log-every",
        "5",
        "--eval-samples",
        "64",
        "--engine",
        "torch",
        "--out",
        str(out),
    ]
    run = run_training(cmd, out, timeout_s=240, env={**os.environ, "OMP_NUM_THREADS": "1"}, forked=True)
    assert run.returncode == 0, run.output[-3000:]
    assert "step 20 | loss" in run.output
    records = run.records
    assert records[-1]["step"] == 20 and records[-1]["world_size"] == 2
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, records
    assert (out / "model.pt").is_file()
    assert snapshot.find_latest_valid(out / "snapshots")[0].name.endswith("20.pt")
    assert json.loads((out / "config.json").read_text())["steps"] == 20


def test_sample_generates_text_from_a_run(tmp_path, capsys):
    """`sample` writes what generation without a cache gives for the run's model.pt, past its
    16-token window too; then, as a user runs it, the text reaches the pipe while it is still
    generating (a million tokens: it cannot be done, it must be streaming)."""
    config = replace(TINY, engine="single", steps=2, out=str(tmp_path))
    train_tiny(config, DistEnv.single_process("gloo"))
    assert cli.main(["sample", "--run", str(tmp_path), "--prompt", "import ", "--tokens", "40", "--seed", "3"]) == 0
    model = build_model(config, DataSpec("lm", BYTE_VOCAB))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    prompt = torch.tensor([list(b"import ")])
    want = generate_by_full_recompute(model.eval(), prompt, 40, 0.8, 40, torch.Generator().manual_seed(3))
    assert capsys.readouterr().out == bytes(want[0].tolist()).decode("utf-8", errors="replace") + "\n"
    assert cli.main(["sample", "--run", str(tmp_path / "nope")]) == 2
    assert "config.json not found" in capsys.readouterr().err

    cmd = [sys.executable, "-m", "nanoddp", "sample", "--run", str(tmp_path), "--prompt", "import "]
    cmd += ["--tokens", "1000000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        seen, deadline = b"", time.monotonic() + 120  # start-up on a loaded machine, then one token
        while len(seen) <= len(b"import ") and proc.poll() is None and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:  # the prompt, then generated text
                seen += proc.stdout.read1(4096)
        assert seen.startswith(b"import ") and len(seen) > len(b"import "), seen
        assert proc.poll() is None  # still generating: the text came as it was drawn
    finally:
        proc.kill()
        proc.wait(timeout=60)


def _train(env: DistEnv, config) -> None:
    train_tiny(config, env)


def test_sample_reads_a_sharded_runs_snapshot_without_model_pt(tmp_path, capsys):
    """A sharded run's snapshot holds its model in per-rank files: `sample` reads them and
    generates what the same weights in model.pt generate."""
    config = replace(TINY, engine="fsdp", steps=2, snapshot_every=2, out=str(tmp_path))
    run_on_ranks(_train, 2, config, timeout=120)  # sharded over 2 ranks; sample reads it in this process
    args = ["sample", "--run", str(tmp_path), "--prompt", "import ", "--tokens", "20"]
    assert cli.main(args) == 0
    from_model_pt = capsys.readouterr().out
    (tmp_path / "model.pt").unlink()
    assert (
        snapshot.load(snapshot.snapshot_path(tmp_path / "snapshots", 2))["objects"]["model"]["kind"] == "sharded_module"
    )
    assert cli.main(args) == 0
    assert capsys.readouterr().out == from_model_pt


def test_worker_module_is_runnable():
    """`torchrun -m nanoddp.train` needs the module to have a usable --help."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanoddp.train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0 and "--grad-accum" in proc.stdout and "--nproc" not in proc.stdout
