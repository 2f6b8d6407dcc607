"""`nanoddp bench ...`: the benchmark command group.

Each benchmark lives in its own module (`collectives`, `train_cli`, ...) exposing
`register_cli(bench_subparsers)`; this file only groups them under `nanoddp bench`, importing
each when the parser is built, so a new benchmark is one line here.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARK_MODULES = (
    "nanoddp.bench.collectives",
    "nanoddp.bench.zero",
    "nanoddp.bench.train_cli",
    "nanoddp.bench.restarts",
    "nanoddp.bench.wan",
    # more benchmarks are registered here as they land
)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: nanoddp vs torch.distributed, side by side")
    bench_subparsers = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for module_name in BENCHMARK_MODULES:
        importlib.import_module(module_name).register_cli(bench_subparsers)
    parser.set_defaults(run=lambda args: parser.print_help() or 2)
