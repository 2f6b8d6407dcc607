"""`nanoddp bench wan`'s learning-rate sweep, its no-communication run and the ratios it reports,
checked without training anything.

- The sweep (`--lrs`): DDP and DiLoCo run at every lr, torch's DDP and the no-communication run
  once each, at their twin's best (reference: the argmin of the planted losses, different for the
  two twins so that a twin taking the other's lr is caught).
- The no-communication run is DiLoCo with the same flags but an H past the last step: the
  trainer's own parser gives the same config but for `sync_every`, and no fragment's all-reduce
  starts or finishes at any step of the run (the trainer's own schedule, `fragments.py`).
- The summary compares the kept runs only: the loss gap, the bytes and the steps/s ratios come
  out of the kept rows' own figures (reference: the same quotients computed here), and the table
  lists every run with the kept ones in bold.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import pytest

from nanoddp.bench import wan, wan_report
from nanoddp.parallel.lowcomm.fragments import fragment_finishing, fragment_starting
from nanoddp.train.launcher.cli import check_train_argv

ROOT = Path(__file__).resolve().parents[2]
LRS = [1e-3, 2e-3, 4e-3]
# planted final losses: DDP is best at 2e-3, DiLoCo at 1e-3
LOSS = {("nanoddp", 1e-3): 1.2, ("nanoddp", 2e-3): 1.0, ("nanoddp", 4e-3): 1.1,
        ("diloco", 1e-3): 1.05, ("diloco", 2e-3): 1.3, ("diloco", 4e-3): 1.6}  # fmt: skip


def _args(**overrides) -> argparse.Namespace:
    fields = {"steps": 96, "sync_every": 8, "eval_every": 48, "eval_samples": 16, "seed": 3, "link": "netns",
              "train_args": "--d-model 32 --n-layers 1 --n-heads 2 --d-ff 64 --text-max-bytes 20000 --batch-size 4",
              "bandwidth": "100mbit", "latency": None, "no_unshaped": True, "lrs": None,
              **dict.fromkeys(wan.DILOCO_FLAGS), "fragments": 4, "sync_delay": 1,
              "pseudo_grad_dtype": "int8"}  # fmt: skip
    return argparse.Namespace(**{**fields, **overrides})


def test_the_sweep_keeps_each_engines_best_and_its_twin_runs_at_that_lr():
    calls = []

    def planted(engine, lr):
        calls.append((engine, lr))
        loss = LOSS.get((engine, lr), 2.0)
        return {"engine": engine, "shaped": True, "lr": lr, "final_val_loss": loss}

    runs = wan.sweep(wan.ENGINES["netns"], LRS, planted)
    best = {e: min(LRS, key=lambda lr, e=e: LOSS[(e, lr)]) for e in ("nanoddp", "diloco")}
    assert best == {"nanoddp": 2e-3, "diloco": 1e-3}
    assert calls == [*(("nanoddp", lr) for lr in LRS), ("torch", best["nanoddp"]),
                     *(("diloco", lr) for lr in LRS), ("nocomm", best["diloco"])]  # fmt: skip
    kept = [r["lr"] for r in wan_report.best_runs(runs)]
    assert kept == [best["nanoddp"], best["nanoddp"], best["diloco"], best["diloco"]]
    assert wan.sweep(("nanoddp", "torch"), None, planted) == [planted("nanoddp", None), planted("torch", None)]


def test_the_no_communication_run_is_diloco_never_syncing(tmp_path):
    args = _args(lrs=LRS)
    diloco, nocomm = (check_train_argv(wan.train_flags(e, args, tmp_path, lr=2e-3)) for e in ("diloco", "nocomm"))
    assert diloco.engine == nocomm.engine == "diloco" and diloco.lr == nocomm.lr == 2e-3
    assert (diloco.sync_every, diloco.fragments, diloco.sync_delay, diloco.pseudo_grad_dtype) == (8, 4, 1, "int8")
    assert dataclasses.replace(nocomm, sync_every=diloco.sync_every) == diloco
    for step in range(1, args.steps + 1):
        assert fragment_starting(step, nocomm.sync_every, nocomm.fragments, nocomm.sync_delay) is None, step
        assert fragment_finishing(step, nocomm.sync_every, nocomm.fragments) is None, step
    starts = [s for s in range(1, args.steps + 1) if fragment_starting(s, 8, 4, 1) is not None]
    assert starts[:2] == [1, 3]  # the same schedule does start DiLoCo's: every H/F = 2 steps, tau = 1 early


def _report() -> dict:
    """The committed shaper report, with a sweep planted: a worse DDP and DiLoCo at another lr, a
    faster torch row, and a no-communication row 2 % faster than DiLoCo."""
    report = json.loads((ROOT / "docs/bench/wan/wan-2026-11-28.json").read_text())
    report["meta"]["link"], report["meta"]["latency"] = "netns", None
    report["results"] = [r for r in report["results"] if r["shaped"]]
    runs = []
    for r in report["results"]:
        kept = {**copy.deepcopy(r), "lr": 2e-3}
        worse = {**copy.deepcopy(r), "lr": 4e-3, "final_val_loss": r["final_val_loss"] + 0.5, "train_s": 1.0}
        runs += [worse, kept]
    ddp, diloco = runs[1], runs[3]
    runs.insert(2, {**copy.deepcopy(ddp), "engine": "torch", "train_s": 3 * ddp["train_s"]})
    runs.append({**copy.deepcopy(diloco), "engine": "nocomm", "comm_bytes": 0, "train_s": 0.98 * diloco["train_s"]})
    report["results"] = runs
    return report


def test_the_summary_compares_the_kept_runs_and_derives_its_ratios():
    report = _report()
    ddp, diloco = (next(r for r in report["results"] if r["engine"] == e and r["lr"] == 2e-3)
                   for e in ("nanoddp", "diloco"))  # fmt: skip
    s = wan_report.compare(report["results"])["shaped"]
    assert s["val_loss_gap"] == diloco["final_val_loss"] / ddp["final_val_loss"] - 1
    assert s["bytes_ratio"] == ddp["comm_bytes"] / diloco["comm_bytes"]
    assert s["diloco_over_nocomm"] == pytest.approx(0.98)
    assert s["torch_ddp_over_diloco"] == 3 * ddp["train_s"] / diloco["train_s"]
    assert s["train_time_speedup"] == ddp["train_s"] / diloco["train_s"]  # not the 1-second loser's
    assert s["lr"] == {"nanoddp": 2e-3, "torch": 2e-3, "diloco": 2e-3, "nocomm": 2e-3}


def test_the_table_lists_every_run_and_bolds_the_kept_ones():
    report = _report()
    text = wan_report.format_markdown(report)
    rows = [line for line in text.splitlines() if line.startswith("| 100mbit veth (tbf) |")]
    assert len(rows) == len(report["results"]) == 6
    assert sum("| **0.002** |" in row for row in rows) == 4 and sum("| 0.004 |" in row for row in rows) == 2
    assert "DiLoCo H=50, no sync | **0.002** |" in text
    assert "each at its best lr (DDP 0.002, DiLoCo 0.002)" in text
    assert "DiLoCo's steps/s is 0.980× those of the same run with no communication" in text


def test_trials_rerun_the_kept_runs_interleaved_and_each_ratio_is_the_median_of_the_trials():
    report = _report()
    first, kept = report["results"], wan_report.best_runs(report["results"])
    no_sync_ratio = {1: 0.90, 2: 0.95}  # planted: DiLoCo's steps/s over the no-sync run's, trials 1 and 2
    calls = []

    def again(engine, lr, trial):
        calls.append((engine, lr, trial))
        r = copy.deepcopy(next(k for k in kept if k["engine"] == engine))
        if engine == "nocomm":
            r["train_s"] = no_sync_ratio[trial] * next(k for k in kept if k["engine"] == "diloco")["train_s"]
        return r

    more = wan.repeat_kept(first, 3, again)
    order = [(r["engine"], r["lr"]) for r in kept]
    assert calls == [(*run, 1) for run in order[::-1]] + [(*run, 2) for run in order]  # reversed every other trial
    assert [r["trial"] for r in more] == [1] * 4 + [2] * 4
    report["results"] = first + more
    assert wan_report.best_runs(report["results"]) == kept  # the sweep's runs stay the kept ones
    s = wan_report.compare(report["results"])["shaped"]
    assert s["trials"] == 3
    assert s["diloco_over_nocomm"] == pytest.approx(0.95)  # of 0.98, 0.90, 0.95: not the first, nor the mean
    assert s["diloco_over_nocomm_range"] == pytest.approx([0.90, 0.98])
    text = wan_report.format_markdown(report)
    rows = [line for line in text.splitlines() if line.startswith("| 100mbit veth (tbf) |")]
    assert len(rows) == 6 and sum("3 trials)" in row for row in rows) == 4  # the kept rows, with their range
    assert "0.950× those of the same run with no communication (the median of 3 interleaved trials; 0.900× to" in text


def test_a_benchmark_with_trials_gives_every_run_a_directory_of_its_own(monkeypatch, tmp_path):
    planted = {r["engine"]: r for r in wan_report.best_runs(_report()["results"])}
    outs = []

    def run_one(engine, link, args, out, lr):
        outs.append(out)
        return {**copy.deepcopy(planted[engine]), "engine": engine, "shaped": bool(link), "lr": lr}

    monkeypatch.setattr(wan, "run_one", run_one)
    report = wan.run_bench(_args(link="shaper", latency="20ms", trials=3), tmp_path)
    assert len(outs) == len(set(outs)) == 9  # DDP, DiLoCo and the no-sync run, 3 trials each
    assert [r.get("trial", 0) for r in report["results"]] == [0] * 3 + [1] * 3 + [2] * 3
    assert report["meta"]["trials"] == 3 and report["summary"]["shaped"]["trials"] == 3
    assert "--trials 3" in report["meta"]["command"]
