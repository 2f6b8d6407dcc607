"""Reliability probes: nanoddp used the way a careless or unlucky user would use it.

    python tools/reliability_probes.py [--json FILE] [--only TEXT]

Every probe runs real `nanoddp` commands (or a small script of its own that calls the API) as
subprocesses, in a fresh temp dir of its own that is removed afterwards, and checks what it can
observe: exit codes, the exact line printed (and that it is one line, with no traceback), files
on disk, processes and listening sockets (psutil). Each subprocess starts in its own session
with a timeout; its session and every descendant seen while it ran (torchrun's workers run in
sessions of their own) are killed when the probe ends, so nothing outlives the script.

Prints a markdown table `| # | case | expected | outcome | verdict |` (progress goes to stderr),
optionally writes the rows as JSON (`--json FILE`); `--only TEXT` runs the cases whose number or
name contains TEXT. Exit code 0 when no row FAILs, 1 otherwise. The whole set takes minutes;
run it alone (the interrupt probes time real training steps).

This file is the entry point only: the probes are in `tools/probes/`, one module per family.
"""

import sys

from probes.runner import main

if __name__ == "__main__":
    sys.exit(main())
