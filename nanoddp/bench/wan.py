"""`nanoddp bench wan`: DDP and DiLoCo over a slow link, side by side.

`nanoddp train` runs the built-in GPT on 2 replicas with the same steps, batch and seed: engine
`nanoddp` (DDP: every step all-reduces every gradient), engine `diloco --sync-every H` (each
replica takes H AdamW steps alone, then one all-reduce of the pseudo-gradient) and, over a kernel
link, engine `torch` (torch's own DDP, its gloo all-reduce: the baseline users would pick).

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
import logging
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import Popen
from typing import Any

from nanoddp.base.processes import child_run, end_tree, finish
from nanoddp.base.records import step_records
from nanoddp.bench.common import ChildFailed, add_output_args, save_figure, write_json
from nanoddp.bench.inputs import count
from nanoddp.bench.netns_hosts import NetnsHosts, shaping_unavailable_reason
from nanoddp.bench.training_run import TrainingRun, run_training, train_command
from nanoddp.comm.transport.link import BANDWIDTH_VAR, LATENCY_VAR, link_environ, parse_bandwidth, parse_latency
from nanoddp.train.launcher.cli import check_train_argv

logger = logging.getLogger(__name__)

# DDP first: its final validation loss is the target. torch's DDP only where the link shapes it.
ENGINES = {"shaper": ("nanoddp", "diloco"), "netns": ("nanoddp", "torch", "diloco")}
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


def train_argv(engine: str, args: argparse.Namespace, out: Path, launch: tuple[str, ...] = LOCAL_LAUNCH) -> list[str]:
    """The `nanoddp train` command of one run (of one node of it, with `node_launch`)."""
    return train_command(*train_flags(engine, args, out, launch))


def train_flags(engine: str, args: argparse.Namespace, out: Path, launch: tuple[str, ...] = LOCAL_LAUNCH) -> list[str]:
    """The flags of one run's `nanoddp train`: the benchmark's, then `--train-args`."""
    argv = ["--engine", engine, *launch, *BASE_ARGS, "--out", str(out)]
    argv += ["--steps", str(args.steps), "--seed", str(args.seed), "--eval-every", str(args.eval_every)]
    argv += ["--log-every", str(args.eval_every), "--eval-samples", str(args.eval_samples)]
    if engine == "diloco":
        argv += ["--sync-every", str(args.sync_every)]
    return argv + shlex.split(args.train_args)


def check_runs(args: argparse.Namespace) -> None:
    """Refuse now, in one line, what `nanoddp train` would refuse of either engine's run a minute
    in (`--train-args` parsed by its own parser, the config checked against its data)."""
    for engine in ENGINES[args.link]:
        try:
            check_train_argv(train_flags(engine, args, Path(tempfile.gettempdir(), "nanoddp-wan-unused")))
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


def run_one(engine: str, link: dict[str, str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run `nanoddp train` once on this machine (the shaper's `link`, or none); return its summary
    (`summarize`) with its wall time."""
    argv = train_argv(engine, args, out)
    logger.info("running %s", shlex.join(argv))
    run = run_training(argv, out, timeout_s=RUN_TIMEOUT_S, env=_run_env(link))
    if run.returncode != 0:
        raise ChildFailed(f"`{shlex.join(argv)}` failed (exit {run.returncode}):\n{run.output[-3000:]}")
    return _result(engine, bool(link), run)


def node_argvs(engine: str, args: argparse.Namespace, out: Path, endpoint: str) -> list[list[str]]:
    """The two nodes' `nanoddp train` commands; node 0 serves the rendezvous at `endpoint` (its
    own address) and writes `out`, node 1 its own directory beside it (two launchers never share
    a run dir)."""
    outs = [out, out.with_name(f"{out.name}-node1")]
    return [train_argv(engine, args, outs[k], node_launch(endpoint, k)) for k in (0, 1)]


def run_on_hosts(engine: str, args: argparse.Namespace, out: Path, hosts: NetnsHosts, port: int) -> dict[str, Any]:
    """Run `nanoddp train` once as two nodes, one per namespace host, over the fabric as `hosts`
    shapes it now; return node 0's summary (`summarize`) with its wall time. Either node failing
    fails the run; nothing either started outlives this call."""
    endpoint = f"{hosts.addresses[0]}:{port}"
    node0, node1 = (hosts.command(k, argv) for k, argv in enumerate(node_argvs(engine, args, out, endpoint)))
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
    return _result(engine, hosts.bits_per_s is not None, run)


