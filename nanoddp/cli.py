"""`nanoddp` command-line entry point.

Each subcommand lives with the code it drives: a module exposes `register_cli(subparsers)`,
which adds its parser and sets `run=<callable(args) -> int>`. This file only lists them, so a
new subcommand is one line here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import nanoddp

# (module, attribute) pairs, imported lazily so `nanoddp --help` stays fast.
SUBCOMMAND_REGISTRARS = (
    ("nanoddp.cli", "register_check_cli"),
    ("nanoddp.bench", "register_cli"),
    ("nanoddp.train.launcher.cli", "register_cli"),
    ("nanoddp.train.sample", "register_cli"),
    ("nanoddp.run", "register_cli"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoddp",
        description="Data-parallel training for PyTorch: collectives, DDP, trainer, benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"nanoddp {nanoddp.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name, attr in SUBCOMMAND_REGISTRARS:
        getattr(importlib.import_module(module_name), attr)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input: one clear line, not a traceback.
        print(f"nanoddp: error: {exc}", file=sys.stderr)
        return 2


# --- `nanoddp check`: the smallest useful distributed program -----------------------------


def register_check_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="start N local processes and verify they can all-reduce",
        description="Launch N processes, print each rank's environment, and check that an "
        "all_reduce of the ranks gives N(N-1)/2 on every rank.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of processes (default: 2)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: auto")
    parser.set_defaults(run=_run_check)


def _check_worker(env: nanoddp.DistEnv) -> str:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(env.rank)], device=env.device)
    dist.all_reduce(value)
    expected = env.world_size * (env.world_size - 1) / 2
    status = "ok" if value.item() == expected else f"WRONG (expected {expected})"
    return (
        f"rank {env.rank}/{env.world_size} local_rank {env.local_rank} node {env.node_rank} "
        f"device {env.device} backend {env.backend}: all_reduce(rank) = {value.item():g} {status}"
    )


def _run_check(args: argparse.Namespace) -> int:
    lines = nanoddp.launch(_check_worker, args.nproc, backend=args.backend, timeout=120)
    for line in lines:
        print(line)
    return 0 if all(line.endswith(" ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
