"""torch.distributed's collectives, each check -> plan -> run, and the switch between ours and
torch's (`backend`); the top layer. `nanoddp.comm` (its `__init__`) is their face."""
