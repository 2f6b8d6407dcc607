"""Per-step fault tolerance: survivors of a lost rank rebuild their group and redo the step.

This face is what a user's own loop calls: `FaultTolerant` (the step loop: `steps`,
`batch_for`, `average_gradients`, `commit`), `OptimizerShards` (its optimizer sharded as zero1,
zero2 or fsdp shard it), `ReplicaEnv` (which replica this process plays, and its attempt) and
`RunStopped` (raised when no live replica holds the state and there is no snapshot to resume).
`nanoddp run --on-failure continue SCRIPT` starts the quorum service and one supervised process
per replica (`nanoddp.ft.supervisor`), and replaces a replica that dies. How it works and what
it covers: docs/ft.md; the pieces behind the face are named there.
"""

from nanoddp.ft.fault_tolerant import FaultTolerant
from nanoddp.ft.optimizer_shards import OptimizerShards
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.stopped import RunStopped

__all__ = ["FaultTolerant", "OptimizerShards", "ReplicaEnv", "RunStopped"]
