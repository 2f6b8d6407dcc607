"""How a distributed cell looks in the notebook: live `[rank k]` streams, rich output from one
rank, each rank's last value, the failure types IPython shows, and the status table.

Kept apart from the magics so the look of a cell can change without touching how cells are
run, and so the pool (which knows nothing of IPython) has one sink to write to.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any


class DistributedCellError(RuntimeError):
    """A distributed cell failed on at least one rank; shows each failing rank's traceback."""

    def __init__(self, summary: str, details: dict[int, str]):
        super().__init__(summary)
        self.details = details  # rank -> traceback (or why it died)

    def _render_traceback_(self) -> list[str]:
        """IPython calls this instead of printing our own (uninteresting) kernel-side frames."""
        lines = [f"{type(self).__name__}: {self}"]
        for rank, text in sorted(self.details.items()):
            lines.append(f"\n----- rank {rank} -----")
            lines.extend(prefix_lines(text.rstrip("\n"), rank).splitlines())
        return lines


class CellInterrupted(KeyboardInterrupt):
    """The user interrupted a distributed cell; the workers stopped it and stay usable."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def prefix_lines(text: str, rank: int) -> str:
    return "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))


class CellRenderer:
    """Turns worker messages into cell output: prefixed live streams, rich display, results."""

    def __init__(self, display_rank: int):
        self.display_rank = display_rank
        self._at_line_start: dict[tuple[int, str], bool] = {}

    def stream(self, rank: int, name: str, text: str) -> None:
        out = sys.stderr if name == "stderr" else sys.stdout
        prefix = f"[rank {rank}] "
        at_start = self._at_line_start.get((rank, name), True)
        pieces = []
        for line in re.split(r"(?<=\n)", text):
            if not line:
                continue
            if at_start:
                pieces.append(prefix)
            # A progress bar redraws its line with '\r': keep the prefix on the redrawn line.
            pieces.append(re.sub(r"\r(?!\n)(?=.)", "\r" + prefix, line))
            at_start = line.endswith("\n")
        self._at_line_start[(rank, name)] = at_start
        out.write("".join(pieces))

    def display(self, rank: int, bundle: dict[str, Any]) -> None:
        if rank == self.display_rank and set(bundle) - {"text/plain"}:
            from IPython.display import display

            sys.stdout.flush()  # keep the order: text printed before the figure comes first
            display(bundle, raw=True)
        else:
            self.stream(rank, "stdout", bundle.get("text/plain", "") + "\n")

    def results(self, reports: dict[int, dict[str, Any]]) -> None:
        """Each rank's last-expression value, in rank order once all are in."""
        for rank in sorted(reports):
            if reports[rank].get("result"):
                self.display(rank, reports[rank]["result"])
        sys.stdout.flush()
        sys.stderr.flush()


def format_status(rows: Sequence[dict[str, Any]]) -> str:
    """The %dist_status / %dist_init table, then each rank's process group generation."""
    table = [("rank", "pid", "device", "state", "memory")]
    for row in rows:
        memory = "-" if row["rss_mib"] is None else f"{row['rss_mib']:.0f} MiB"
        table.append((str(row["rank"]), str(row["pid"]), row["device"], row["state"], memory))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table]
    groups = [f"rank {row['rank']} {_generation(row.get('generation'))}" for row in rows]
    return "\n".join([*lines, "process group: " + ", ".join(groups)])


def _generation(generation: int | None) -> str:
    if generation is None:
        return "unknown"
    if generation == 0:
        return "none (left its group)"
    return f"generation {generation}" + (" (rebuilt)" if generation > 1 else "")
