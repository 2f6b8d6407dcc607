"""A host lost during a heal: the host a joiner heals from is killed whole while the state is on
the wire; the joiner heals again from the survivor, and the run equals a replay of its schedule.

Four network-namespace hosts (`nanoddp.bench.netns_hosts`): hosts 0 and 1 start `nanoddp train
--on-failure continue --nnodes 2 --max-replicas 3 --min-replicas 1` (one process each, the
quorum service a Lighthouse of its own on host 3, so that either may be lost); host 2 grows the
run once they train. A joiner's state (weights, AdamW's moments, the run's facts) takes
milliseconds on a fast link, so the link into host 2 is capped at HEAL_RATE (the kernel's
token bucket, `NetnsHosts.shape`): the heal then takes seconds, and the test finds the source
as the one holder whose TCP connections to host 2 have carried more than SOURCE_BYTES (`ss`),
then SIGKILLs every process of that host. The others' links are capped at STEP_RATE, so that
the steps of the two first hosts, paced by their gradient sums, leave host 2 time to start.

What must follow: the joiner's heal fails, the step in flight is not committed anywhere, the
next quorum is the survivor and the joiner, the joiner heals from the survivor, and the two
train to the end; the records say the joiner joined and the source was lost (the join's record
written before the source sends, when the source is the one who writes it). Bitwise: `model.pt`
and every recorded loss equal the replay of the run's world-size schedule
(`helpers.replay_engine_run`), so the joiner's pieces were computed on the survivor's state, not
on a half-received one.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FT_TINY_GPT, OutputReader, lighthouse_on, replay_engine_run, run_on_ranks, wait_for

from nanoddp.base.records import read_records
from nanoddp.bench.netns_hosts import NetnsHosts, shaping_unavailable_reason

pytest.importorskip("torchft")
pytestmark = [
    pytest.mark.skipif(
        shaping_unavailable_reason() is not None, reason=f"shaped hosts: {shaping_unavailable_reason()}"
    ),
    pytest.mark.usefixtures("cpu_processes"),  # compared with a CPU replay, also where a GPU is
]

STEPS = 120
PORT = 29530  # inside the namespaces this test made: nothing else listens there
STEP_RATE = 5e6  # bits/s into hosts 0 and 1: a step's gradient sum paces the run
HEAL_RATE = 1e6  # bits/s into host 2: its state (about 0.4 MB) takes seconds
SOURCE_BYTES = 100_000  # a holder that sent host 2 this much is healing it (the others send it none)
RUN_TIMEOUT_S = 240


def _bytes_sent_to(hosts: NetnsHosts, host: int, address: str) -> int:
    """Bytes host `host`'s TCP connections to `address` have had acknowledged (`ss -ti`)."""
    shown = subprocess.run(hosts.command(host, ["ss", "-tinH", "dst", address]), capture_output=True, text=True,
                           timeout=30).stdout  # fmt: skip
    return sum(int(n) for n in re.findall(r"bytes_acked:(\d+)", shown))


def _history(records: list[dict]) -> list[int]:
    return [r["world_size"] for r in records if "event" not in r]


def _replay(env, history: list[int]) -> tuple[dict[str, torch.Tensor], list[float]]:
    losses: list[float] = []
    return replay_engine_run(env, history, "nanoddp", replicas=2, losses=losses), losses


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)  # + the replay
def test_the_source_of_a_heal_lost_mid_heal_the_joiner_heals_from_the_survivor(tmp_path):
    out = tmp_path / "run"
    with NetnsHosts(4) as hosts:
        lighthouse, service = lighthouse_on(hosts, 3, PORT)
        hosts.shape(STEP_RATE, hosts=[0, 1])
        hosts.shape(HEAL_RATE, hosts=[2])
        train = [sys.executable, "-m", "nanoddp", "train", "--on-failure", "continue", "--nnodes", "2", "--nproc", "1",
                 "--max-replicas", "3", "--lighthouse", lighthouse, "--min-replicas", "1", "--max-restarts", "0",
                 "--steps", str(STEPS), "--snapshot-every", "0", "--eval-every", "0", "--out", str(out),
                 *FT_TINY_GPT]  # fmt: skip
        procs = {host: hosts.fork(host, [*train, "--node-rank", str(host)]) for host in (1, 0)}
        outputs = {host: OutputReader(proc) for host, proc in procs.items()}
        source = None
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S

            def training() -> bool:
                """Both first hosts have recorded 3 steps together."""
                assert procs[0].poll() is None and procs[1].poll() is None, "a launcher ended before host 2 started"
                return len([r for r in read_records(out, missing_ok=True) if "event" not in r]) >= 3

            wait_for(training, deadline, 0.01)
            procs[2] = hosts.fork(2, [*train, "--node-rank", "2"])
            outputs[2] = OutputReader(procs[2])

            def healing() -> tuple[int] | None:
                """(the holder healing host 2,), once one has sent it SOURCE_BYTES."""
                assert procs[0].poll() is None and procs[1].poll() is None, "a launcher ended before the heal"
                sent = {h: _bytes_sent_to(hosts, h, hosts.addresses[2]) for h in (0, 1)}
                return next(((h,) for h, n in sent.items() if n > SOURCE_BYTES), None)

            (source,) = wait_for(healing, deadline, 0.02)
            hosts.kill(source)
            assert procs[source].wait(timeout=30) == -signal.SIGKILL
            hosts.shape(None)  # the rest at full speed: the second heal and the steps after it
            survivor = 1 - source
            for host in (survivor, 2):
                assert procs[host].wait(timeout=max(1.0, deadline - time.monotonic())) == 0, outputs[host].done()[
                    -3000:
                ]
        finally:
            for proc in (*procs.values(), service):
                proc.kill()
                proc.wait(timeout=30)
            for host, output in outputs.items():  # shown by pytest if the test failed
                print(f"--- host {host} (source: {source})\n{output.done()[-4000:]}")
    records = read_records(out)
    history = _history(records)
    # every committed step had two replicas: the group of three (the joiner healing) never committed
    # one, and the one after it is the survivor and the joiner
    assert history == [2] * STEPS, history
    # the joiner's group of three recorded (by its first survivor: before it sends, if it is the
    # source), then the source lost from it (world size 2 left: the survivor and the joiner)
    changes = [(r["event"], r["replicas"], r["world_size"]) for r in records if r.get("event", "").startswith("rank_")]
    assert changes == [("rank_joined", [2], 3), ("rank_lost", [source], 2)], changes
    joiner = outputs[2].done()
    assert "the boundary after step" in joiner and "Connection closed by peer" in joiner, joiner[-3000:]
    assert "resum" not in joiner.lower(), joiner[-3000:]  # healed from the survivor, no snapshot
    want, losses = run_on_ranks(_replay, 1, history, timeout=240)[0]
    got = torch.load(out / "model.pt", weights_only=True)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: {(got[name] - value).abs().max()}"
    assert [r["loss"] for r in records if "event" not in r] == losses
