"""How a fault-tolerant run stops on purpose, rather than replacing the replica that failed.

The supervisor replaces a replica that exits non-zero: right for a lost process, wrong for a
failure that every replica meets alike and every replacement would meet again. Such a failure
is `RunStopped`: no live replica holds the committed state and there is no snapshot to resume
from, a non-finite loss under `--on-nan stop`, the same error on the same step try after try (a
bad setting, a snapshot write that fails on every replica). Every member of the group raises
it at the same point, because each decided from what the group agreed on; the replica's entry
point turns it into one line (from the group's rank 0) and `STOPPED_EXIT_CODE`, which the
supervisor never replaces: it ends the run with that code.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

STOPPED_EXIT_CODE = 3  # 1 is a crash (replaced), 2 bad input in a launcher, 128 + N a signal


class RunStopped(RuntimeError):
    """The run cannot go on, on any replica (see the module docstring). `speaker`: whether this
    process says the line (the group's rank 0), so that a run stops with one line, not one per
    replica."""

    def __init__(self, line: str, speaker: bool = True) -> None:
        super().__init__(line)
        self.speaker = speaker


def run_replica(main: Callable[[], object]) -> int:
    """Run one replica's `main`; a `RunStopped` becomes its one line and `STOPPED_EXIT_CODE`."""
    try:
        main()
    except RunStopped as stop:
        if stop.speaker:
            logger.error("%s", stop)
            sys.stderr.flush()
        return STOPPED_EXIT_CODE
    return 0


def first_line(exc: BaseException) -> str:
    """An error's first line, shortened: what a log line or a stop line quotes."""
    text = str(exc)
    return text.splitlines()[0][:200] if text.strip() else type(exc).__name__


def failure_text(line: str) -> str:
    """`line` with its memory addresses masked: the same failure on a retry names a new object
    (each try's group is new), and must still count as the same (`FaultTolerant._count_failure`)."""
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", line)
