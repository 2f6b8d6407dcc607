"""`nanoddp run --on-failure continue`: the user's script on every replica of a fault-tolerant run.

The supervision (quorum service, one process per replica, replacements, nothing left behind) is
`nanoddp.ft.supervisor`'s, shared with `nanoddp train --on-failure continue`; this file only says
what each replica runs: `nanoddp.run.ft_replica` with the script and its arguments, on this host's
replicas of the run (`nanoddp.ft.placement`: one node, or `--nnodes N --node-rank K` across hosts).
"""

from __future__ import annotations

import argparse
import sys

from nanoddp.ft.placement import placement_for
from nanoddp.ft.supervisor import Launch, supervise


def run_fault_tolerant(args: argparse.Namespace, nproc: int) -> int:
    """Launch `args.script` on `nproc` supervised replicas; return the run's exit code."""
    placement = placement_for(args, nproc)
    unsupported = [
        flag
        for flag, given in (("--log-dir", args.log_dir), ("--fail-on-early-exit", args.fail_on_early_exit))
        if given
    ]
    if unsupported:  # torchrun-agent options: refused rather than silently ignored
        raise ValueError(f"{', '.join(unsupported)} applies to --on-failure restart (torchrun's agent); drop it")
    command = [sys.executable, "-m", "nanoddp.run.ft_replica", *(["-m"] if args.as_module else [])]
    command += [args.script, *args.script_args]
    timeout, spare = args.collective_timeout, args.warm_spare
    launch = Launch(command, nproc, args.max_restarts, timeout, out=args.out, warm_spare=spare,
                    placement=placement, wait_s=args.rdzv_timeout)  # fmt: skip
    return supervise(launch)
