"""What a request to the notebook pool yields: output as it comes, to a sink, and a
`CellOutcome` at the end.

The pool knows nothing of IPython: a `Sink` (`stream(rank, name, text)`, `display(rank,
bundle)`) decides how output looks, and the outcome says, per rank, what the cell did, so the
magics decide how a failure reads. Kept apart from the pool so both sides share these types
without importing each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a request's output goes while it runs."""

    def stream(self, rank: int, name: str, text: str) -> None: ...

    def display(self, rank: int, bundle: dict[str, Any]) -> None: ...


@dataclass
class CellOutcome:
    """How one request went on each rank it ran on."""

    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> the worker's report
    died: dict[int, str] = field(default_factory=dict)  # rank -> why it died mid-cell
    interrupted: bool = False  # the user interrupted the kernel
    timed_out: bool = False
    rebuilt: int | None = None  # the new process group's generation, when the cell's was rebuilt
    recovery_error: str | None = None  # why the group could not be rebuilt (the pool is unusable)

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks whose code raised or whose process died (not the ones stopped because of them)."""
        raised = {rank for rank, report in self.reports.items() if report["status"] == "error"}
        return sorted(raised | set(self.died))


class Drop:
    """A sink for output nobody asked to see."""

    def stream(self, rank: int, name: str, text: str) -> None:
        logger.debug("rank %d %s: %s", rank, name, text.rstrip())

    def display(self, rank: int, bundle: dict[str, Any]) -> None:
        logger.debug("rank %d display: %s", rank, bundle.get("text/plain", ""))


DROP = Drop()
