"""The numbers a fault-tolerant run promises: restarts, quorum size, bytes per step, snapshots kept.

- `--max-restarts K` starts each replica at most K + 1 times, as torchrun's agent counts it: the
  supervisor runs a replica command that fails at once and the processes it started are counted.
- The quorum is more than half of the run's replicas: the launcher's own quorum service (torchft's
  Lighthouse, started by `supervise` with the argument it really passes) is asked by half of them,
  which never form a group, then by one more, which do. At 2 replicas half is the survivor of a
  failure alone; at 4, one of two pairs that could each form a group.
- One `nanoddp train --on-failure continue` run of 2 replicas, replica 1 SIGKILLed after step 4
  (no warm spare: its replacement is forked when needed and builds its trainer first, so a
  survivor allowed to go on alone would have time to):
  every step record says world size 2 (the survivor waited); each step's `comm_bytes` is what
  that step sent, the header and the gradient all-gather's float32 flat (torch's byte count of
  the parameters plus the loss), not a running total (what the snapshots and the joiner's
  state transfer send is no step's); and `--keep-snapshots 2` leaves the two newest snapshots.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest

pytest.importorskip("torchft")

from helpers import replica_pid  # noqa: E402

from nanoddp.base.records import read_records
from nanoddp.bench.training_run import run_training
from nanoddp.comm.api.rank_order import chunk_numel  # noqa: E402  (after the skip)
from nanoddp.comm.plan import plan  # noqa: E402
from nanoddp.comm.protocol import wire
from nanoddp.ft.supervisor import Launch, Supervisor, supervise  # noqa: E402
from nanoddp.train.checkpoint import snapshot  # noqa: E402
from nanoddp.train.config import TrainConfig, build_model  # noqa: E402
from nanoddp.train.data.datasets import build_datasets  # noqa: E402

FAILING_REPLICA = """
import os, sys
name = f"{os.environ['NANODDP_FT_REPLICA']}-{os.environ['NANODDP_FT_ATTEMPT']}"
open(os.path.join(sys.argv[1], name), "x").close()
sys.exit(1)  # a crash: replaced (exit 3 would be a stop on purpose, never replaced)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("replicas", "max_restarts"), [(2, 0), (2, 2), (4, 1)])
def test_each_replica_starts_max_restarts_plus_one_times(tmp_path, capfd, replicas, max_restarts):
    started, beats = tmp_path / "started", tmp_path / "beats"
    started.mkdir()
    beats.mkdir()
    command = [sys.executable, "-c", FAILING_REPLICA, str(started)]
    launch = Launch(command, replicas, max_restarts, timeout_s=60.0, warm_spare=False)
    # no quorum service: these replicas fail before they would look for one
    assert Supervisor(launch, "http://127.0.0.1:1", str(beats)).watch() == 1
    want = [f"{replica}-{attempt}" for replica in range(replicas) for attempt in range(max_restarts + 1)]
    assert sorted(p.name for p in started.iterdir()) == want
    said = capfd.readouterr().err
    assert said.count("no restarts left") == replicas and "no replica finished" in said, said


def _ask_for_a_quorum(lighthouse: str, replicas: int, timeout_s: float) -> list[int | None]:
    """Replicas 0..replicas-1 ask the quorum service at once: each one's quorum size, None if none formed."""
    from torchft.coordination import LighthouseClient

    sizes: list[int | None] = [None] * replicas

    def ask(replica: int) -> None:
        client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=30))
        try:
            quorum = client.quorum(replica_id=f"replica-{replica}", timeout=timedelta(seconds=timeout_s))
        except Exception:  # the timeout: no quorum for this request
            return
        sizes[replica] = len(quorum.participants)

    threads = [threading.Thread(target=ask, args=(r,)) for r in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sizes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [2, 4])
