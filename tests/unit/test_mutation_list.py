"""`tools/mutations.py` stays in step with the code: every planted fault still applies.

A fault whose text moved or changed would be reported "not applied" by `tools/mutate.py`, which
nobody sees unless the long run is made; here it fails the suite at once, naming the entry.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from mutations import MUTATIONS  # noqa: E402  (tools/ is not a package)


def test_every_fault_applies_once_and_names_a_test_that_exists():
    problems = []
    for m in MUTATIONS:
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its text occurs {count} times in {m.path}")
        if m.new == m.old:
            problems.append(f"{m.name}: the replacement changes nothing")
        test_file = m.test[0].split("::")[0]
        if not (ROOT / test_file).is_file():
            problems.append(f"{m.name}: no test file {test_file}")
    assert problems == []
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS), "fault names are unique"
