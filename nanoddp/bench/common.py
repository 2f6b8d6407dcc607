"""What every benchmark shares: the `--nproc` list, the `--json/--plot` flags and the one way
results and figures are written (atomically, so an interrupted run never leaves half a file).

Kept in one place so `nanoddp bench collectives`, `zero`, `train` and `restarts` read their
world sizes and write their results the same way.
"""

from __future__ import annotations

import argparse
import io
import json
from typing import Any

from nanoddp.base.files import atomic_write_bytes
from nanoddp.bench.inputs import output_file


class ChildFailed(RuntimeError):
    """A child run (`base.processes.child_run`) failed, and with it the measurement; the message
    carries its output's tail, which `nanoddp bench` reports without a traceback (exit code 1)."""


def parse_world_sizes(text: str, minimum: int = 1) -> list[int]:
    """`--nproc 1,2,4` -> [1, 2, 4], with one clear error for anything else (every benchmark)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nproc must be comma-separated integers, e.g. 2,4; got {text!r}") from None
    if not sizes or any(n < minimum for n in sizes):
        raise ValueError(f"--nproc needs world sizes >= {minimum}, got {text!r}")
    return sizes


def add_output_args(parser: argparse.ArgumentParser, plot_help: str | None = None) -> None:
    """`--json FILE` (every result, with the run's metadata) and, where a plot exists, `--plot FILE`;
    each checked as it is read (`inputs.output_file`), not after the measurements."""
    parser.add_argument("--json", type=output_file, default=None, metavar="FILE", help="write all results as JSON")
    if plot_help is not None:
        parser.add_argument("--plot", type=output_file, default=None, metavar="FILE", help=plot_help)


def write_json(path: str, data: dict[str, Any]) -> None:
    """A benchmark's results ({"meta": ..., "results": [...]}), written atomically."""
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def save_figure(path: str, fig: Any) -> None:
    """A matplotlib figure as PNG, written atomically, then closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
