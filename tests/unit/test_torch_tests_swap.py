"""tools/torch_tests/swap/sitecustomize.py: it imports, swaps the names it says, and stays off
unless asked. Run in a child process: the swap rebinds torch's names for the whole process."""

import json
import os
import subprocess
import sys
from pathlib import Path

SWAP_DIR = Path(__file__).resolve().parents[2] / "tools" / "torch_tests" / "swap"
PROBE = """
import json, sys, torch.nn.parallel, torch.distributed.fsdp as fsdp
swapped = sys.modules["sitecustomize"].swap_names() if "{swap}" == "1" else {{}}
print(json.dumps({{"swapped": swapped, "ddp": torch.nn.parallel.DistributedDataParallel.__module__,
                  "fully_shard": fsdp.fully_shard.__module__, "FSDPModule": fsdp.FSDPModule.__module__}}))
"""


def _probe(on: str, swap: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SWAP_DIR), "NANODDP_TORCH_TESTS": on, "NANODDP_TORCH_TESTS_SWAP": swap}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(swap=swap)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_swap_names_torch_ddp_and_fsdp2_as_ours():
    seen = _probe("1", "1")
    assert seen["ddp"].startswith("nanoddp.") and seen["fully_shard"].startswith("nanoddp.")
    assert seen["FSDPModule"].startswith("nanoddp.")
    for name in (
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "torch.distributed.fsdp.MixedPrecisionPolicy",
    ):
        assert name in seen["swapped"], name


def test_without_the_flag_torch_stays_torch():
    seen = _probe("0", "0")
    assert seen["ddp"].startswith("torch.") and seen["fully_shard"].startswith("torch.")
