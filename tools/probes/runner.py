"""The driver: run the chosen probes one at a time, each in its own context, and print the
markdown table (optionally the rows as JSON).

A probe that cannot reach the state it checks is a failed row, not a crash, so one broken
setup does not hide the other verdicts.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .context import Ctx, close_all, short
from .registry import PROBES, Probe, Row

DESCRIPTION = "Reliability probes: nanoddp used the way a careless or unlucky user would use it."
# The probe families, in table order: each registers its probes when imported.
FAMILIES = (
    "run_dir",
    "interrupts",
    "collectives",
    "before_workers",
    "private",
    "no_leftovers",
    "run_lifecycle",
    "saved_state",
    "sharded_state",
    "trainer_ownership",
    "orphans",
    "hostile_writes",
)
for family in FAMILIES:
    importlib.import_module(f"{__package__}.{family}")


def run_probe(item: Probe) -> Row:
    ctx = Ctx()
    started = time.monotonic()
    try:
        ok, outcome = item.fn(ctx)
        verdict = "SKIP" if ok is None else "OK" if ok else "FAIL"
    except Exception as exc:  # a probe that cannot reach its state is a failed row, not a crash
        verdict, outcome = "FAIL", f"probe error: {type(exc).__name__}: {short(str(exc), 400)}"
    finally:
        ctx.close()
    return Row(item.num, item.case, item.expected, outcome, verdict, round(time.monotonic() - started, 1))


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: list[Row]) -> str:
    lines = ["| # | case | expected | outcome | verdict |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.num} | {cell(row.case)} | {cell(row.expected)} | {cell(row.outcome)} | {row.verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    parser.add_argument("--only", metavar="TEXT", help="run only the cases whose number or name contains TEXT")
    args = parser.parse_args(argv)
    chosen = [p for p in PROBES if not args.only or args.only.lower() in f"{p.num} {p.case}".lower()]
    if not chosen:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    atexit.register(close_all)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the cleanup
    started = time.monotonic()
    rows = []
    try:
        for item in chosen:
            print(f"[{item.num}] {item.case} ...", file=sys.stderr, flush=True)
            rows.append(run_probe(item))
            print(f"[{item.num}] {rows[-1].verdict} ({rows[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    finally:
        close_all()
    total = time.monotonic() - started
    counts = {v: sum(r.verdict == v for r in rows) for v in ("OK", "FAIL", "SKIP")}
    print(table(rows))
    print(f"\n{counts['OK']} OK, {counts['FAIL']} FAIL, {counts['SKIP']} skipped; {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
