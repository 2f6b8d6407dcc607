"""One rank of `nanoddp train`, for running under your own torchrun.

    torchrun --standalone --nproc-per-node 2 -m nanoddp.train --steps 200 --out runs/demo

takes the same flags as `nanoddp train` (which starts torchrun itself); see `nanoddp.train.launcher.cli`.
"""

from __future__ import annotations

import sys

from nanoddp.train.launcher.cli import worker_entry

if __name__ == "__main__":
    sys.exit(worker_entry())
