"""The benchmark tables in docs/performance.md are exactly what their committed
JSON (docs/bench/*.json) renders to, figure for figure; training JSON keeps its raw samples, and
collectives JSON rows are consistent with their own timings and the collectives' switch point.

So a table cannot drift from its data: edit a figure by hand, or change the JSON without
`nanoddp bench render`, and this fails. Nothing is run or measured here.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from nanoddp.bench.render import BLOCK, DEFAULT_FILES, render_text
from nanoddp.bench.report import results_of
from nanoddp.cli import main

ROOT = Path(__file__).resolve().parents[2]
JSON_FILES = sorted((ROOT / "docs" / "bench").glob("*.json"))
TRAIN_JSON = [p for p in JSON_FILES if not p.name.startswith("collectives")]  # bench train's files
COLLECTIVES_JSON = [p for p in JSON_FILES if p.name.startswith("collectives")]


@pytest.mark.parametrize("name", DEFAULT_FILES)
def test_every_table_is_what_its_json_renders_to(name):
    text = (ROOT / name).read_text()
    blocks = list(BLOCK.finditer(text))
    assert blocks, f"{name} has no <!-- bench:... --> block"
    for block in blocks:
        assert (ROOT / block["file"]).is_file(), block["file"]
    assert render_text(text, ROOT) == text, f"{name} is out of date: run `nanoddp bench render`"


@pytest.mark.parametrize("path", COLLECTIVES_JSON, ids=lambda p: p.name)
def test_committed_collectives_json_is_consistent(path):
    """Each row's ratio is its two busbw figures' quotient, and its path is what the
    collectives' own switch point gives for that op, size and world size."""
    from nanoddp.bench.collectives import BUSBW_FACTOR, comm_path

    data = json.loads(path.read_text())
    meta = data["meta"]
    assert meta["command"].startswith("nanoddp bench collectives") and len(meta["load_average_before"]) == 3
    for row in data["results"]:
        ours, theirs = (row["size_bytes"] / (row[f"{impl}_time_us"] * 1e-6) / 1e9 for impl in ("nanoddp", "torch"))
        factor = BUSBW_FACTOR[row["op"]](row["world_size"])
        assert row["busbw_ratio"] == pytest.approx((ours * factor) / (theirs * factor), rel=1e-9)
        samples = row["samples_us"]  # the table's ratio: torch ÷ ours, paired per iteration, median
        pairs = zip(samples["torch"], samples["nanoddp"], strict=True)
        assert row["paired_ratio"] == pytest.approx(statistics.median(t / o for t, o in pairs), rel=1e-9)
        assert row["path"] == comm_path(row["op"], row["size_bytes"], row["world_size"])


@pytest.mark.parametrize("path", TRAIN_JSON, ids=lambda p: p.name)
def test_committed_json_keeps_the_raw_samples_its_rows_come_from(path):
    data = json.loads(path.read_text())
    meta = data["meta"]
    assert meta["command"].startswith("nanoddp bench train") and len(meta["load_average_before"]) == 3
    assert meta["torch"] and meta["python"] and meta["cpu"] and meta["date"]
    for n, per_rank in data["raw"].items():
        assert len(per_rank) == int(n)  # one entry per rank
        for engine, record in per_rank[0].items():
            assert len(record["samples"]) == meta["steps"], (n, engine)
    assert results_of(data) == data["results"]  # the stored rows are the raw samples' summary


def test_render_check_fails_on_a_hand_edited_table_and_render_restores_it(tmp_path, capsys):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    doc = tmp_path / "docs" / "performance.md"
    good = doc.read_text()
    row = next(line for line in good.splitlines() if line.startswith("| nanoddp | 2 |"))
    cells = row.split(" | ")
    cells[2] = "999.9"  # samples/s, edited by hand
    doc.write_text(good.replace(row, " | ".join(cells)))
    args = ["bench", "render", str(doc), "--root", str(tmp_path)]
    assert main([*args, "--check"]) == 1 and "out of date" in capsys.readouterr().out
    assert main(args) == 0
    assert doc.read_text() == good
