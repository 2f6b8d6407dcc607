"""The probe table: each probe registers its number, case and expected outcome with `@probe`,
and each run of one becomes a `Row`.

The families (`run_dir`, `interrupts`, ...) register on import, in the order the runner
imports them, which is the order of the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .context import Ctx


@dataclass
class Probe:
    num: str
    case: str
    expected: str
    fn: Callable[[Ctx], tuple[bool | None, str]]


@dataclass
class Row:
    num: str
    case: str
    expected: str
    outcome: str
    verdict: str  # OK, FAIL, SKIP
    seconds: float


PROBES: list[Probe] = []


def probe(num: str, case: str, expected: str):
    def register(fn: Callable[[Ctx], tuple[bool | None, str]]) -> Callable[[Ctx], tuple[bool | None, str]]:
        PROBES.append(Probe(num, case, expected, fn))
        return fn

    return register
