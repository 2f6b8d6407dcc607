"""`nanoddp bench restarts --hosts N`: its refusals before any work, and its summary of the
committed measurement. (The measurement itself runs real trainings on namespace hosts, minutes
long: its figures are committed under docs/bench/ft/, not re-measured here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoddp.bench import host_failure_cost
from nanoddp.bench.host_failure_cost import MODE_ARGS, describe, summarize

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "ft"


@pytest.mark.parametrize(
    "name", ["host-failure-cost-2026-11-30.json", "host-failure-cost-hsdp-2026-12-01.json"]
)  # one rank per host; 2 processes per host training hsdp (each host one replica group)
def test_the_summary_and_report_of_the_committed_measurement(name):
    """The real records of `nanoddp bench restarts --trials 0 --cost-trials 3 --hosts 2` (and
    `--host-nproc 2 --host-engine hsdp`): modes interleaved trial by trial, the summary recomputed
    from them, one line per mode and the ratio."""
    report = json.loads((MEASURED / name).read_text())["host_failure_cost"]
    trials = report["meta"]["trials"]
    assert [(r["trial"], r["mode"]) for r in report["results"]] == [(t, m) for t in range(trials) for m in MODE_ARGS]
    summary = summarize(report["results"])
    assert summary == report["summary"]
    stalls = sorted(r["stall_s"] for r in report["results"] if r["mode"] == "continue")
    assert summary["continue"]["median_stall_s"] == stalls[len(stalls) // 2]
    ratio = summary["continue"]["median_stall_s"] / summary["restart"]["median_cost_s"]
    assert summary["continue_stall_over_restart_cost"] == round(ratio, 3)
    lines = describe(report).splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "--on-failure restart", "--on-failure continue", "continue's stall / restart's cost"
    ]  # fmt: skip
    assert f"{summary['restart']['median_cost_s']:.1f} s" in lines[0] and f"{ratio:.3f}" in lines[2]


def test_fewer_than_two_hosts_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(host_failure_cost, "unavailable_reason", lambda: None)
    with pytest.raises(ValueError, match=r"--hosts 1: losing a host takes at least 2"):
        host_failure_cost.check(1)
    monkeypatch.setattr(host_failure_cost, "unavailable_reason", lambda: "making network namespaces needs root")
    with pytest.raises(ValueError, match=r"--hosts needs network namespaces, and making network namespaces needs root"):
        host_failure_cost.check(2)


@pytest.mark.parametrize("flags", [["--host-nproc", "2"], ["--host-engine", "hsdp"]])
def test_host_layout_flags_need_hosts(flags, capsys):
    """`--host-nproc` and `--host-engine` shape the namespace hosts: without `--hosts`, one line
    and exit 2, before any work."""
    from nanoddp.cli import main

    assert main(["bench", "restarts", "--trials", "0", "--cost-trials", "1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    want = "--host-nproc and --host-engine shape the hosts of --hosts N: give --hosts, or drop them"
    assert err == f"nanoddp bench restarts: error: {want}", err
