"""The README's teaching table stays true: each file it names exists and has the size it says.

The "What each rank holds" table sends a learner to one file per strategy with its length, so
they know what they are about to read; a file that moves or grows would make that a lie
nobody notices. Paths in the table are relative to `nanoddp/` (a bare name continues the
previous path's folder: `unit.py` after `parallel/fsdp/fully_shard.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZE_CLAIM = re.compile(r"`([\w/.]+\.py)` \((?:SimpleDDP, )?(\d+) lines\)")


def _table() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## What each rank holds")
    return text[start : text.index("\n## ", start + 1)]


def test_every_file_the_teaching_table_names_has_the_size_it_says():
    claims = SIZE_CLAIM.findall(_table())
    assert len(claims) >= 5, f"the table's size claims were not found (pattern broke?): {claims}"
    wrong, folder = [], ""
    for name, lines in claims:
        rel = name if "/" in name else f"{folder}/{name}"
        folder = rel.rsplit("/", 1)[0]
        path = ROOT / "nanoddp" / rel
        if not path.is_file():
            wrong.append(f"{rel}: no such file")
        elif (actual := len(path.read_text().splitlines())) != int(lines):
            wrong.append(f"{rel}: README says {lines} lines, the file has {actual}")
    assert not wrong, "README's 'What each rank holds' is stale:\n" + "\n".join(wrong)


def test_the_reading_order_starts_with_simple_ddp():
    text = (ROOT / "README.md").read_text()
    order = text[text.index("## Read the code in this order") :]
    first = re.search(r"^1\. `([^`]+)`", order, re.M)
    assert first and first.group(1) == "nanoddp/parallel/manual.py", first