def test_half_the_replicas_never_form_a_quorum(monkeypatch, replicas):
    """`supervise` starts the quorum service as for a real run; in place of the replicas, this
    process asks it. The quorum service forms a group once it has waited its join timeout (0.5 s)
    for the rest: 3 s without one is a refusal."""
    asked: dict[str, list[int | None]] = {}

    def ask_instead_of_starting_replicas(supervisor: Supervisor) -> int:
        half = replicas // 2
        asked["half"] = _ask_for_a_quorum(supervisor.lighthouse, half, timeout_s=3.0)
        asked["more"] = _ask_for_a_quorum(supervisor.lighthouse, half + 1, timeout_s=60.0)
        return 0

    monkeypatch.setattr(Supervisor, "watch", ask_instead_of_starting_replicas)
    monkeypatch.setitem(os.environ, "RUST_LOG", "error")
    assert supervise(Launch(["unused"], replicas, 0, 5.0)) == 0
    assert asked["half"] == [None] * (replicas // 2), asked
    assert asked["more"] == [replicas // 2 + 1] * (replicas // 2 + 1), asked


# ---- one `nanoddp train --on-failure continue` run at 2 replicas -------------------------------

STEPS, KILL_AFTER, SNAPSHOT_EVERY, KEEP = 10, 4, 3, 2
GPT = {"text_max_bytes": 1900, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}


def _flags(values: dict) -> list[str]:
    return [part for name, value in values.items() for part in (f"--{name.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """The run's metrics records and the listing of its snapshot directory."""
    out = tmp_path_factory.mktemp("ft-counts") / "run"
    command = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nproc", "2"]
    command += ["--steps", str(STEPS), "--collective-timeout", "10", "--max-restarts", "1", "--no-warm-spare"]
    command += ["--out", str(out), *_flags(GPT), "--batch-size", "12", "--warmup-steps", "2", "--seed", "0"]
    command += ["--snapshot-every", str(SNAPSHOT_EVERY), "--keep-snapshots", str(KEEP), "--eval-every", "0"]
    command += ["--log-every", "1", "--no-progress"]

    def kill_replica_1(proc) -> bool:
        """SIGKILL replica 1 once KILL_AFTER records are written; whether it was."""
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 200
        while proc.poll() is None and time.monotonic() < deadline:
            pid = replica_pid(launcher, 1)
            if len(read_records(out, missing_ok=True)) >= KILL_AFTER and pid is not None:
                os.kill(pid, signal.SIGKILL)
                return True
            time.sleep(0.01)
        return False

    run = run_training(command, out, timeout_s=200, during=kill_replica_1, forked=True)
    assert run.acted and run.returncode == 0, run.output[-5000:]
    return {"records": run.records, "snapshots": sorted(p.name for p in (out / "snapshots").iterdir())}


def _steps(run) -> list[dict]:
    return [r for r in run["records"] if "event" not in r]


@pytest.mark.timeout(420)
def test_quorum_the_survivor_of_two_waits_for_the_replacement(two_replicas):
    steps = _steps(two_replicas)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in steps] == [2] * STEPS  # never a step by the survivor alone
    changes = [(r["event"], r["world_size"]) for r in two_replicas["records"] if r.get("event", "eval") != "eval"]
    assert changes == [("rank_lost", 1), ("rank_joined", 2)], changes


@pytest.mark.timeout(420)
def test_comm_bytes_are_each_steps_own(two_replicas):
    config = TrainConfig(**GPT)
    module = build_model(config, build_datasets(config.data, config.seq_len, config.val_fraction, 1900)[2])
    # The rank-order all-reduce (`all_reduce_in_rank_order`) of the gradients and one float32 loss
    # slot per replica: an all-to-all hands each rank its chunk's other copy (a header with both
    # ranks' send/receive counts, then the data), an all-gather returns the summed chunk (one
    # frame: header + chunk). Rank 0 sends the other chunk, then its own: the flat tensor once.
    numel = sum(p.numel() for p in module.parameters()) + 2
    chunk = chunk_numel(numel, 2) * 4
    assert plan.plan("all_gather", chunk, 2, "gloo") is plan.Path.PAIR
    counts = 2 * 2 * 8  # the all-to-all's header round: 2n int64 split sizes
    sent = [r["comm_bytes"] for r in _steps(two_replicas)]
    expected = 2 * wire.HEADER_BYTES + counts + numel * 4
    assert sent == [expected] * STEPS, sent  # every step, the one redone after the kill too


@pytest.mark.timeout(420)
def test_keep_snapshots_prunes_a_continue_run(two_replicas):
    kept = [snapshot.snapshot_path(".", step).name for step in (9, STEPS)]  # snapshots at 3, 6, 9 and the end
    assert two_replicas["snapshots"] == kept, two_replicas["snapshots"]
