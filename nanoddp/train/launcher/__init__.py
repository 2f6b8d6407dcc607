"""The launcher side of `nanoddp train`: the CLI, torchrun's agent, and checks made before any worker starts."""
