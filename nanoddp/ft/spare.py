"""A warm spare: a replica process started with the run, that becomes the first replacement.

Why: a replacement started only once a replica has died spends its first seconds importing
torch, torchft and nanoddp (about 3 s of CPU). On a machine whose cores the survivors use, those
seconds are taken from the survivors' steps, and that is most of what a failure costs under
`--on-failure continue` (docs/ft.md, "What a failure costs"). The launcher therefore starts one
more process with the run: `python -m nanoddp.ft.spare MODULE ARGS...` imports MODULE (the
replicas' own entry point, and so everything it imports), then blocks on its standard input,
using no CPU. When a replica fails, the launcher writes that replica's variables to the spare as
one JSON line and the spare runs `MODULE.main(ARGS)` as that replica, which joins the group and
takes its state from a peer like any replacement. An end of input without a line (the run ended
without needing it) ends the spare with exit 0.

The spare is used once: a later failure starts its replacement when needed. Since the launcher
forks its replicas from a fork server that imported MODULE once (`nanoddp.ft.replica_process`),
such a replacement has its imports done too, and the spare saves only the fork; it matters for
a replica command that is not `python -m MODULE` (started as a fresh process). It costs the run
the memory of an idle process with torch loaded.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys

from nanoddp.base.processes import die_with_parent, name_this_process

PROCESS_NAME = "ft-spare"  # what ps and psutil's name() show for the waiting spare


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoddp.ft.spare MODULE ARGS...` (see the module docstring)."""
    module_name, *args = sys.argv[1:] if argv is None else argv
    name_this_process(PROCESS_NAME)  # until it becomes a replica, which names itself
    die_with_parent(os.getppid())  # a spare never outlives its launcher either (forked: see fork_server)
    worker = importlib.import_module(module_name)  # what a replacement started fresh would pay for after the failure
    line = sys.stdin.readline()
    if not line:
        return 0
    os.environ.update(json.loads(line))  # from here on this process is that replica (ReplicaEnv)
    sys.argv = [module_name, *args]
    try:
        code = worker.main(args)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
