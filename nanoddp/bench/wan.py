"""`nanoddp bench wan`: DDP and DiLoCo over a slow link, side by side.

`nanoddp train` runs the built-in GPT on 2 replicas with the same steps, batch and seed: engine
`nanoddp` (DDP: every step all-reduces every gradient), engine `diloco --sync-every H` (each
replica takes H AdamW steps alone, then one all-reduce of the pseudo-gradient; Streaming DiLoCo
with `--fragments`, `--sync-delay`, `--mix`, `--pseudo-grad-dtype`), the same DiLoCo run with no
communication at all (`nocomm`: its first sync lies past the last step, so it is the compute bound
DiLoCo's overlap is measured against) and, over a kernel link, engine `torch` (torch's own DDP,
its gloo all-reduce: the baseline users would pick).

With `--lrs a,b,c`, DDP and DiLoCo each run at every one of those peak learning rates and the one
with the lowest final validation loss is kept (an engine at its best, not at one lr that suits the
other); torch's DDP then runs at our DDP's best lr, the no-communication run at DiLoCo's. Every
run stays in the JSON; the comparison is between the kept ones.

With `--trials N`, a link's kept runs then run N - 1 times more, the engines interleaved trial by
trial: sequential runs on a shared host differ by more than the few per cent a steps/s ratio is
about, and interleaving shifts every engine alike. Times are medians over the trials, ratios the
medians of each trial's own (`nanoddp.bench.wan_report`).

The link (`--link`) is one of two:

- `netns` (the default where this process may make network namespaces and qdiscs: root, `ip`,
  `tc`): each replica is a node of its own, `nanoddp train --nnodes 2 --node-rank K --nproc 1` in
  a network namespace (`nanoddp.bench.netns_hosts`), the two joined through a bridge whose veths
  the kernel caps at `--bandwidth` in each direction (tc's token bucket). Every byte pays for it:
  our collectives, torch's gloo, the rendezvous. No latency is added: that would need netem,
  which this kernel lacks, and the in-process shaper's latency would delay our sends alone, not
  torch's; a nonzero `--latency` is refused here.
- `shaper` (elsewhere): 2 ranks on this machine, every gloo send of nanoddp's collectives held
  back as a link of `--bandwidth` and `--latency` would (`nanoddp.comm.transport.link`, a
  simulation: no loss, no jitter, no shared bottleneck). torch's DDP never passes through it, so
  it is not run there.

Then the same runs unshaped (the veths at full speed, or loopback), unless `--no-unshaped`. Each
run's metrics.jsonl gives its validation curve and the bytes rank 0 sent (`comm_bytes`; torch's
are modelled, a ring all-reduce of its gradients); the report puts side by side the training time,
the bytes, the final validation loss and the training time at which each run first reached DDP's
final validation loss on the same link.

Time is training time: the sum of the step times the trainer records (evaluation, snapshots and
start-up excluded, the same for every engine); each run's whole wall time is reported beside it.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

from nanoddp.base.processes import child_run, end_tree, finish
from nanoddp.bench.common import ChildFailed, add_output_args, write_json
from nanoddp.bench.inputs import count
from nanoddp.bench.machine import git_commit
from nanoddp.bench.netns_hosts import NetnsHosts, shaping_unavailable_reason
from nanoddp.bench.training_run import TrainingRun, run_training, train_command
from nanoddp.bench.wan_report import best_runs, compare, format_markdown, plot, summarize
from nanoddp.comm.transport.link import BANDWIDTH_VAR, LATENCY_VAR, link_environ, parse_bandwidth, parse_latency
from nanoddp.train.launcher.cli import check_train_argv

logger = logging.getLogger(__name__)

# DDP first: its final validation loss is the target. torch's DDP only where the link shapes it.
# Each run after its twin, whose best lr it takes (`LR_TWIN`).
ENGINES = {"shaper": ("nanoddp", "diloco", "nocomm"), "netns": ("nanoddp", "torch", "diloco", "nocomm")}
LR_TWIN = {"torch": "nanoddp", "nocomm": "diloco"}  # the same math (torch), the same run unsynced (nocomm)
TRAIN_ENGINE = {"nocomm": "diloco"}  # the `nanoddp train --engine` of a run that is not named after one
# DiLoCo's flags of the benchmark, passed on to `nanoddp train` as given (None: the trainer's default)
DILOCO_FLAGS = ("fragments", "sync_delay", "mix", "pseudo_grad_dtype", "outer_lr", "outer_momentum")
SHAPER_LATENCY = "20ms"  # --latency's default under the shaper
RUN_TIMEOUT_S = 4 * 3600
PEER_EXIT_S = 120.0  # node 1 ends within this of node 0, or is ended
RDZV_PORT = 29500  # inside the benchmark's own namespaces: nothing else listens there
# The built-in GPT (tiny preset, the stdlib's text); nothing written that is not needed.
BASE_ARGS = ["--snapshot-every", "0", "--no-progress"]
LOCAL_LAUNCH = ("--nproc", "2", "--overwrite")  # both ranks on this machine


def node_launch(endpoint: str, node_rank: int) -> tuple[str, ...]:
    """The launch flags of one replica as a node of its own (docs/multinode.md)."""
    return ("--nproc", "1", "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint,
            "--rdzv-id", "wan")  # fmt: skip


def train_argv(
    engine: str, args: argparse.Namespace, out: Path, launch: tuple[str, ...] = LOCAL_LAUNCH, lr: float | None = None
) -> list[str]:
    """The `nanoddp train` command of one run (of one node of it, with `node_launch`)."""
    return train_command(*train_flags(engine, args, out, launch, lr))


def train_flags(
    engine: str, args: argparse.Namespace, out: Path, launch: tuple[str, ...] = LOCAL_LAUNCH, lr: float | None = None
) -> list[str]:
    """The flags of one run's `nanoddp train`: the benchmark's, then `--train-args`. `nocomm` is
    the DiLoCo run with H/F, the steps between two fragments' syncs, past the last step even less
    the sync delay (no fragment's all-reduce starts within the run), so it never communicates;
    `lr` (None: the model's default) is the peak lr."""
    argv = ["--engine", TRAIN_ENGINE.get(engine, engine), *launch, *BASE_ARGS, "--out", str(out)]
    argv += ["--steps", str(args.steps), "--seed", str(args.seed), "--eval-every", str(args.eval_every)]
    argv += ["--log-every", str(args.eval_every), "--eval-samples", str(args.eval_samples)]
    argv += [] if lr is None else ["--lr", repr(lr)]
    if engine in ("diloco", "nocomm"):
        never = (args.fragments or 1) * (args.steps + (args.sync_delay or 0) + 1)
        argv += ["--sync-every", str(args.sync_every if engine == "diloco" else never)]
        for name in DILOCO_FLAGS:
            if getattr(args, name) is not None:
                argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + shlex.split(args.train_args)


def check_runs(args: argparse.Namespace) -> None:
    """Refuse now, in one line, what `nanoddp train` would refuse of either engine's run a minute
    in (`--train-args` parsed by its own parser, the config checked against its data)."""
    given_lr = any(word == "--lr" or word.startswith("--lr=") for word in shlex.split(args.train_args))
    if args.lrs and given_lr:
        raise ValueError("--lrs sets each run's --lr, so --train-args may not give one too; drop --lr from "
                         "--train-args, or drop --lrs to run every engine at that one lr")  # fmt: skip
    for engine in ENGINES[args.link]:
        try:
            unused = Path(tempfile.gettempdir(), "nanoddp-wan-unused")
            for lr in args.lrs or [None]:
                check_train_argv(train_flags(engine, args, unused, lr=lr))
        except (ValueError, FileNotFoundError) as exc:
            given = f" with --train-args {args.train_args!r}" if args.train_args else ""
            raise ValueError(f"`nanoddp train` would refuse the {engine} run{given}: {exc}") from None


def _run_env(link: dict[str, str]) -> dict[str, str]:
    """This process's environment for a child run, shaped by `link` (empty: at full speed)."""
    env = {k: v for k, v in os.environ.items() if k not in (BANDWIDTH_VAR, LATENCY_VAR)}
    return {**env, **link}


def choose_link(requested: str | None) -> tuple[str, str | None]:
    """`--link` as given, or netns where namespaces and qdiscs can be made and shaper elsewhere,
    with why, in words (None: as given). `--link netns` where they cannot is refused in one line."""
    reason = shaping_unavailable_reason()
    if requested == "netns" and reason is not None:
        raise ValueError(f"--link netns needs network namespaces and tc qdiscs, which cannot be made here ({reason}); "
                         "use --link shaper (the in-process shaper) or run as root with iproute2")  # fmt: skip
    if requested is not None:
        return requested, None
    if reason is not None:
        return "shaper", f"the default here: namespaces cannot be made ({reason})"
    return "netns", "the default here: root, with ip and tc"


def link_latency(link: str, latency: str | None) -> str | None:
    """The latency the runs get: `--latency` (20ms by default) under the shaper; none under netns,
    where a nonzero one is refused (the module's docstring says why)."""
    if link == "shaper":
        return SHAPER_LATENCY if latency is None else latency
    if latency is not None and parse_latency(latency, "--latency") != 0:
        raise ValueError(f"--latency {latency} cannot be simulated under --link netns: this kernel has no netem, and "
                         "the in-process shaper would delay nanoddp's sends but not torch's; drop --latency, or use "
                         "--link shaper for a latency (nanoddp's engines only)")  # fmt: skip
    return None


def run_one(
    engine: str, link: dict[str, str], args: argparse.Namespace, out: Path, lr: float | None = None
) -> dict[str, Any]:
    """Run `nanoddp train` once on this machine (the shaper's `link`, or none); return its summary
    (`summarize`) with its wall time."""
    argv = train_argv(engine, args, out, lr=lr)
    logger.info("running %s", shlex.join(argv))
    run = run_training(argv, out, timeout_s=RUN_TIMEOUT_S, env=_run_env(link))
    if run.returncode != 0:
        raise ChildFailed(f"`{shlex.join(argv)}` failed (exit {run.returncode}):\n{run.output[-3000:]}")
    return _result(engine, bool(link), run, lr)


def node_argvs(
    engine: str, args: argparse.Namespace, out: Path, endpoint: str, lr: float | None = None
) -> list[list[str]]:
    """The two nodes' `nanoddp train` commands; node 0 serves the rendezvous at `endpoint` (its
    own address) and writes `out`, node 1 its own directory beside it (two launchers never share
    a run dir)."""
    outs = [out, out.with_name(f"{out.name}-node1")]
    return [train_argv(engine, args, outs[k], node_launch(endpoint, k), lr) for k in (0, 1)]


def run_on_hosts(
    engine: str, args: argparse.Namespace, out: Path, hosts: NetnsHosts, port: int, lr: float | None = None
) -> dict[str, Any]:
    """Run `nanoddp train` once as two nodes, one per namespace host, over the fabric as `hosts`
    shapes it now; return node 0's summary (`summarize`) with its wall time. Either node failing
    fails the run; nothing either started outlives this call."""
    endpoint = f"{hosts.addresses[0]}:{port}"
    node0, node1 = (hosts.command(k, argv) for k, argv in enumerate(node_argvs(engine, args, out, endpoint, lr)))
    logger.info("running %s and %s", shlex.join(node0), shlex.join(node1))
    env = _run_env({})
    with child_run(node1, env=env) as peer:
        peer_output: list[str] = []

        def watch_peer(node0_proc: Popen) -> threading.Thread:
            """Read node 1's output on a thread (a full pipe would stall it, and node 0 with it);
            node 1 failing ends node 0, which would wait for it until a timeout."""

            def read() -> None:
                peer_output.append(finish(peer, RUN_TIMEOUT_S))
                if peer.returncode != 0:
                    end_tree(node0_proc)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            return reader

        run = run_training(node0, out, timeout_s=RUN_TIMEOUT_S, env=env, during=watch_peer)
        run.acted.join(timeout=PEER_EXIT_S if run.returncode == 0 else 0)
        if run.acted.is_alive():
            end_tree(peer)
            run.acted.join()
    nodes = [(node0, run.returncode, run.output), (node1, peer.returncode, "".join(peer_output))]
    for argv, code, text in sorted(nodes, key=lambda node: node[1] < 0):  # the one we ended is not the cause
        if code != 0:
            raise ChildFailed(f"`{shlex.join(argv)}` failed (exit {code}):\n{text[-3000:]}")
    return _result(engine, hosts.bits_per_s is not None, run, lr)


def _result(engine: str, shaped: bool, run: TrainingRun, lr: float | None) -> dict[str, Any]:
    return {"engine": engine, "shaped": shaped, "lr": lr, **summarize(run.records), "wall_s": run.wall_s}


def sweep(engines: tuple[str, ...], lrs: list[float] | None, run: Callable[[str, float | None], dict[str, Any]]
          ) -> list[dict[str, Any]]:  # fmt: skip
    """Every run of one link, in `engines`' order: each engine at every lr of `lrs` (None: once, at
    the model's default), or, for one with an `LR_TWIN`, once at its twin's best."""
    runs: list[dict[str, Any]] = []
    for engine in engines:
        twin = LR_TWIN.get(engine)
        if twin is None:
            engine_lrs: list[float | None] = list(lrs) if lrs else [None]
        else:
            engine_lrs = [r["lr"] for r in best_runs(runs) if r["engine"] == twin] or [None]
        runs += [run(engine, lr) for lr in engine_lrs]
    return runs


def repeat_kept(runs: list[dict[str, Any]], trials: int, run: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """Trials 1 to `trials` - 1 of one link's kept runs (`best_runs` of `runs`, the sweep's, trial
    0), interleaved: each kept engine once per trial at its kept lr, in the sweep's order on even
    trials and reversed on odd ones, so that a change in the host's load shifts every engine alike
    and no engine always runs right after the same one."""
    kept = best_runs(runs)
    again: list[dict[str, Any]] = []
    for trial in range(1, trials):
        for r in kept if trial % 2 == 0 else kept[::-1]:
            again.append({**run(r["engine"], r["lr"], trial), "trial": trial})
    return again


def run_bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every run (shaped, then unshaped), compared; the report `--json` writes. `args.link` and
    `args.latency` are settled (`choose_link`, `link_latency`)."""
    load_before = os.getloadavg()[0]  # other work on the host slows compute, the same for every run
    shapings = [True] + ([] if args.no_unshaped else [False])
    runs: list[dict[str, Any]] = []
    if args.link == "shaper":
        shaped = link_environ(args.bandwidth, args.latency)
        for shaping in shapings:

            def here(engine: str, lr: float | None, trial: int = 0, shaping: bool = shaping) -> dict[str, Any]:
                link = shaped if shaping else {}
                return run_one(engine, link, args, root / _dir(engine, shaping, lr, trial), lr)

            link_runs = sweep(ENGINES["shaper"], args.lrs, here)
            runs += link_runs + repeat_kept(link_runs, args.trials, here)
    else:
        ports = itertools.count(RDZV_PORT)  # a fresh rendezvous port, hence store, for every run
        with NetnsHosts(2) as hosts:
            for shaping in shapings:
                hosts.shape(parse_bandwidth(args.bandwidth, "--bandwidth") if shaping else None)

                def on_hosts(engine: str, lr: float | None, trial: int = 0, shaping: bool = shaping) -> dict[str, Any]:
                    out = root / _dir(engine, shaping, lr, trial)
                    return run_on_hosts(engine, args, out, hosts, next(ports), lr)

                link_runs = sweep(ENGINES["netns"], args.lrs, on_hosts)
                runs += link_runs + repeat_kept(link_runs, args.trials, on_hosts)
    meta = {
        "link": args.link, "bandwidth": args.bandwidth, "latency": args.latency, "steps": args.steps,
        "sync_every": args.sync_every, **{name: getattr(args, name) for name in DILOCO_FLAGS}, "lrs": args.lrs,
        "eval_every": args.eval_every, "eval_samples": args.eval_samples, "seed": args.seed, "trials": args.trials,
        "train_args": args.train_args, "nproc": 2, "date": time.strftime("%Y-%m-%d"),
        "host_cpus": os.cpu_count(), "load_avg_1min": [load_before, os.getloadavg()[0]], "command": _command(args),
        "commit": git_commit(),
    }  # fmt: skip
    return {"meta": meta, "results": runs, "summary": compare(runs)}  # the table re-derives it from the runs


def _name(shaped: bool) -> str:
    return "shaped" if shaped else "unshaped"


def _dir(engine: str, shaped: bool, lr: float | None, trial: int = 0) -> str:
    return f"{engine}-{_name(shaped)}" + ("" if lr is None else f"-lr{lr:g}") + (f"-trial{trial}" if trial else "")


def _command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    words = ["nanoddp", "bench", "wan", "--link", args.link, "--bandwidth", args.bandwidth]
    words += ["--latency", args.latency] if args.latency is not None else []
    words += ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--eval-every", str(args.eval_every)]
    for name in DILOCO_FLAGS:
        words += [] if getattr(args, name) is None else [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    words += [] if not args.lrs else ["--lrs", ",".join(f"{lr:g}" for lr in args.lrs)]
    words += ["--eval-samples", str(args.eval_samples), "--seed", str(args.seed)]
    words += ["--trials", str(args.trials)] if args.trials > 1 else []
    words += (["--no-unshaped"] if args.no_unshaped else []) + (
        ["--train-args", args.train_args] if args.train_args else []
    )
    return shlex.join(words)


def lr_list(text: str) -> list[float]:
    """`--lrs`: two or more distinct positive numbers, comma-separated."""
    try:
        lrs = [float(word) for word in text.split(",")]
    except ValueError:
        lrs = []
    if len(lrs) < 2 or len(set(lrs)) != len(lrs) or not all(0 < lr < float("inf") for lr in lrs):
        raise argparse.ArgumentTypeError(f"expected two or more distinct positive learning rates, comma-separated "
                                         f"(e.g. 1e-3,2e-3,4e-3), got {text!r}")  # fmt: skip
    return lrs


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "wan",
        help="DDP vs DiLoCo (and torch's DDP) on a slow link: time, bytes, loss",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--link", choices=tuple(ENGINES), default=None,
                        help="netns: each replica in a network namespace, the veths capped by the kernel (tc tbf), "
                             "torch's DDP measured too, no latency added (no netem); shaper: nanoddp's sends held "
                             "back in-process (bandwidth and latency), torch's DDP not run. Default: netns where "
                             "this process is root with ip and tc, else shaper")  # fmt: skip
    parser.add_argument("--bandwidth", default="100mbit", help="link rate, e.g. 100mbit, 1gbit, 12.5MB/s")
    parser.add_argument("--latency", default=None,
                        help=f"one-way latency, e.g. 20ms (default: {SHAPER_LATENCY} under --link shaper; none under "
                             "--link netns, which refuses a nonzero one)")  # fmt: skip
    parser.add_argument("--steps", type=count(1), default=1000, help="optimizer steps of every run")
    parser.add_argument("--sync-every", type=count(1), default=50, help="DiLoCo's H")
    parser.add_argument("--fragments", type=count(1), default=None,
                        help="Streaming DiLoCo: the model in this many fragments, syncing one at a time (H must be a "
                             "multiple; default: the trainer's, 1)")  # fmt: skip
    parser.add_argument(
        "--sync-delay",
        type=count(0),
        default=None,
        help="Streaming DiLoCo: inner steps a fragment's all-reduce overlaps (default: trainer's, 0)",
    )
    parser.add_argument(
        "--mix",
        type=float,
        default=None,
        help="Streaming DiLoCo: share of its local weights a fragment keeps (default: trainer's, 0)",
    )
    parser.add_argument(
        "--pseudo-grad-dtype",
        choices=("fp32", "bf16", "fp16", "int8"),
        default=None,
        help="DiLoCo's pseudo-gradient on the wire (default: the trainer's, fp32)",
    )
    parser.add_argument("--outer-lr", type=float, default=None, help="DiLoCo's outer lr (default: the trainer's)")
    parser.add_argument(
        "--outer-momentum", type=float, default=None, help="DiLoCo's outer Nesterov momentum (default: the trainer's)"
    )
    parser.add_argument("--lrs", type=lr_list, default=None,
                        help="comma-separated peak lrs, e.g. 1e-3,2e-3,4e-3: DDP and DiLoCo run at each and keep "
                             "the one with the lowest final val loss; torch's DDP and the no-sync run take their "
                             "twin's (default: every run at the model's lr, or --train-args' --lr)")  # fmt: skip
    parser.add_argument("--trials", type=count(1), default=1,
                        help="run each engine's kept run this many times, the engines interleaved trial by trial; "
                             "times are medians over trials and the ratios medians of each trial's ratio (the "
                             "losses and bytes are the first trial's)")  # fmt: skip
    parser.add_argument("--eval-every", type=count(1), default=50, help="validation loss every this many steps")
    parser.add_argument("--eval-samples", type=count(1), default=512, help="validation samples per evaluation")
    parser.add_argument("--seed", type=int, default=1337, help="the same seed for every run")
    parser.add_argument("--no-unshaped", action="store_true", help="skip the pair on loopback at full speed")
    parser.add_argument("--train-args", default="", help="more `nanoddp train` flags for every run, e.g. a model")
    add_output_args(parser, plot_help="validation loss vs training time, per engine and link (PNG)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    args.link, why = choose_link(args.link)
    args.latency = link_latency(args.link, args.latency)
    link_environ(args.bandwidth, args.latency)  # a bad value: refused before anything runs
    check_runs(args)
    if why is not None:  # a default is said, in one line
        print(f"nanoddp bench wan: --link {args.link} ({why})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="nanoddp-wan-") as root:
        report = run_bench(args, Path(root))
    print(format_markdown(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
