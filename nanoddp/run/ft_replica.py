"""What each replica of `nanoddp run --on-failure continue` executes: the user's script, tied to
the launcher.

`python -m nanoddp.run.ft_replica [-m] SCRIPT ARGS...`: the replica dies with the launcher (even a
SIGKILLed one), takes what the script starts along when it dies itself (`become_replica`),
then runs the script as `__main__`. The script finds its place in the
run through `nanoddp.ft.ReplicaEnv` (the launcher's variables).
"""

from __future__ import annotations

import argparse
import signal
import sys

from nanoddp.ft.replica_env import ReplicaEnv, become_replica
from nanoddp.ft.stopped import run_replica
from nanoddp.run.bootstrap import run_script


def main(argv: list[str] | None = None) -> int:
    """One replica; a run that `FaultTolerant` stopped is one line and `STOPPED_EXIT_CODE`."""
    parser = argparse.ArgumentParser(prog="python -m nanoddp.run.ft_replica")
    parser.add_argument("-m", dest="as_module", action="store_true")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(argv)
    become_replica(ReplicaEnv.from_environ())
    return run_replica(lambda: run_script(parsed.target, parsed.args, parsed.as_module))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
