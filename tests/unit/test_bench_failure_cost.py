"""`nanoddp bench restarts`' failure-cost part: its refusals and how it reads a run's progress.
(The measurement itself runs real 3-rank trainings, minutes long: its figures are committed under
docs/bench/ft/, not re-measured here.)"""

from __future__ import annotations

import json

import pytest

from nanoddp.bench.failure_cost import _logged_step
from nanoddp.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trials", "0", "--cost-trials", "0"], "not both 0"),
        (["--cost-trials", "-1"], "must be >= 0"),
    ],
)
def test_bad_counts_are_one_line(argv, message, capsys):
    assert main(["bench", "restarts", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_kill_waits_for_the_newest_logged_step(tmp_path):
    assert _logged_step(tmp_path) == 0  # no metrics.jsonl yet
    records = [
        {"step": 10, "loss": 2.0, "world_size": 3},
        {"event": "rank_lost", "step": 11, "world_size": 2},  # an event is not a step record
        {"step": 20, "loss": 1.5, "world_size": 2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _logged_step(tmp_path) == 20
