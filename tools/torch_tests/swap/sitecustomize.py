"""Run torch's own DDP and FSDP2 tests with nanoddp's classes in place of torch's.

Why a `sitecustomize`: torch's tests spawn their ranks as fresh Python processes (and the
threaded ones run in the pytest process); every one of them runs `sitecustomize` at start-up
when this folder is on PYTHONPATH, so the swap holds in each rank before a test imports a name.
`tools/torch_tests/run.py` sets the environment; on its own this file does nothing.

Environment:
  NANODDP_TORCH_TESTS=1        on: enable torch's FSDP tests on CPU (both runs, same footing)
  NANODDP_TORCH_TESTS_SWAP=1   also swap torch's public DDP/FSDP2 names for nanoddp's
  NANODDP_TORCH_TESTS_LOG=PATH append one JSON line per test run in a rank, saying which
                               DistributedDataParallel and fully_shard that rank saw
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys

DDP_HOMES = ("torch.nn.parallel", "torch.nn.parallel.distributed")
FSDP_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
FSDP_NAMES = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
)
# torch modules that bind `DistributedDataParallel` at import and serve as the tests' own
# reference (FSDP2's parity tests compare against `replicate`, which wraps torch's DDP):
# imported before the swap so the reference stays torch's.
KEEP_TORCH = ("torch.distributed._composable.replicate",)


def swap_names() -> dict[str, str]:
    """Replace torch's public DDP/FSDP2 names by nanoddp's; returns {torch name: ours}.

    A name nanoddp does not provide stays torch's and is absent from the result."""
    import nanoddp
    import nanoddp.fsdp

    for name in KEEP_TORCH:
        importlib.import_module(name)
    swapped = {}
    for home in DDP_HOMES:
        importlib.import_module(home).DistributedDataParallel = nanoddp.DistributedDataParallel
        swapped[f"{home}.DistributedDataParallel"] = "nanoddp.DistributedDataParallel"
    for home in FSDP_HOMES:
        module = importlib.import_module(home)
        for name in FSDP_NAMES:
            ours = getattr(nanoddp.fsdp, name, None)
            if ours is not None and hasattr(module, name):
                setattr(module, name, ours)
                swapped[f"{home}.{name}"] = f"nanoddp.fsdp.{name}"
    return swapped


def _enable_cpu_fsdp(common_fsdp) -> None:
    # `FSDPTest._run` exits with the "needs N GPUs" skip whenever the host has fewer
    # accelerators than ranks, so on CPU every FSDPTest skips. `FSDPTestMixin._run` is the same
    # start-up with that check limited to accelerator device types: use it (gloo on CPU).
    common_fsdp.FSDPTest._run = common_fsdp.FSDPTestMixin.__dict__["_run"]


def _backport_test_names(common_utils) -> None:
    # The stored torch test files are from just after v2.13; some tag their classes with
    # `HardwareClassification`, which 2.13's common_utils lacks. Only the name is needed.
    if not hasattr(common_utils, "HardwareClassification"):
        import enum

        common_utils.HardwareClassification = enum.Enum("HardwareClassification", "GENERIC ACCELERATOR")


def _record_ranks(common_distributed) -> None:
    # Each rank of a multi-process test runs `run_test` in its own spawned process: note there
    # which classes that rank sees, so the runner can prove the swap held in every rank.
    log_path = os.environ.get("NANODDP_TORCH_TESTS_LOG")
    cls = common_distributed.MultiProcessTestCase
    original = cls.run_test

    def run_test(self, test_name, parent_pipe):
        if log_path:
            with open(log_path, "a") as log:
                log.write(json.dumps(_seen(f"{type(self).__name__}.{test_name}", self.rank)) + "\n")
        return original(self, test_name, parent_pipe)

    cls.run_test = run_test
    # The threaded test case runs its ranks as threads of this process: note those too.
    threaded = common_distributed.MultiThreadedTestCase
    original_threaded = threaded.run_test_with_threaded_pg

    def run_test_with_threaded_pg(self, test_name, rank, world_size):
        if log_path:
            with open(log_path, "a") as log:
                log.write(json.dumps(_seen(f"{type(self).__name__}.{test_name}", rank)) + "\n")
        return original_threaded(self, test_name, rank, world_size)

    threaded.run_test_with_threaded_pg = run_test_with_threaded_pg


def _seen(test: str, rank: int) -> dict:
    """Which DDP and fully_shard this process holds under torch's names."""
    import torch.nn.parallel

    fsdp = sys.modules.get("torch.distributed.fsdp")
    fully_shard = getattr(fsdp, "fully_shard", None)
    return {
        "pid": os.getpid(),
        "test": test,
        "rank": rank,
        "ddp": torch.nn.parallel.DistributedDataParallel.__module__,
        "fully_shard": getattr(fully_shard, "__module__", None),
    }


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `action(module)` right after the named module first executes."""

    def __init__(self, actions: dict) -> None:
        self.actions = actions

    def find_spec(self, name, path, target=None):
        action = self.actions.get(name)
        if action is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_act(module):
            exec_module(module)
            action(module)

        spec.loader.exec_module = exec_then_act
        return spec


if os.environ.get("NANODDP_TORCH_TESTS") == "1":
    sys.meta_path.insert(
        0,
        _AfterImport(
            {
                "torch.testing._internal.common_fsdp": _enable_cpu_fsdp,
                "torch.testing._internal.common_distributed": _record_ranks,
                "torch.testing._internal.common_utils": _backport_test_names,
            }
        ),
    )
    if os.environ.get("NANODDP_TORCH_TESTS_SWAP") == "1":
        swap_names()
