"""Per-step fault tolerance: survivors of a lost rank rebuild their group and redo the step.

`FaultTolerant` is the step loop a user's script calls (`steps`, `batch_for`,
`average_gradients`, `commit`); `nanoddp run --on-failure continue SCRIPT` starts the quorum
service and one supervised process per replica, and replaces a replica that dies. The pieces:
`RebuiltWorld` (the group rebuild), `LiveState` (what a joiner receives), `GlobalBatches` and
`share` (the data of a step), `WeightedPieceSum` (the average), `OptimizerShards` (the optimizer
sharded as zero1/zero2 do), `ReplicaEnv` (the launcher's variables), `supervise` (the launcher of
`nanoddp run|train --on-failure continue`). How it works and what it covers: docs/ft.md.
"""

from nanoddp.ft.batches import GlobalBatches, piece_weight, share
from nanoddp.ft.fault_tolerant import FaultTolerant
from nanoddp.ft.gradients import WeightedPieceSum
from nanoddp.ft.live_state import LiveState
from nanoddp.ft.optimizer_shards import OptimizerShards
from nanoddp.ft.replica_env import ReplicaEnv
from nanoddp.ft.supervisor import Launch, supervise
from nanoddp.ft.world import RebuiltWorld

__all__ = [
    "FaultTolerant", "GlobalBatches", "Launch", "LiveState", "OptimizerShards", "RebuiltWorld", "ReplicaEnv",
    "piece_weight", "share", "WeightedPieceSum", "supervise",
]  # fmt: skip
