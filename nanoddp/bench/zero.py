"""`nanoddp bench zero`: DDP + ZeRO-1 AdamW against DDP + AdamW, side by side.

What ZeRO buys is memory; what it costs is a parameter broadcast per step. So for each world
size both variants train the same GPT on the same random tokens, and each reports optimizer
state bytes per rank (exact accounting), peak memory per rank (the process's RSS high-water
mark from getrusage, or CUDA max_memory_allocated on GPU) and samples/s.

Each measurement is a fresh launch, because a process's peak RSS can only go up. Launches
alternate between the variants (A B B A ...), so machine noise hits both alike; samples/s is
the median over rounds, memory the largest value seen.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import statistics
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import nanoddp
from nanoddp.bench.common import add_output_args, parse_world_sizes, write_json
from nanoddp.bench.inputs import count
from nanoddp.models import GPT, gpt_config
from nanoddp.parallel.zero.stage1 import ZeroRedundancyOptimizer, optimizer_state_bytes

logger = logging.getLogger(__name__)

VARIANTS = ("ddp_adamw", "ddp_zero")
MB = 1 << 20


def _wrap(model: torch.nn.Module, ddp: str) -> torch.nn.Module:
    return TorchDDP(model) if ddp == "torch" else nanoddp.DistributedDataParallel(model)


def _warm_lazy_imports(env: nanoddp.DistEnv, ddp: str) -> None:
    """torch DDP imports torch._dynamo (and sympy) on first use: ~100 MB that isn't training."""
    probe = torch.nn.Linear(2, 2).to(env.device)
    wrapped = _wrap(probe, ddp)
    wrapped(torch.ones(1, 2, device=env.device)).sum().backward()
    ZeroRedundancyOptimizer(probe.parameters(), torch.optim.AdamW).step()


def _bench_worker(
    env: nanoddp.DistEnv, variant: str, preset: str, ddp: str, batch_size: int, steps: int, warmup: int
) -> dict:
    """One variant on one rank: train, time, and account memory. Returns this rank's numbers."""
    torch.set_num_threads(1)  # ranks share the cores; oversubscription would time the scheduler
    on_gpu = env.device.type == "cuda"
    _warm_lazy_imports(env, ddp)  # so the RSS baseline below already holds the libraries
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(env.device)
    rss_before = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    cfg = gpt_config(preset)
    model = _wrap(GPT(cfg).to(env.device), ddp)
    if variant == "ddp_zero":
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(env.rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g).to(env.device)
    idx, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        one_step()
    if on_gpu:
        torch.cuda.synchronize(env.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    if on_gpu:
        torch.cuda.synchronize(env.device)
    elapsed = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "elapsed_s": elapsed,
        "state_bytes": optimizer_state_bytes(optimizer),
        "peak_rss_bytes": peak_rss,
        "peak_rss_delta_bytes": peak_rss - rss_before,
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(env.device) if on_gpu else None,
    }


def _measure(variant: str, n: int, preset: str, ddp: str, batch_size: int, steps: int, warmup: int) -> dict:
    """One fresh launch of one variant; the slowest rank's time, the largest rank's memory."""
    per_rank = nanoddp.launch(_bench_worker, n, args=(variant, preset, ddp, batch_size, steps, warmup))
    cuda = [r["cuda_max_allocated_bytes"] for r in per_rank if r["cuda_max_allocated_bytes"] is not None]
    return {
        "samples_per_s": n * batch_size * steps / max(r["elapsed_s"] for r in per_rank),
        "state_bytes_per_rank": max(r["state_bytes"] for r in per_rank),
        "state_bytes_total": sum(r["state_bytes"] for r in per_rank),
        "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in per_rank),
        "peak_rss_delta_bytes_per_rank": max(r["peak_rss_delta_bytes"] for r in per_rank),
        "cuda_max_allocated_bytes_per_rank": max(cuda) if cuda else None,
    }


