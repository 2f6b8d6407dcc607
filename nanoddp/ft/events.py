"""What a fault-tolerant run tells when its group changes: one log line and one record each.

The records are the trainer's (`nanoddp.base.records` writes them to `metrics.jsonl`): a step
record per committed step (with the `world_size` that step really had) and `{"event": "rank_lost"
| "rank_joined", "step", "world_size", "replicas"}` when the group changes, written before the step
it changes (steps count from 1 here, as in the trainer's records: the loop's index + 1). One
process writes each record (the lowest group rank that knows the previous group), appending one
line per write, so records of different processes never interleave within a line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def replica_of(process: str) -> int:
    """The replica a process plays, from its torchft replica id (`replica_<k>:<uuid>`)."""
    return int(process.split(":")[0].rsplit("_", 1)[1])


def membership_events(before: Sequence[str], after: Sequence[str], step: int) -> list[dict[str, Any]]:
    """The records that turn group `before` into group `after` (the processes in each, as
    `ReplicaGroup.processes` names them) at `step`: losses first, then joins, each with the
    world size it leaves behind. A replica whose process was replaced between two groups is
    both lost and joined, even when the group's size did not change."""
    lost = [replica_of(p) for p in before if p not in after]
    joined = [replica_of(p) for p in after if p not in before]
    events = []
    if lost:
        size = len(before) - len(lost)
        events.append({"event": "rank_lost", "step": step, "world_size": size, "replicas": lost})
    if joined:
        events.append({"event": "rank_joined", "step": step, "world_size": len(after), "replicas": joined})
    return events


def describe(event: dict[str, Any]) -> str:
    """The log line of one event: `rank_lost at step 5: replica 1; world size 2`."""
    replicas = ", ".join(map(str, event["replicas"]))
    word = "replica" if len(event["replicas"]) == 1 else "replicas"
    return f"{event['event']} at step {event['step']}: {word} {replicas}; world size {event['world_size']}"
