"""`nanoddp bench ...`: the benchmark command group.

Each benchmark lives in its own module (`collectives`, `train_cli`, ...) exposing
`register_cli(bench_subparsers)`; this file only groups them under `nanoddp bench`, importing
each when the parser is built, so a new benchmark is one line here. Every benchmark's parser is
a `BenchParser` (`nanoddp.bench.inputs`), and its run is wrapped so that its own checks refuse
the same way argparse's do: one line, exit code 2; and so that SIGTERM (a scheduler, `kill`) stops
it as Ctrl-C does: what it started is ended and removed on the way out (child runs, namespace
hosts, temp dirs: each is a `with` block), then one line and exit code 128 + signal.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable

from nanoddp.bench.common import ChildFailed
from nanoddp.bench.inputs import BenchParser
from nanoddp.train.signals import STOP_SIGNALS

BENCHMARK_MODULES = (
    "nanoddp.bench.collectives",
    "nanoddp.bench.zero",
    "nanoddp.bench.train_cli",
    "nanoddp.bench.restarts",
    "nanoddp.bench.continue_price",
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


class Stopped(BaseException):
    """SIGTERM or SIGINT reached a benchmark. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way up swallows it while every `with` block's exit still runs."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.signal = sig


def _stop(signum: int, _frame: object) -> None:
    for sig in STOP_SIGNALS:  # a second signal must not cut the clean-up short (it is bounded: one grace period)
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum))


def _refusing(parser: BenchParser, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with a ValueError or a missing file (a benchmark's own checks) as one line, exit 2,
    a failed child run (its children ended, its temp dir removed by then) as its output's tail,
    exit 1, and a stop by signal as one line, exit 128 + signal: none is a bug in nanoddp, so
    none prints a traceback."""

    def checked(args: argparse.Namespace) -> int:
        previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
        try:
            return run(args)
        except (ValueError, FileNotFoundError) as exc:
            return parser.refuse(exc)
        except ChildFailed as exc:
            return parser.refuse(exc, code=1)
        except Stopped as stop:
            print(f"{parser.prog}: stopped by {stop.signal.name}", file=sys.stderr)
            return 128 + stop.signal
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    return checked
