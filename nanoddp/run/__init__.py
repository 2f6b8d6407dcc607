"""`nanoddp run`'s face: `main` and `register_cli`, re-exported from `nanoddp.run.command`.

`nanoddp run SCRIPT [ARGS...]` runs any training script on torchrun's elastic agent, with
nanoddp's fault tolerance. The command line (and what it adds to plain torchrun) is in
`nanoddp.run.command`, what each worker runs in `nanoddp.run.bootstrap`. `nanoddp.cli` registers
the subcommand through `register_cli`; `python -m nanoddp.run` calls `main`.
"""

from nanoddp.run.command import main, register_cli

__all__ = ["main", "register_cli"]
