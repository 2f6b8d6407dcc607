"""`nanoddp run SCRIPT [ARGS...]`: any training script on torchrun's elastic agent, with
nanoddp's fault tolerance.

This package is the face: the command line is in `nanoddp.run.cli` (what it adds to plain
torchrun is described there), what each worker runs in `nanoddp.run.bootstrap`.
`nanoddp.cli` registers the subcommand through `register_cli`; `python -m nanoddp.run` calls
`main`.
"""

from nanoddp.run.cli import main, register_cli

__all__ = ["main", "register_cli"]
