"""Per-step fault tolerance: survivors of a lost rank rebuild their group and redo the step.

This face is what a user's own loop calls: `FaultTolerant` (the step loop: `steps`,
`batch_for`, `average_gradients`, `commit`, and `group`, the group across the replicas for a
collective of the loop's own), `ReplicaEnv` (which replica this process plays, and its attempt)
and `RunStopped` (raised when no live replica holds the state and there is no snapshot to
resume). `nanoddp run --on-failure continue SCRIPT` starts the quorum service and one supervised
process per replica (`nanoddp.ft.supervisor`), and replaces a replica that dies; `nanoddp train
--on-failure continue` runs the Trainer's engines the same way. How it works and what it covers:
docs/ft.md; the pieces behind the face are named there.
"""

from nanoddp.ft.fault_tolerant import FaultTolerant
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.stopped import RunStopped

__all__ = ["FaultTolerant", "ReplicaEnv", "RunStopped"]
