"""The smallest honest DDP: `nanoddp.SimpleDDP`, step by step.

1. Replica check: a model built after seeding each rank differently is refused (ValueError on
   every rank); seeded identically, it is accepted and `verify_replicas` agrees.
2. Manual sharding: rank r trains on samples r, r+W, r+2W, ... (`nanoddp.train.data.sampler.shard`).
3. Gradient accumulation with `no_sync()`: K micro-batches, one all-reduce; the gradient equals
   a single-process backward over all ranks' micro-batches at once.
4. Timing: the same per-process batch in 1 and in W processes (W x the samples per step).

Data: scikit-learn's 8x8 digits; model: `nanoddp.models.MLPClassifier`.

    python examples/simple_ddp.py [--nproc 2] [--steps 40] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import nullcontext

import torch

import nanoddp
from nanoddp import comm
from nanoddp.models import MLPClassifier
from nanoddp.parallel.replicas import gather_json
from nanoddp.train.data.datasets import digits_splits
from nanoddp.train.data.sampler import shard


def replica_check(env: nanoddp.DistEnv, seed: int) -> None:
    nanoddp.seed_everything(seed, env.rank)  # seed + rank: every rank initialises differently
    try:
        nanoddp.SimpleDDP(MLPClassifier())
        raised = None
    except ValueError as exc:
        raised = str(exc)
    raised_on = gather_json(raised is not None, comm)
    if env.is_master:
        print(f"different seeds -> ValueError on ranks {[r for r, x in enumerate(raised_on) if x]}:\n  {raised}")
    nanoddp.seed_everything(seed, same_across_ranks=True)  # the fix: the same seed everywhere
    model = nanoddp.SimpleDDP(MLPClassifier())
    nanoddp.verify_replicas(model.model)  # would raise if any rank differed
    if env.is_master:
        print("same seed -> SimpleDDP accepted the model; verify_replicas: all ranks identical")


def manual_sharding(env: nanoddp.DistEnv, train) -> None:
    mine = shard(train, env.rank, env.world_size)  # a Subset: indices rank::world_size
    everyone = gather_json(list(mine.indices), comm)
    if env.is_master:
        for rank, indices in enumerate(everyone):
            print(f"rank {rank}: {len(indices)} samples, indices {indices[:5]} ...")
        flat = [i for indices in everyone for i in indices]
        print(
            f"disjoint: {len(flat) == len(set(flat))}; {len(flat)} of {len(train)} samples used "
            f"(drop_last keeps the shards equal)"
        )


def accumulation(env: nanoddp.DistEnv, train, micro_batches: int, batch_size: int) -> None:
    ddp = nanoddp.SimpleDDP(MLPClassifier())  # seeded identically above
    reference = copy.deepcopy(ddp.model)  # one process, every rank's micro-batches at once
    shards = [shard(train, rank, env.world_size).indices for rank in range(env.world_size)]
    batches = [
        [shards[r][m * batch_size : (m + 1) * batch_size] for m in range(micro_batches)] for r in range(env.world_size)
    ]  # batches[rank][m]: sample indices
    for m, indices in enumerate(batches[env.rank]):
        last = m == micro_batches - 1
        with nullcontext() if last else ddp.no_sync():
            _, loss = ddp(train.features[indices], train.labels[indices])
            (loss / micro_batches).backward()  # gradients add up in .grad
            ddp.sync_gradients()  # a no-op inside no_sync(): no communication
        if env.is_master:
            print(f"micro-batch {m}: backward, then {'ALL-REDUCE' if last else 'no sync (inside no_sync)'}")
    everything = [i for per_rank in batches for indices in per_rank for i in indices]  # (W*K*B,)
    reference(train.features[everything], train.labels[everything])[1].backward()
    pairs = zip(ddp.parameters(), reference.parameters(), strict=True)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
    if env.is_master:
        print(f"max |accumulated grad - {len(everything)}-sample single-process grad| = {diff:.2e}")


def timed_training(env: nanoddp.DistEnv, train, val, args: argparse.Namespace) -> tuple[float, float]:
    """Train with SimpleDDP; return (seconds per step, validation accuracy)."""
    steps, batch_size = args.steps, args.batch_size
    nanoddp.seed_everything(0, same_across_ranks=True)
    ddp = nanoddp.SimpleDDP(MLPClassifier(hidden=args.hidden))
    optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    mine = shard(train, env.rank, env.world_size)
    generator = torch.Generator().manual_seed(env.rank)
    start = time.perf_counter()
    for _ in range(steps):
        pick = torch.tensor(mine.indices)[torch.randint(len(mine), (batch_size,), generator=generator)]
        _, loss = ddp(train.features[pick], train.labels[pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ddp.sync_gradients()
        optimizer.step()
    seconds = (time.perf_counter() - start) / steps
    with torch.no_grad():
        accuracy = (ddp(val.features).argmax(-1) == val.labels).float().mean().item()
    return seconds, accuracy


def worker(env: nanoddp.DistEnv, args: argparse.Namespace) -> tuple[float, float]:
    torch.set_num_threads(1)
    train, val = digits_splits(0.2)
    if env.world_size > 1:
        for title, part in (
            ("1. replica check", lambda: replica_check(env, args.seed)),
            ("2. manual sharding", lambda: manual_sharding(env, train)),
            ("3. no_sync accumulation", lambda: accumulation(env, train, 4, 8)),
        ):
            if env.is_master:
                print(f"== {title} ==")
            part()
    return timed_training(env, train, val, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="training steps for the timing")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width: more compute per step")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    multi = nanoddp.launch(worker, args.nproc, args=(args,), backend="gloo")[0]
    single = nanoddp.launch(worker, 1, args=(args,), backend="gloo")[0]
    print("== 4. timing: the same per-process batch ==")
    for n, (seconds, accuracy) in ((1, single), (args.nproc, multi)):
        print(
            f"{n} process(es): {seconds * 1e3:6.1f} ms/step, {n * args.batch_size:3d} samples/step, "
            f"{n * args.batch_size / seconds:7.0f} samples/s, val accuracy {accuracy:.1%}"
        )
    print(
        f"throughput ratio {args.nproc} vs 1 process: "
        f"{(args.nproc / multi[0]) / (1 / single[0]):.2f}x (ideal {args.nproc}x). Each step ends with an "
        "all-reduce of every gradient: it pays off once compute per step dwarfs it (wider --hidden, "
        "larger --batch-size, one GPU or free core per process)"
    )


if __name__ == "__main__":
    main()