def _result(engine: str, shaped: bool, run: TrainingRun) -> dict[str, Any]:
    return {"engine": engine, "shaped": shaped, **summarize(run.records), "wall_s": run.wall_s}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """From one run's metrics.jsonl records: its validation curve as [step, training seconds, val
    loss] (training seconds: the step times summed up to that step), total training time, the
    bytes rank 0 sent (sum of `comm_bytes`) and the final validation loss."""
    train_s, last_step, curve, comm_bytes = 0.0, 0, [], 0
    for record in step_records(records):
        train_s += record["step_time_s"] * (record["step"] - last_step)  # the mean over its window
        last_step = record["step"]
        comm_bytes += record.get("comm_bytes") or 0
        if record.get("val_loss") is not None:
            curve.append([record["step"], train_s, record["val_loss"]])
    if not curve:
        raise ValueError("metrics.jsonl holds no val_loss: the run must evaluate (--eval-every)")
    return {"steps": last_step, "train_s": train_s, "comm_bytes": comm_bytes, "final_val_loss": curve[-1][2],
            "curve": curve}  # fmt: skip


def time_to_reach(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose loss is <= `target` (None: never reached)."""
    return next((train_s for _, train_s, loss in curve if loss <= target), None)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link, DiLoCo against DDP: the loss gap at the same samples, the bytes ratio, and the
    training time each engine takes to DDP's final validation loss and to the loss both reach (the
    worse of the two finals), with their ratios (None: DiLoCo never reached it); where torch's DDP
    ran, its training time over DiLoCo's and over ours (the same steps: the steps/s ratios)."""
    summary: dict[str, Any] = {}
    for shaped in (True, False):
        ddp, torch_ddp, diloco = (next((r for r in runs if r["engine"] == e and r["shaped"] == shaped), None)
                                  for e in ENGINES["netns"])  # fmt: skip
        if ddp is None or diloco is None:
            continue
        target, common = ddp["final_val_loss"], max(ddp["final_val_loss"], diloco["final_val_loss"])
        present = [r for r in (ddp, torch_ddp, diloco) if r is not None]
        to_target = {r["engine"]: time_to_reach(r["curve"], target) for r in present}
        to_common = {r["engine"]: time_to_reach(r["curve"], common) for r in present}
        name = "shaped" if shaped else "unshaped"
        summary[name] = {
            "val_loss_gap": diloco["final_val_loss"] / target - 1,  # at the same steps, hence samples
            "bytes_ratio": ddp["comm_bytes"] / diloco["comm_bytes"] if diloco["comm_bytes"] else None,
            "time_to_ddp_final_s": to_target,
            "time_to_ddp_final_speedup": _quotient(to_target["nanoddp"], to_target["diloco"]),
            "common_val_loss": common,
            "time_to_common_s": to_common,
            "time_to_common_speedup": _quotient(to_common["nanoddp"], to_common["diloco"]),
            "train_time_speedup": ddp["train_s"] / diloco["train_s"],
        }
        if torch_ddp is not None:
            summary[name]["torch_ddp_over_diloco"] = torch_ddp["train_s"] / diloco["train_s"]
            summary[name]["torch_ddp_over_nanoddp"] = torch_ddp["train_s"] / ddp["train_s"]
    return summary


def _quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every run (shaped, then unshaped), compared; the report `--json` writes. `args.link` and
    `args.latency` are settled (`choose_link`, `link_latency`)."""
    load_before = os.getloadavg()[0]  # other work on the host slows compute, the same for every run
    shapings = [True] + ([] if args.no_unshaped else [False])
    if args.link == "shaper":
        shaped = link_environ(args.bandwidth, args.latency)
        runs = [run_one(engine, shaped if shaping else {}, args, root / f"{engine}-{_name(shaping)}")
                for shaping in shapings for engine in ENGINES["shaper"]]  # fmt: skip
    else:
        runs = []
        with NetnsHosts(2) as hosts:
            for shaping in shapings:
                hosts.shape(parse_bandwidth(args.bandwidth, "--bandwidth") if shaping else None)
                for engine in ENGINES["netns"]:
                    out = root / f"{engine}-{_name(shaping)}"
                    runs.append(run_on_hosts(engine, args, out, hosts, RDZV_PORT + len(runs)))  # a fresh store each
    meta = {
        "link": args.link, "bandwidth": args.bandwidth, "latency": args.latency, "steps": args.steps,
        "sync_every": args.sync_every,
        "eval_every": args.eval_every, "eval_samples": args.eval_samples, "seed": args.seed,
        "train_args": args.train_args, "nproc": 2, "date": time.strftime("%Y-%m-%d"),
        "host_cpus": os.cpu_count(), "load_avg_1min": [load_before, os.getloadavg()[0]], "command": _command(args),
    }  # fmt: skip
    return {"meta": meta, "results": runs, "summary": compare(runs)}  # the table re-derives it from the runs


def _name(shaped: bool) -> str:
    return "shaped" if shaped else "unshaped"


def _command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    words = ["nanoddp", "bench", "wan", "--link", args.link, "--bandwidth", args.bandwidth]
    words += ["--latency", args.latency] if args.latency is not None else []
    words += ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--eval-every", str(args.eval_every)]
    words += ["--eval-samples", str(args.eval_samples), "--seed", str(args.seed)]
    words += (["--no-unshaped"] if args.no_unshaped else []) + (
        ["--train-args", args.train_args] if args.train_args else []
    )
    return shlex.join(words)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _seconds(s: float | None) -> str:
    return "not reached" if s is None else f"{s:,.0f} s"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×"


def _engine_name(engine: str, meta: dict[str, Any]) -> str:
    return {"nanoddp": "DDP (`nanoddp`)", "torch": "DDP (`torch`)"}.get(engine, f"DiLoCo H={meta['sync_every']}")


def _link_name(meta: dict[str, Any], shaped: bool) -> str:
    """`100mbit, 20ms` / `loopback` under the shaper (files from before `--link` are the shaper's);
    `100mbit veth (tbf)` / `veth, full speed` under netns."""
    if meta.get("link", "shaper") == "netns":
        return f"{meta['bandwidth']} veth (tbf)" if shaped else "veth, full speed"
    return f"{meta['bandwidth']}, {meta['latency']}" if shaped else "loopback"


def format_markdown(report: dict[str, Any]) -> str:
    """The table (one row per run) and one line per link on the goals, derived from the runs' own
    figures (`compare`), so the text cannot drift from the data."""
    meta, summary = report["meta"], compare(report["results"])
    rows = ["| link | engine | steps | training time | wall time | bytes sent (rank 0) | final val loss "
            "| training time to DDP's final val loss |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["results"]:
        engine = _engine_name(r["engine"], meta)
        reached = summary["shaped" if r["shaped"] else "unshaped"]["time_to_ddp_final_s"][r["engine"]]
        rows.append(f"| {_link_name(meta, r['shaped'])} | {engine} | {r['steps']:,} | "
                    f"{_seconds(r['train_s'])} | {_seconds(r['wall_s'])} | {_mb(r['comm_bytes'])} | "
                    f"{r['final_val_loss']:.4f} | {_seconds(reached)} |")  # fmt: skip
    lines = ["\n".join(rows), ""]
    for name, s in summary.items():
        link = _link_name(meta, name == "shaped")
        speedup = s["time_to_ddp_final_speedup"]
        reach = (f"reaches DDP's final val loss {_ratio(speedup)} sooner" if speedup is not None
                 else f"does not reach DDP's final val loss in {meta['steps']:,} steps")  # fmt: skip
        common = s["time_to_common_s"]
        both = (f"to {s['common_val_loss']:.4f}, the val loss both reach, DDP takes {_seconds(common['nanoddp'])} "
                f"and DiLoCo {_seconds(common['diloco'])} ({_ratio(s['time_to_common_speedup'])})")  # fmt: skip
        lines.append(f"- {link}: DiLoCo's final val loss is {s['val_loss_gap']:+.1%} from DDP's at the same "
                     f"samples, with {_ratio(s['bytes_ratio'])} fewer bytes; it {reach}; {both}; training time "
                     f"{_ratio(s['train_time_speedup'])} shorter{_against_torch(s)}.")  # fmt: skip
    return "\n".join(lines).rstrip()


def _against_torch(s: dict[str, Any]) -> str:
    if "torch_ddp_over_diloco" not in s:
        return ""
    return (f"; torch's DDP on the same link takes {_ratio(s['torch_ddp_over_diloco'])} DiLoCo's training time "
            f"and {_ratio(s['torch_ddp_over_nanoddp'])} ours")  # fmt: skip


def plot(report: dict[str, Any], path: str) -> None:
    """Validation loss against training time (left) and against steps (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report["results"]:
        name, link = _engine_name(r["engine"], meta).replace("`", ""), _link_name(meta, r["shaped"])
        steps, seconds, losses = zip(*r["curve"], strict=True)
        style = {
            "linestyle": "-" if r["shaped"] else "--",
            "color": {"nanoddp": "C0", "torch": "C2"}.get(r["engine"], "C1"),
        }
        by_time.plot(seconds, losses, label=f"{name}, {link}", **style)
        by_step.plot(steps, losses, label=f"{name}, {link}", **style)
    by_time.set(xlabel="training time (s)", ylabel="validation loss", xscale="log")
    by_step.set(xlabel="step (same samples per step)", ylabel="validation loss")
    by_time.legend(fontsize=8)
    fig.suptitle(f"nanoddp bench wan: GPT, 2 ranks, {meta['steps']} steps ({meta['date']})")
    fig.tight_layout()
    save_figure(path, fig)


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
