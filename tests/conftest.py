"""Shared test helpers: run a function on N gloo processes, with a timeout and clean teardown."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import nanoddp

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # spawned workers import test modules by name
    sys.path.insert(0, str(TESTS_DIR))


def _single_threaded(fn, env, *args):
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks: oversubscription is the enemy
    return fn(env, *args)


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(env, *args)` on `world_size` gloo processes; return every rank's result.

    Any rank's exception is re-raised here as `nanoddp.LaunchError` carrying its traceback, and
    every child is stopped before this returns, pass or fail.
    """
    return nanoddp.launch(
        functools.partial(_single_threaded, fn), world_size, args=args, backend="gloo", timeout=timeout
    )


@pytest.fixture
def on_ranks():
    return run_on_ranks
