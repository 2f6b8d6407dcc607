"""`nanoddp bench ...`: the benchmark command group.

Each benchmark lives in its own module (`bench_collectives`, `bench_train`, ...) exposing
`register_cli(bench_subparsers)`; this file only groups them under `nanoddp bench`.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARK_MODULES = (
    "nanoddp.bench.collectives",
    "nanoddp.bench.zero",
    "nanoddp.bench.train",
    "nanoddp.bench.restarts",
    # more benchmarks are registered here as they land
)


def parse_world_sizes(text: str, minimum: int = 1) -> list[int]:
    """`--nproc 1,2,4` -> [1, 2, 4], with one clear error for anything else (every benchmark)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nproc must be comma-separated integers, e.g. 2,4; got {text!r}") from None
    if not sizes or any(n < minimum for n in sizes):
        raise ValueError(f"--nproc needs world sizes >= {minimum}, got {text!r}")
    return sizes


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: nanoddp vs torch.distributed, side by side")
    bench_subparsers = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for module_name in BENCHMARK_MODULES:
        importlib.import_module(module_name).register_cli(bench_subparsers)
    parser.set_defaults(run=lambda args: parser.print_help() or 2)
