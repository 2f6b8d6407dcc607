"""`nanoddp train --on-failure continue` trains with the engines of the restart path.

Every engine that continue covers (nanoddp, zero1, zero2, hsdp), plain and with mixed precision
and `--grad-accum 2` (both in one launch: a launch costs seconds, a step milliseconds): `--amp
bf16` for nanoddp and zero2, `--amp fp16` (a GradScaler per replica, which must agree with its
peers' on every overflow) for zero1 and hsdp. One launch of 2 replicas of a tiny GPT per case,
3 steps, no failure, two launches at a time; and three cases of replica groups of 2 processes
(`--group-size 2 --nproc 4`: hsdp sharded over each group with fp16 and `--grad-accum 3`, nanoddp
with bf16, zero2). References:
- the engine object a replica trains with is the class the engine registry names, as under
  restart (the replica's start-up line names the object's class);
- each run's `model.pt` equals, bitwise, a single-process replay (`helpers.replay_engine_run`):
  the same engine built as the restart path builds it over one replica's processes (one rank, or
  the group's 2), each replica's piece of each step's global batch run in turn (in micro-batches,
  under autocast) and the engine's gradient buffers weighted and added in rank order;
- that replay is itself anchored to the plain-model replay (`helpers.replay_continue_run`: no
  engine, torch's clip and AdamW), bitwise for nanoddp, zero1 and hsdp; zero2's clip adds the
  squares over its flat pieces (another order of float additions), so to float32 rounding.
Failures and healing are tests/multiproc/test_ft.py's, test_ft_sharded.py's and test_ft_guards.py's.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import FT_TINY_GPT, replay_continue_run, replay_engine_run, run_on_ranks

from nanoddp.base.records import read_records
from nanoddp.bench.training_run import TrainingRun, run_training
from nanoddp.env import default_backend
from nanoddp.train.engines import ENGINE_REGISTRY

pytest.importorskip("torchft")
# The launches are made in the first test's setup: up to len(CASES) / AT_ONCE rounds of LAUNCH_TIMEOUT_S
# on a loaded machine (a slow 2-core one took over 300 s for all eight), then the replays.
pytestmark = pytest.mark.timeout(900)

REPLICAS, STEPS = 2, 3
ENGINES = ("nanoddp", "zero1", "zero2", "hsdp")
# Each engine's mixed-precision case: bf16 for two, fp16 for the other two (a launch each).
MIXED = {"nanoddp": "bf16", "zero1": "fp16", "zero2": "bf16", "hsdp": "fp16"}
AT_ONCE = 2  # launches running together: each waits on its quorum and start-up as much as it computes
LAUNCH_TIMEOUT_S = 150  # one launch, on a loaded machine
CASES = {
    **{f"{engine}-plain": (engine, {}) for engine in ENGINES},
    **{f"{engine}-{amp}-accum2": (engine, {"amp": amp, "grad_accum": 2}) for engine, amp in MIXED.items()},
}
# Replica groups of GROUP processes (`--group-size`): the engine built over each group's members
# (hsdp sharded over them, DDP's buckets reduce-scattered among them), summed across the groups.
GROUP = 2
GROUP_CASES = {
    "hsdp-groups-fp16-accum3": ("hsdp", {"amp": "fp16", "grad_accum": 3}),  # 12 = 4 processes x 3
    "nanoddp-groups-bf16": ("nanoddp", {"amp": "bf16"}),
    "zero2-groups": ("zero2", {}),
}
CASES |= {case: (engine, {**options, "group_size": GROUP}) for case, (engine, options) in GROUP_CASES.items()}


def _flags(options: dict) -> list[str]:
    return [part for key, value in options.items() for part in ("--" + key.replace("_", "-"), str(value))]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Every case's finished run, `AT_ONCE` at a time: {case: (run directory, exit code, output)};
    a launch past `LAUNCH_TIMEOUT_S` is ended (its exit code then says so)."""
    root = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(AT_ONCE) as pool:
        runs = dict(zip(CASES, pool.map(lambda case: _run(case, root / case / "run"), CASES), strict=True))
    return {case: (root / case / "run", run.returncode, run.output) for case, run in runs.items()}


