"""`nanoddp bench train` and `nanoddp bench report`: the command line of the training benchmark.

Why a file of its own: `nanoddp.bench.train` measures (workers, launches, the memory pass);
this file turns flags into a `run_benchmark` call and its result into tables, JSON and plots,
and registers `bench render`, which rewrites the docs' tables from the committed JSON.
"""

from __future__ import annotations

import argparse
import json

from nanoddp.bench import render, train
from nanoddp.bench.common import add_output_args, parse_world_sizes, write_json
from nanoddp.bench.inputs import count, input_file, output_dir, output_file
from nanoddp.bench.report import format_markdown, write_memory_plot, write_plot
from nanoddp.bench.train import ALLCORES, ENGINES, MEMORY_MODES, NOCOMM, run_benchmark


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "train",
        help="every engine, same model and global batch, interleaved: throughput, comm, overlap",
        description=train.__doc__.split("\n\n")[1] if train.__doc__ else None,
    )
    parser.add_argument("--nproc", default="1,2,4", help="comma-separated world sizes (default: 1,2,4)")
    parser.add_argument(
        "--engines",
        default="single,nanoddp,torch,allreduce,rs_ag,dp,zero1",
        help=f"comma-separated, from {','.join(ENGINES)}; `single` also adds {ALLCORES} (ws 1, every "
        f"core) and {NOCOMM} (ws > 1, each rank on its share of the batch, no gradient sync)",
    )
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny", help="GPT preset")
    parser.add_argument("--global-batch", type=count(1), default=32, help="sequences per step over all ranks")
    parser.add_argument("--steps", type=count(1), default=30, help="timed steps per engine")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed steps per engine (at least 2 run)")
    parser.add_argument("--block", type=count(1), default=5, help="steps per turn when interleaving")
    parser.add_argument("--threads-per-rank", type=count(1), default=1, help="torch threads per process")
    parser.add_argument("--amp", choices=["off", "bf16"], default="off", help=AMP_HELP)
    parser.add_argument("--memory", choices=MEMORY_MODES, default="alone", help=MEMORY_HELP)
    add_output_args(parser, plot_help="write a PNG (throughput, comm)")
    parser.add_argument("--memory-plot", type=output_file, default=None, metavar="FILE", help=MEMORY_PLOT_HELP)
    parser.add_argument(
        "--trace", type=output_dir, default=None, metavar="DIR", help="Chrome traces per engine and rank"
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="default: nccl when there is a GPU per rank, else gloo on CPU",
    )
    parser.set_defaults(run=_run)
    report = bench_subparsers.add_parser("report", help="the README's markdown table from a bench train JSON")
    report.add_argument("file", type=input_file, metavar="FILE.json")
    report.add_argument("--plot", type=output_file, default=None, metavar="FILE", help="also write the PNG")
    report.add_argument("--memory-plot", type=output_file, default=None, metavar="FILE", help=MEMORY_PLOT_HELP)
    report.set_defaults(run=_run_report)
    render.register_cli(bench_subparsers)  # `bench render`: the docs' tables from docs/bench/*.json


def _run(args: argparse.Namespace) -> int:
    nprocs = parse_world_sizes(args.nproc)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    data = run_benchmark(nprocs, engines, args.model, args.global_batch, args.steps, args.warmup, args.block,
                         args.threads_per_rank, args.trace, backend=args.backend, amp=args.amp,
                         memory=args.memory)  # fmt: skip
    print(format_markdown(data))
    if args.json:
        write_json(args.json, data)
        print(f"wrote {args.json}")
    _write_plots(args, data)
    return 0


def _run_report(args: argparse.Namespace) -> int:
    with open(args.file) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "results" not in data or "meta" not in data:
        raise ValueError(f"{args.file} is not a `nanoddp bench train --json` file (no meta/results)")
    print(format_markdown(data))
    _write_plots(args, data)
    return 0


AMP_HELP = "bf16: every forward under autocast, both FSDPs all-gather in bf16 and reduce in fp32 (the trainer's --amp)"
MEMORY_HELP = (
    "alone (default): each engine's memory from a launch running it alone; shared: from the timed "
    "launch, faster but order-dependent (the first engine built pays for what later ones reuse)"
)
MEMORY_PLOT_HELP = "write a PNG of per-rank memory by engine: parameters, gradients, optimizer state, transient peak"


def _write_plots(args: argparse.Namespace, data: dict) -> None:
    for path, write in ((args.plot, write_plot), (args.memory_plot, write_memory_plot)):
        if path:
            write(path, data)
            print(f"wrote {path}")
