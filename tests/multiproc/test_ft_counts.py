"""The numbers a fault-tolerant run promises: restarts, quorum size, bytes per step, snapshots kept.

- `--max-restarts K` starts each replica at most K + 1 times, as torchrun's agent counts it: the
  supervisor runs a replica command that fails at once and the processes it started are counted.
- The quorum is more than half of the run's replicas: the launcher's own quorum service (torchft's
  Lighthouse, started by `supervise` with the argument it really passes) is asked by half of them,
  which never form a group, then by one more, which do. At 2 replicas half is the survivor of a
  failure alone; at 4, one of two pairs that could each form a group.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

import pytest

pytest.importorskip("torchft")

from nanoddp.ft.supervisor import Launch, Supervisor, supervise  # noqa: E402  (after the skip)

FAILING_REPLICA = """
import os, sys
name = f"{os.environ['NANODDP_FT_REPLICA']}-{os.environ['NANODDP_FT_ATTEMPT']}"
open(os.path.join(sys.argv[1], name), "x").close()
sys.exit(3)
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
