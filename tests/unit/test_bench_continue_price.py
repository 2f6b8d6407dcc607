"""`nanoddp bench continue-price`: its summary of the committed measurement, and its refusal of an
engine it does not measure. (The measurement itself is 24 real trainings, minutes long: its
figures are committed under docs/bench/ft/, not re-measured here.)"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from nanoddp.bench.continue_price import ENGINES, MODES, markdown_table, summarize
from nanoddp.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "docs" / "bench" / "ft"


@pytest.mark.parametrize("name", ["continue-price-2026-11-30.json", "continue-price-groups-2026-12-01.json"])
def test_the_summary_and_report_of_the_committed_measurement(name):
    """The real records of `nanoddp bench continue-price --trials 3` (and `--trials 2 --nproc 6
    --group-size 2`): every engine in both modes in every trial, the mode that goes first
    alternating, and the summary recomputed from them."""
    report = json.loads((MEASURED / name).read_text())
    trials = report["meta"]["trials"]
    order = [(r["trial"], r["engine"], r["mode"]) for r in report["results"]]
    assert order == [(t, e, m) for t in range(trials) for e in ENGINES for m in (MODES if t % 2 == 0 else MODES[::-1])]
    summary = summarize(report["results"])
    assert summary == report["summary"]
    for engine in ENGINES:
        times = {m: [r["step_time_s"] for r in report["results"] if (r["engine"], r["mode"]) == (engine, m)]
                 for m in MODES}  # fmt: skip
        ratio = statistics.median(times["continue"]) / statistics.median(times["restart"])
        assert summary[engine]["step_time_ratio"] == round(ratio, 3)
        low, high = summary[engine]["step_time_ratio_range"]
        assert low <= high
    rows = markdown_table(report).splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == list(ENGINES)
    assert f"| {summary['nanoddp']['step_time_ratio']:.2f} (" in rows[0]
    assert markdown_table(report) in (ROOT / "docs" / "ft.md").read_text(), "docs/ft.md's table is not its JSON's"


def test_an_engine_it_does_not_measure_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["bench", "continue-price", "--engines", "nanoddp,fsdp"])
    assert stopped.value.code == 2
    assert "--engines takes names from nanoddp,zero1,zero2,hsdp" in capsys.readouterr().err
