"""pytest setup: make `helpers` (and the test modules spawned workers import by name) importable."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # spawned workers import `helpers` and test modules by name
    sys.path.insert(0, str(TESTS_DIR))

from helpers import FORKSERVER_PRELOAD, run_on_ranks  # noqa: E402  (needs TESTS_DIR on sys.path)

multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


@pytest.fixture
def on_ranks():
    return run_on_ranks
