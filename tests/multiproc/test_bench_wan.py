"""`nanoddp bench wan` end to end at a tiny setting: the plumbing and the bookkeeping, not the timings.

One run under the in-process shaper (`--link shaper`; a 1-block GPT, 4 steps, DiLoCo H=2, a 50 ms
link, the unshaped pair skipped) feeds every check: the JSON has its keys and each run's figures
agree with its own metrics (the curve's last loss is the final loss, training time within wall
time); the link reached the runs (every DDP step waits at least one latency); DiLoCo sends about 1/H
of DDP's bytes (one pseudo-gradient every H steps against one gradient every step, both a whole
model's worth at 2 ranks) and the no-communication run none; the table renders from the JSON; the
plot is a PNG. (Its refusals of bad
input are in tests/reliability/test_bench_refusals.py; the kernel link of `--link netns` in
tests/reliability/test_netns_link.py, the commands it runs in tests/unit/test_bench_wan_link.py.)
"""

from __future__ import annotations

import json

import pytest

from nanoddp.bench.render import render_text
from nanoddp.cli import main

STEPS, H, LATENCY_S = 4, 2, 0.05
TRAIN_ARGS = "--d-model 32 --n-layers 1 --n-heads 2 --d-ff 64 --text-max-bytes 20000 --batch-size 4 --seq-len 16"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_wan")
    argv = ["bench", "wan", "--link", "shaper", "--steps", str(STEPS), "--sync-every", str(H), "--eval-every", "2",
            "--eval-samples", "16", "--bandwidth", "1gbit", "--latency", "50ms", "--no-unshaped", "--train-args",
            TRAIN_ARGS, "--json", str(tmp / "wan.json"), "--plot", str(tmp / "wan.png")]  # fmt: skip
    assert main(argv) == 0
    return json.loads((tmp / "wan.json").read_text()), tmp


def test_json_keys_and_each_runs_figures_agree(report):
    data, _ = report
    assert {"meta", "results", "summary"} <= data.keys()
    assert [(r["engine"], r["shaped"]) for r in data["results"]] == [("nanoddp", True), ("diloco", True),
                                                                      ("nocomm", True)]  # fmt: skip
    for r in data["results"]:
        assert r["steps"] == STEPS and [p[0] for p in r["curve"]] == [2, 4]
        assert r["final_val_loss"] == r["curve"][-1][2]
        assert 0 < r["curve"][0][1] < r["curve"][1][1] < r["wall_s"]
        assert r["curve"][1][1] == pytest.approx(r["train_s"])  # the last evaluation is at the last step
    assert set(data["summary"]) == {"shaped"}
    summary = data["summary"]["shaped"]
    assert summary["time_to_ddp_final_s"]["nanoddp"] is not None  # DDP reaches its own final loss, by definition
    assert summary["common_val_loss"] == max(r["final_val_loss"] for r in data["results"][:2])
    assert summary["diloco_over_nocomm"] == data["results"][2]["train_s"] / data["results"][1]["train_s"]
    assert None not in summary["time_to_common_s"].values()  # each reaches the worse of the two finals


def test_the_link_reaches_the_runs(report):
    ddp = report[0]["results"][0]
    assert ddp["train_s"] >= STEPS * LATENCY_S, f"{STEPS} DDP steps took {ddp['train_s']:.3f}s on a 50 ms link"


def test_diloco_sends_about_one_h_th_of_ddps_bytes_and_the_no_communication_run_none(report):
    ddp, diloco, nocomm = report[0]["results"]
    assert 0 < diloco["comm_bytes"] < ddp["comm_bytes"] and nocomm["comm_bytes"] == 0
    # headers and bucket boundaries differ a little between the two; the payloads are equal
    assert report[0]["summary"]["shaped"]["bytes_ratio"] == pytest.approx(H, rel=0.1)


def test_the_table_renders_from_the_json_and_the_plot_is_a_png(report):
    data, tmp = report
    text = f"<!-- bench:table {tmp.name}/wan.json -->\n<!-- /bench -->"
    rendered = render_text(text, tmp.parent)
    assert rendered.count("| 1gbit, 50ms |") == 3 and "DiLoCo H=2 |" in rendered and "DiLoCo H=2, no sync |" in rendered
    assert f"{data['results'][1]['final_val_loss']:.4f}" in rendered
    assert (tmp / "wan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
