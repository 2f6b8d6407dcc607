"""`nanoddp bench collectives`: nanoddp.comm against torch.distributed, side by side.

For every collective, message size and world size, both implementations run in the same
processes on the same tensors, iteration by iteration in alternation (who goes first flips each
iteration), so machine noise hits both alike. Each iteration is timed on every rank after a
barrier; an iteration's time is the slowest rank's, and the median over iterations is reported.

Bandwidth follows the nccl-tests convention: algbw = size / time and busbw = algbw * factor,
with factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter (whose size is
the whole gathered/scattered buffer) and 1 for broadcast. busbw is comparable across world
sizes: it is the bandwidth each link would need.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

import nanoddp
from nanoddp import comm
from nanoddp.bench import add_output_args, parse_world_sizes, save_figure, write_json
from nanoddp.bench.floor import bare_pattern
from nanoddp.bench.inputs import count
from nanoddp.bench.machine import command_line, git_commit
from nanoddp.comm.plan import plan
from nanoddp.comm.plan.plan import Path

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")  # the default set
EXTRA_OPS = ("all_to_all",)  # on request (--ops): all_to_all_single, equal splits
DEFAULT_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KB .. 64 MB, powers of 4
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
SMALL_BYTES = 1 << 20  # below this, run 5x the iterations: small timings are noisier
CONTESTANTS = ("nanoddp", "torch", "bare")  # timing columns in this order; "bare" only with --floor


# torch 2.13 renamed these two (the old names warn on every call); older releases have only the old ones
_TORCH_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_TORCH_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _op_pair(op: str, size: int, n: int, rank: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(nanoddp call, torch call) for one op on float32 tensors totalling `size` bytes."""
    numel = max(1, size // 4)
    if op == "all_reduce":
        x = torch.randn(numel)
        return lambda: comm.all_reduce(x), lambda: dist.all_reduce(x)
    if op == "broadcast":
        x = torch.randn(numel)
        return lambda: comm.broadcast(x, src=0), lambda: dist.broadcast(x, src=0)
    part = max(1, numel // n)
    small, big = torch.randn(part), torch.empty(part * n)
    if op == "all_to_all":  # size = the whole input; each rank sends size / n to each peer
        x = torch.randn(part * n)
        return lambda: comm.all_to_all_single(big, x), lambda: dist.all_to_all_single(big, x)
    if op == "all_gather":
        return (
            lambda: comm.all_gather_into_tensor(big, small),
            lambda: _TORCH_ALL_GATHER(big, small),
        )
    big.normal_()
    return lambda: comm.reduce_scatter_tensor(small, big), lambda: _TORCH_REDUCE_SCATTER(small, big)


def _time_once(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_round(contestants: list[Callable[[], object]], i: int) -> list[float]:
    """Seconds for each contestant in iteration i, in the order given; who goes first rotates every
    iteration (with two, it flips), so none always runs right after another: an op's time depends on
    what ran just before it on the same connections and caches, so a fixed order would favour one."""
    k = len(contestants)
    times = [0.0] * k
    for j in range(k):
        who = (i + j) % k
        times[who] = _time_once(contestants[who])
    return times


def _bench_worker(
    env: nanoddp.DistEnv, ops: list[str], sizes: list[int], iters: int, warmup: int, floor: bool = False
) -> list[dict]:
    """Runs on every rank; returns (on every rank) one row per (op, size) with every timing:
    ours, torch's and, with `floor`, the bare send/recv of the same bytes (`nanoddp.bench.floor`)."""
    torch.set_num_threads(1)  # one core per rank at most: ranks share the host's cores
    n, rows = env.world_size, []
    for op in ops:
        for size in sizes:
            contestants = list(_op_pair(op, size, n, env.rank))
            if floor:
                contestants.append(bare_pattern(op, size, env.rank, n)[0])
            for _ in range(warmup):
                for run in contestants:
                    run()
            count = iters * 5 if size < SMALL_BYTES else iters
            times = torch.tensor([_time_round(contestants, i) for i in range(count)])  # (I, 2 or 3)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
            rows.append(_row(op, size, n, times))
            if env.is_master:
                logger.info("%s ws=%d %s done", op, n, _human(size))
    return rows


# Each rank's share of a `size`-byte buffer over `n` ranks (all_gather and reduce_scatter: `size`
# is the whole gathered/scattered buffer, of which each rank holds one part).
_SHARE_BYTES = {
    "all_reduce": lambda size, n: size,
    "broadcast": lambda size, n: size,
    "all_gather": lambda size, n: size // n,
    "reduce_scatter": lambda size, n: size // n,
}
# What each path does, as the path column says it (the ring by op: what its steps move).
_ALGORITHM = {
    Path.RING: {
        "all_reduce": "pipelined ring (reduce-scatter + all-gather)",
        "all_gather": "ring, pieces received in place",
        "reduce_scatter": "ring",
    },
    Path.EXCHANGE: "one exchange of whole tensors, each piece reduced as it lands",
    Path.CHAIN: "pipelined chain",
    Path.DIRECT: "straight from the root to every rank",
    Path.HEADER_ONLY: "no data",
    Path.HALVING_DOUBLING: {
        "all_reduce": "recursive halving + doubling (Rabenseifner)",
        "all_gather": "recursive doubling",
        "reduce_scatter": "recursive halving",
    },
    Path.TREE: "binomial tree",
    Path.SCATTER_ALLGATHER: "scatter + all-gather by doubling (van de Geijn)",
}


def comm_path(op: str, size: int, n: int, gloo: bool = True) -> str:
    """How nanoddp.comm moves this message, as `nanoddp.comm.plan.plan.plan` decides it: data in the
    header round's frames (one round, the check costs nothing extra) or the bulk algorithm after
    the header round, whose first piece travels *with* the round where `plan.early_bytes` allows.
    The header round is one exchange at 2 ranks, a star through rank 0 above
    (`nanoddp.comm.protocol.header_round`)."""
    if op == "all_to_all":
        return "header round (split sizes), then pairwise exchange"
    round_shape = "exchange" if n <= 2 else "star via rank 0"
    share = _SHARE_BYTES[op](size, n)
    path = plan.plan(op, share, n, "gloo" if gloo else "nccl")
    if path.in_frames:
        return f"one round ({round_shape}): data in the frames"
    algorithm = _ALGORITHM[path]
    if isinstance(algorithm, dict):
        algorithm = algorithm[op]
    ring_chunk = path is Path.RING and op == "all_reduce"
    first_piece = share // n if ring_chunk else share  # the ring's chunk, else the whole message
    sends_early = path in (Path.RING, Path.EXCHANGE, Path.CHAIN, Path.DIRECT)  # the new paths send nothing early
    early = plan.early_bytes(first_piece, gloo) if sends_early else 0
    timing = f"with its first {_human(early)} early" if early else "then"
    return f"header round ({round_shape}), {timing}: {algorithm}"


def _row(op: str, size: int, n: int, times: torch.Tensor) -> dict[str, Any]:
    """One (op, size, ws) result from its (iterations, contestants) times: medians, bandwidths,
    ours ÷ torch and, where the bare send/recv ran, bare ÷ torch (how close the transport alone
    gets to torch's built-in) and ours ÷ bare (what our algorithm and checks cost on top of it)."""
    factor = BUSBW_FACTOR[op](n)
    row: dict[str, Any] = {
        "op": op,
        "world_size": n,
        "size_bytes": size,
        "iters": times.shape[0],
        "path": comm_path(op, size, n),
    }
    columns = list(zip(CONTESTANTS[: times.shape[1]], times.unbind(1), strict=True))
    samples = {impl: [round(t * 1e6) for t in column.tolist()] for impl, column in columns}  # whole µs
    for impl, column in columns:
        t = statistics.median(column.tolist())
        row[f"{impl}_time_us"] = t * 1e6
        row[f"{impl}_algbw_gbps"] = size / t / 1e9
        row[f"{impl}_busbw_gbps"] = size / t / 1e9 * factor
    row["busbw_ratio"] = row["nanoddp_busbw_gbps"] / row["torch_busbw_gbps"]
    row["paired_ratio"] = paired_ratio(samples["torch"], samples["nanoddp"])
    if "bare_time_us" in row:
        row["bare_ratio"] = row["bare_busbw_gbps"] / row["torch_busbw_gbps"]
        row["bare_paired_ratio"] = paired_ratio(samples["torch"], samples["bare"])
        row["nanoddp_vs_bare"] = row["nanoddp_busbw_gbps"] / row["bare_busbw_gbps"]
    row["samples_us"] = samples  # every iteration's time per contestant (slowest rank), for re-analysis
    return row


def paired_ratio(reference_us: list[float], contestant_us: list[float]) -> float:
    """Median over iterations of reference time ÷ contestant time in the same iteration (> 1: the
    contestant is faster). Paired per iteration, so a slow spell of the machine, which hits both
    in that iteration, cancels out instead of shifting one median."""
    return statistics.median(r / c for r, c in zip(reference_us, contestant_us, strict=True))


def run_benchmark(
    nprocs: list[int], ops: list[str], sizes: list[int], iters: int, warmup: int, floor: bool = False
) -> list[dict]:
    rows = []
    for n in nprocs:
        rows += nanoddp.launch(_bench_worker, n, args=(ops, sizes, iters, warmup, floor), backend="gloo")[0]
    return rows


def _human(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _has_floor(rows: list[dict]) -> bool:
    """Whether these rows come from a `--floor` run (every row then has the bare send/recv timing)."""
    return bool(rows) and all("bare_time_us" in r for r in rows)


def format_table(rows: list[dict]) -> str:
    bare = _has_floor(rows)
    head = (
        f"{'op':<15}{'ws':>3}{'size':>8}{'nanoddp us':>12}{'torch us':>11}"
        f"{'nanoddp busbw':>15}{'torch busbw':>13}{'ratio':>7}" + (f"{'bare us':>10}{'bare ratio':>12}" if bare else "")
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:<15}{r['world_size']:>3}{_human(r['size_bytes']):>8}{r['nanoddp_time_us']:>12.0f}"
            f"{r['torch_time_us']:>11.0f}{r['nanoddp_busbw_gbps']:>15.3f}{r['torch_busbw_gbps']:>13.3f}"
            f"{r['paired_ratio']:>7.2f}"
            + (f"{r['bare_time_us']:>10.0f}{r['bare_paired_ratio']:>12.2f}" if bare else "")
        )
    lines.append(
        "busbw in GB/s (nccl-tests convention); ratio = median over iterations of torch's time / ours in the "
        "same iteration (> 1: ours is faster)"
    )
    if bare:
        lines.append(
            "bare = the same bytes over bare send/recv (transport floor); bare ratio = torch's time / its, paired"
        )
    return "\n".join(lines)


BARE_LEGEND = (
    "bare send/recv: the same bytes moved by the group's own send/recv with nothing else (no header "
    "round, checks or reductions; `nanoddp/bench/floor.py`), timed in the same rotation; bare ÷ torch "
    "(paired, as the ratio) below 1 means the transport alone is slower than torch's built-in at that size."
)


def format_markdown(data: dict) -> str:
    """The docs' table: per op, size and world size, the ratio to torch's built-in and the path."""
    meta, rows = data["meta"], data["results"]
    caption = (
        f"gloo, {meta.get('dtype', 'float32')}, {meta.get('cpus', '?')} cores, torch {meta.get('torch', '?')}; "
        f"median of {meta.get('iters', '?')} paired iterations (x5 below 1 MB), slowest rank per iteration; "
        "ratio = median over iterations of torch's time ÷ ours in the same iteration (> 1: ours is faster)"
    )
    if meta.get("date"):
        caption += f"; {meta['date'][:10]}, commit {meta.get('commit', '?')}"
    if meta.get("load_average_before"):
        caption += f"; 1-min load {meta['load_average_before'][0]:.1f}"
    bare = _has_floor(rows)
    bare_head, bare_rule = (" bare send/recv µs | bare ÷ torch |", "---|---|") if bare else ("", "")
    lines = [
        caption,
        "",
        f"| op | ws | size | nanoddp µs | torch µs | ratio |{bare_head} nanoddp path |",
        f"|---|---|---|---|---|---|{bare_rule}---|",
    ]
    for r in sorted(rows, key=lambda r: (r["op"], r["world_size"], r["size_bytes"])):
        path = r.get("path") or comm_path(r["op"], r["size_bytes"], r["world_size"])
        bare_cells = f" {r['bare_time_us']:,.0f} | {r['bare_paired_ratio']:.2f} |" if bare else ""
        lines.append(
            f"| {r['op']} | {r['world_size']} | {_human(r['size_bytes'])} | {r['nanoddp_time_us']:,.0f} | "
            f"{r['torch_time_us']:,.0f} | {r['paired_ratio']:.2f} |{bare_cells} {path} |"
        )
    if bare:
        lines += ["", BARE_LEGEND]
    return "\n".join(lines)


def write_plot(path: str, rows: list[dict]) -> None:
    """busbw vs size, one panel per op, a solid (nanoddp) and dashed (torch) line per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for n in sorted({r["world_size"] for r in rows}):
            sel = sorted((r for r in rows if r["op"] == op and r["world_size"] == n), key=lambda r: r["size_bytes"])
            sizes = [r["size_bytes"] for r in sel]
            line = ax.plot(sizes, [r["nanoddp_busbw_gbps"] for r in sel], "o-", label=f"nanoddp ws={n}")[0]
            ax.plot(
                sizes,
                [r["torch_busbw_gbps"] for r in sel],
                "s--",
                color=line.get_color(),
                label=f"torch ws={n}",
            )
        ax.set(xscale="log", title=op, xlabel="message size (bytes)", ylabel="busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(path, fig)


def _size_list(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    sizes = []
    for item in text.replace(",", " ").split():
        scale = units.get(item[-1].lower(), 1) if item[-1].isalpha() else 1
        number = item[:-1] if item[-1].isalpha() else item
        try:
            sizes.append(int(float(number) * scale))
        except ValueError:
            raise ValueError(f"--sizes: cannot read {item!r}; use bytes or K/M suffixes, e.g. 4K,1M") from None
    return sizes


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "collectives",
        help="nanoddp.comm vs torch.distributed: time, algbw, busbw",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--nproc", default="2,4", help="comma-separated world sizes (default: 2,4)")
    parser.add_argument(
        "--sizes", nargs="+", default=None, help="bytes, K/M suffixes allowed (default: 4K..64M, powers of 4)"
    )
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma-separated ops (default: {','.join(OPS)}; also {','.join(EXTRA_OPS)})",
    )
    parser.add_argument("--iters", type=count(1), default=10, help="timed iterations per point (x5 below 1 MB)")
    parser.add_argument("--warmup", type=count(0), default=2, help="untimed iterations per point")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the same bytes over bare send/recv (no checks, no reductions): the transport floor",
    )
    add_output_args(parser, plot_help="write a busbw-vs-size PNG")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    nprocs = parse_world_sizes(args.nproc, minimum=2)  # a collective needs a peer
    sizes = _size_list(" ".join(args.sizes)) if args.sizes else list(DEFAULT_SIZES)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"--sizes must be >= 4 bytes (one float32), got {sizes}")
    if unknown := [op for op in ops if op not in OPS + EXTRA_OPS]:
        raise ValueError(f"--ops: unknown {unknown}; choose from {list(OPS + EXTRA_OPS)}")
    load_before = list(os.getloadavg())  # what else kept the cores busy, read before we add to it
    rows = run_benchmark(nprocs, ops, sizes, args.iters, args.warmup, floor=args.floor)
    print(format_table(rows))
    meta = {
        "torch": torch.__version__, "nanoddp": nanoddp.__version__, "backend": "gloo", "dtype": "float32",
        "host": platform.node(), "cpus": os.cpu_count(), "iters": args.iters, "warmup": args.warmup,
        "threads_per_rank": 1, "floor": args.floor,
        "inline_send_bytes": comm.INLINE_SEND_BYTES, "bulk_from_bytes": plan.BULK_FROM_BYTES,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()), "command": command_line(),
    }  # fmt: skip
    if args.json:
        write_json(args.json, {"meta": meta, "results": rows})
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0