def run_benchmark(
    nprocs: list[int],
    preset: str,
    steps: int,
    warmup: int = 3,
    batch_size: int = 8,
    rounds: int = 2,
    ddp: str = "torch",
) -> list[dict]:
    """One row per (world size, variant), plus ratios against DDP + AdamW on the ZeRO row."""
    rows = []
    for n in nprocs:
        seen: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):  # A B, B A, ...
                logger.info("ws %d round %d: %s", n, r, variant)
                seen[variant].append(_measure(variant, n, preset, ddp, batch_size, steps, warmup))
        by_variant = {}
        for variant, runs in seen.items():
            row: dict[str, Any] = {
                "model": preset,
                "world_size": n,
                "variant": variant,
                "rounds": rounds,
                "steps": steps,
            }
            row["samples_per_s"] = statistics.median(m["samples_per_s"] for m in runs)
            for key in runs[0]:
                if key != "samples_per_s":
                    values = [m[key] for m in runs if m[key] is not None]
                    row[key] = max(values) if values else None
            by_variant[variant] = row
        base, zero = by_variant["ddp_adamw"], by_variant["ddp_zero"]
        zero["samples_per_s_ratio"] = zero["samples_per_s"] / base["samples_per_s"]
        zero["state_fraction_of_unsharded"] = zero["state_bytes_per_rank"] / base["state_bytes_per_rank"]
        zero["peak_rss_delta_ratio"] = zero["peak_rss_delta_bytes_per_rank"] / base["peak_rss_delta_bytes_per_rank"]
        rows += [base, zero]
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'model':<6}{'ws':>3}  {'variant':<10}{'samples/s':>10}{'state MB/rank':>15}"
        f"{'x 1/ws':>8}{'peak RSS MB':>13}{'(+train)':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        fraction = r.get("state_fraction_of_unsharded")
        ideal = f"{fraction * r['world_size']:>8.3f}" if fraction is not None else f"{'':>8}"
        lines.append(
            f"{r['model']:<6}{r['world_size']:>3}  {r['variant']:<10}{r['samples_per_s']:>10.1f}"
            f"{r['state_bytes_per_rank'] / MB:>15.2f}{ideal}{r['peak_rss_bytes_per_rank'] / MB:>13.0f}"
            f"{r['peak_rss_delta_bytes_per_rank'] / MB:>10.0f}"
        )
    lines.append(
        "x 1/ws: ZeRO state per rank / (unsharded state / ws), target <= 1.05; peak RSS is the "
        "process high-water mark, (+train) its growth after start-up"
    )
    return "\n".join(lines)


def register_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "zero",
        help="DDP + ZeRO-1 AdamW vs DDP + AdamW: optimizer memory, peak memory, samples/s",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--nproc", default="2,4", help="comma-separated world sizes (default: 2,4)")
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny", help="GPT preset")
    parser.add_argument("--steps", type=count(1), default=20, help="timed steps per launch")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed steps per launch")
    parser.add_argument("--batch-size", type=count(1), default=8, help="sequences per rank per step")
    parser.add_argument("--rounds", type=count(1), default=2, help="launches per variant, alternating")
    parser.add_argument("--ddp", choices=["torch", "nanoddp"], default="torch", help="the DDP wrapper")
    add_output_args(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    nprocs = parse_world_sizes(args.nproc)
    rows = run_benchmark(nprocs, args.model, args.steps, args.warmup, args.batch_size, args.rounds, args.ddp)
    print(format_table(rows))
    meta = {
        "torch": torch.__version__, "nanoddp": nanoddp.__version__, "host": platform.node(),
        "cpus": os.cpu_count(), "threads_per_rank": 1, "optimizer": "AdamW", "dtype": "float32",
        "batch_size_per_rank": args.batch_size, "warmup": args.warmup, "ddp": args.ddp,
        "cuda": torch.cuda.is_available(),
    }  # fmt: skip
    if args.json:
        write_json(args.json, {"meta": meta, "results": rows})
        print(f"wrote {args.json}")
    return 0
