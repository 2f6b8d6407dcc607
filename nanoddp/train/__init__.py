"""The main job: `nanoddp train`, its config, trainer, data, snapshots and metrics."""
