"""What `nanoddp bench wan` runs over each link, checked without running it.

- `--link netns`: the two nodes' `nanoddp train` commands are accepted by `nanoddp train`'s own
  checks (`check_train_argv`) and give the same config but for the run dir, which differs; they
  name the same endpoint, rendezvous id and node count, one process each, node ranks 0 and 1 (what
  docs/multinode.md asks of a multi-node launch). `--link shaper`: one command, 2 processes here.
- The default link: netns where namespaces can be made, else the shaper, with the reason.
- The table and summary over a report with torch's DDP: a torch row, and its training time over
  DiLoCo's and ours derived from the rows (reference: a torch row that copies DDP's figures must
  come out at 1.0× ours and at DDP's own speedup over DiLoCo).

The kernel link itself is measured in tests/reliability/test_netns_link.py; a whole run through
`bench wan` (under the shaper) in tests/multiproc/test_bench_wan.py; a node failing under netns in
tests/reliability/test_bench_refusals.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import pytest

from nanoddp.bench import wan, wan_report
from nanoddp.train.launcher.cli import check_train_argv

ROOT = Path(__file__).resolve().parents[2]
TRAIN_ARGS = "--d-model 32 --n-layers 1 --n-heads 2 --d-ff 64 --text-max-bytes 20000 --batch-size 4 --seq-len 16"


def _args(**overrides) -> argparse.Namespace:
    fields = {"steps": 4, "sync_every": 2, "eval_every": 2, "eval_samples": 16, "seed": 3, "train_args": TRAIN_ARGS,
              "link": "netns", "bandwidth": "100mbit", "latency": None, "no_unshaped": True, "lrs": None,
              **dict.fromkeys(wan.DILOCO_FLAGS)}  # fmt: skip
    return argparse.Namespace(**{**fields, **overrides})


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def _train_flags(argv: list[str]) -> list[str]:
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["nanoddp", "train"], argv
    return argv[argv.index("-m") + 3 :]


@pytest.mark.parametrize("engine", wan.ENGINES["netns"])
def test_the_two_nodes_make_one_job_of_one_process_each(engine, tmp_path):
    endpoint = "10.201.7.1:29503"
    nodes = [_train_flags(argv) for argv in wan.node_argvs(engine, _args(), tmp_path / "run", endpoint)]
    configs = [check_train_argv(flags) for flags in nodes]
    assert configs[0].out != configs[1].out and configs[0].out == str(tmp_path / "run")
    assert dataclasses.replace(configs[1], out=configs[0].out) == configs[0]
    assert configs[0].engine == wan.TRAIN_ENGINE.get(engine, engine) and configs[0].steps == 4 and configs[0].seed == 3
    for rank, flags in enumerate(nodes):
        assert _flag(flags, "--node-rank") == str(rank) and _flag(flags, "--nproc") == "1"
        assert _flag(flags, "--nnodes") == "2" and _flag(flags, "--rdzv-endpoint") == endpoint
        assert _flag(flags, "--rdzv-id") == "wan" and "--overwrite" not in flags


def test_under_the_shaper_both_ranks_run_here(tmp_path):
    flags = _train_flags(wan.train_argv("diloco", _args(link="shaper"), tmp_path / "run"))
    config = check_train_argv(flags)
    assert config.engine == "diloco" and config.sync_every == 2
    assert _flag(flags, "--nproc") == "2" and "--nnodes" not in flags and "--rdzv-endpoint" not in flags


def test_a_torch_row_renders_with_its_ratios_derived_from_the_rows():
    report = json.loads((ROOT / "docs/bench/wan/wan-2026-11-28.json").read_text())
    report["meta"]["link"], report["meta"]["latency"] = "netns", None
    for shaped in (True, False):
        ddp = next(r for r in report["results"] if r["engine"] == "nanoddp" and r["shaped"] == shaped)
        report["results"].append({**copy.deepcopy(ddp), "engine": "torch"})
    summary = wan_report.compare(report["results"])
    for s in summary.values():
        assert s["torch_ddp_over_nanoddp"] == 1.0
        assert s["torch_ddp_over_diloco"] == s["train_time_speedup"]
        assert s["time_to_ddp_final_s"]["torch"] == s["time_to_ddp_final_s"]["nanoddp"]
    text = wan_report.format_markdown(report)
    assert text.count("| 100mbit veth (tbf) | DDP (`torch`) |") == 1 and text.count("| veth, full speed |") == 3
    assert text.count("and 1.0× ours.") == 2


@pytest.mark.parametrize("reason, link", [(None, "netns"), ("making network namespaces needs root", "shaper")])
def test_the_default_link_is_netns_where_it_can_be_made_and_says_why_otherwise(reason, link, monkeypatch):
    monkeypatch.setattr(wan, "shaping_unavailable_reason", lambda: reason)
    chosen, why = wan.choose_link(None)
    assert chosen == link and why is not None and (reason is None or reason in why)
    assert wan.choose_link("shaper") == ("shaper", None)  # asked for: nothing to say
