"""One planted fault: where, what text, its faulty replacement, and the test that must catch it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    test: tuple[str, ...]  # pytest arguments: the one file (and -k) that should catch it