def _run(case: str, out: Path) -> TrainingRun:
    """Launch `case`, forked from the fork server (its launcher's imports shared)."""
    engine, options = CASES[case]
    nproc = REPLICAS * options.get("group_size", 1)
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", str(nproc),
               "--engine", engine, "--steps", str(STEPS), "--snapshot-every", "0", "--eval-every", "0",
               "--no-warm-spare", "--out", str(out), *FT_TINY_GPT, *_flags(options)]  # fmt: skip
    return run_training(command, out, timeout_s=LAUNCH_TIMEOUT_S, forked=True)


def _finished(launched, case: str) -> tuple[Path, str]:
    out, code, output = launched[case]
    assert code == 0, f"{case}: exit {code}\n{output[-5000:]}"
    return out, output


@pytest.fixture(scope="module")
def replays() -> dict[str, dict[str, torch.Tensor]]:
    """Every case's replay: one process each for one-process replicas, GROUP for the groups'."""
    alone = run_on_ranks(_replay_all, 1, False, timeout=240)[0]
    return {**alone, **run_on_ranks(_replay_all, GROUP, True, timeout=240)[0]}


def _replay_all(env, groups: bool) -> dict[str, dict[str, torch.Tensor]]:
    replays = {}
    for case, (engine, options) in CASES.items():
        if ("group_size" in options) == groups:  # the replay's world is one group: its size is G
            flags = {key: value for key, value in options.items() if key != "group_size"}
            replays[case] = replay_engine_run(env, [REPLICAS] * STEPS, engine, replicas=REPLICAS, **flags)
    return replays


@pytest.mark.parametrize("case", CASES)
def test_a_run_without_failure_equals_its_replay_bitwise(case, launched, replays):
    out, _ = _finished(launched, case)
    history = [r["world_size"] for r in read_records(out) if "event" not in r]
    assert history == [REPLICAS] * STEPS, history
    got, want = torch.load(out / "model.pt"), replays[case]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{case} {name}: {(got[name] - want[name]).abs().max()}"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_replay_equals_the_plain_model_replay(engine, replays):
    plain = replay_continue_run([REPLICAS] * STEPS, replicas=REPLICAS)
    got = replays[f"{engine}-plain"]
    if engine == "zero2":
        torch.testing.assert_close(got, plain)
        return
    for name in plain:
        assert torch.equal(got[name], plain[name]), f"{engine} {name}: {(got[name] - plain[name]).abs().max()}"


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_is_the_same_class(engine, launched):
    """The object a replica trains with is an instance of the registry's class (what restart
    builds) over the backend torchrun's workers would have (nccl where each process can own a
    GPU), and zero1/zero2 say once what one process per replica means for them."""
    _, output = _finished(launched, f"{engine}-plain")
    kind = ENGINE_REGISTRY[engine]
    said = f"engine {engine} ({kind.__module__}.{kind.__qualname__}), one process per replica over "
    assert output.count(said + default_backend(REPLICAS)) == 1, output[-3000:]
    said = f"{engine} shards nothing across replicas: each replica holds the whole optimizer state"
    assert (said in output) == (engine in ("zero1", "zero2")), output[-3000:]


@pytest.mark.parametrize("case", GROUP_CASES)
def test_a_replica_group_trains_the_same_class_over_its_processes(case, launched):
    """With `--group-size`, the same class again, and the line says what a replica is."""
    engine = CASES[case][0]
    _, output = _finished(launched, case)
    kind = ENGINE_REGISTRY[engine]
    said = f"engine {engine} ({kind.__module__}.{kind.__qualname__}), replica groups of {GROUP} processes"
    assert output.count(said) == 1, output[-3000:]
    if engine == "zero2":
        assert f"zero2 shards over each group's {GROUP} processes, and every group holds a whole copy" in output
