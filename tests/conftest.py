"""pytest setup: make `helpers` (and the test modules spawned workers import by name) importable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # spawned workers import `helpers` and test modules by name
    sys.path.insert(0, str(TESTS_DIR))

from helpers import FORKSERVER_PRELOAD, run_on_ranks  # noqa: E402  (needs TESTS_DIR on sys.path)

from nanoddp import fork_server  # noqa: E402

fork_server.preload(FORKSERVER_PRELOAD)  # the server starts at the first launch


@pytest.fixture
def on_ranks():
    return run_on_ranks


@pytest.fixture(scope="module")
def cpu_processes():
    """The processes a module's tests start see no GPU. For runs compared bitwise with a CPU
    replay: on a machine with one GPU, a namespace host of one process would otherwise train on
    it over nccl (each process that can own a GPU does, as torchrun's workers do)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


# The files that take longest (busy CI's --durations, summed per file), longest first. With the
# suite's `--dist loadfile --no-loadscope-reorder`, xdist hands out whole files in collection
# order, so these start at once and the many short files fill the gaps beside them, instead of
# one long file starting last and running alone at the end. A file missing here only runs later.
# Except: the three files that load SmolLM2-135M are spread out (first, eleventh, seventeenth): side
# by side they compete for the cores and memory, and each took twice as long.
LONGEST_FILES_FIRST = (
    "multiproc/test_smollm2.py",
    "multiproc/test_torchrun.py",
    "examples/test_examples.py",
    "multiproc/test_ft_guards.py",
    "multiproc/test_multinode_hosts.py",
    "multiproc/test_ft_sharded.py",
    "multiproc/test_ft_engines.py",
    "reliability/test_reliability_leftovers.py",
    "multiproc/test_ft.py",
    "multiproc/test_ft_rounds.py",
    "examples/test_example_smollm2.py",
    "multiproc/test_launch.py",
    "multiproc/test_notebook_launch.py",
    "multiproc/test_comm_algorithms.py",
    "multiproc/test_ft_hosts.py",
    "multiproc/test_trainer_sharded.py",
    "multiproc/test_notebook.py",
    "multiproc/test_user_trainer.py",
    "multiproc/test_notebook_interrupt.py",
    "examples/test_examples_hf.py",
    "multiproc/test_comm.py",
    "multiproc/test_run.py",
    "multiproc/test_fsdp_engine.py",
    "reliability/test_loopback.py",
    "reliability/test_run_lifecycle.py",
    "multiproc/test_bench_wan.py",
    "reliability/test_orphans.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gone = [name for name in LONGEST_FILES_FIRST if not (TESTS_DIR / name).exists()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES_FIRST names files that are gone: {gone}")
    rank = {name: place for place, name in enumerate(LONGEST_FILES_FIRST)}

    def place(item: pytest.Item) -> int:
        return rank.get(Path(item.path).relative_to(TESTS_DIR).as_posix(), len(rank))

    items.sort(key=place)  # stable: the rest keep their order, and each file its tests' order
