"""`nanoddp bench ...`: the benchmark command group.

Each benchmark lives in its own module (`collectives`, `train_cli`, ...) exposing
`register_cli(bench_subparsers)`; this file only groups them under `nanoddp bench`, importing
each when the parser is built, so a new benchmark is one line here. Every benchmark's parser is
a `BenchParser` (`nanoddp.bench.inputs`), and its run is wrapped so that its own checks refuse
the same way argparse's do: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from nanoddp.bench.common import ChildFailed
from nanoddp.bench.inputs import BenchParser

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
    bench_subparsers = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK", parser_class=BenchParser)
    for module_name in BENCHMARK_MODULES:
        importlib.import_module(module_name).register_cli(bench_subparsers)
    for benchmark in bench_subparsers.choices.values():
        benchmark.set_defaults(run=_refusing(benchmark, benchmark.get_default("run")))
    parser.set_defaults(run=lambda args: parser.print_help() or 2)


def _refusing(parser: BenchParser, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with a ValueError or a missing file (a benchmark's own checks) as one line, exit 2,
    and a failed child run (its children ended, its temp dir removed by then) as its output's
    tail, exit 1: neither is a bug in nanoddp, so neither prints a traceback."""

    def checked(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (ValueError, FileNotFoundError) as exc:
            return parser.refuse(exc)
        except ChildFailed as exc:
            return parser.refuse(exc, code=1)

    return checked
