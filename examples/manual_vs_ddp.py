"""DDP vs hand-written gradient sync: three ways to average gradients, one result.

The same TinyTransformerLM (nanoddp's GPT "tiny" preset) trains on the same random tokens in
three modes:

* `ddp`: `nanoddp.DistributedDataParallel` (bucketed all-reduce, overlapped with backward);
* `manual/allreduce`: after backward, one all-reduce per parameter, divided by the world size;
* `manual/rs_ag`: after backward, all gradients in one flat tensor: reduce-scatter (each rank
  sums one shard) then all-gather (everyone gets every shard): a ring all-reduce in two calls.

Every rank seeds differently (seed + rank), so the replicas start equal only because rank 0's
weights are broadcast (DDP does it in its constructor; the manual modes do it by hand). The
loss curves are printed side by side and agree; rank 0 writes one checkpoint per mode, and the
three final models are compared.

    python examples/manual_vs_ddp.py [--nproc 2] [--steps 8] [--out runs/manual_vs_ddp]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import nanoddp
from nanoddp import comm
from nanoddp.models import GPT, gpt_config
from nanoddp.parallel.manual import allreduce_gradients, reduce_scatter_all_gather_gradients
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.data.datasets import random_tokens
from nanoddp.train.data.sampler import ResumableDistributedSampler

MODES = ("ddp", "manual/allreduce", "manual/rs_ag")
SYNC = {"manual/allreduce": allreduce_gradients, "manual/rs_ag": reduce_scatter_all_gather_gradients}


def build(env: nanoddp.DistEnv, mode: str, args: argparse.Namespace) -> tuple[GPT, torch.nn.Module]:
    """The model, and what the training loop calls: the DDP wrapper or the model itself."""
    nanoddp.seed_everything(args.seed, env.rank)  # a different init on every rank ...
    model = GPT(gpt_config("tiny", seq_len=args.seq_len))
    if mode == "ddp":
        return model, nanoddp.DistributedDataParallel(model)  # ... DDP broadcasts rank 0's
    with torch.no_grad():
        for tensor in model.state_dict().values():  # ... or we do, like the manual all-reduce strategy
            comm.broadcast(tensor, src=0)
    nanoddp.verify_replicas(model)  # raises if any rank still differs
    return model, model


def train(env: nanoddp.DistEnv, mode: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """Train `args.steps` steps; return the rank-averaged loss per step and the seconds per step."""
    model, engine = build(env, mode, args)
    dataset = random_tokens(args.steps * args.batch_size * env.world_size, args.seq_len, model.cfg.vocab_size)
    sampler = ResumableDistributedSampler(dataset, shuffle=False, drop_last=True)  # rank r: rows r, r+W, ...
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, start = [], time.perf_counter()
    for x, y in loader:  # (B, T) each
        optimizer.zero_grad(set_to_none=True)
        _, loss = engine(x, y)  # loss computed in forward
        loss.backward()  # ddp: gradients are already averaged when this returns
        if mode in SYNC:
            SYNC[mode](model)  # manual: average them now, after the whole backward
        optimizer.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean, op=comm.ReduceOp.AVG)  # the global-batch loss, for the log
        losses.append(mean.item())
    seconds_per_step = (time.perf_counter() - start) / len(losses)
    if env.is_master:  # rank 0 alone writes: the replicas are identical
        path = Path(args.out) / f"{mode.replace('/', '_')}.pt"
        state = {"model": model.state_dict(), "config": asdict(model.cfg), "mode": mode, "losses": losses}
        snapshot.save(path, state)  # temp file + fsync + os.replace, with a checksum
        print(f"[{mode}] {len(losses)} steps, {seconds_per_step * 1e3:.0f} ms/step, checkpoint {path}")
    return losses, seconds_per_step


def report(curves: dict[str, list[float]], out: str) -> None:
    """Print the loss curves side by side, then compare the checkpoints' weights."""
    print("\nstep | " + " | ".join(f"{mode:>16s}" for mode in MODES))
    for step, row in enumerate(zip(*curves.values(), strict=True)):
        print(f"{step:4d} | " + " | ".join(f"{loss:16.6f}" for loss in row))
    spread = max(max(row) - min(row) for row in zip(*curves.values(), strict=True))
    print(f"max loss difference between modes: {spread:.2e}")
    weights = {m: snapshot.load(Path(out) / f"{m.replace('/', '_')}.pt")["model"] for m in MODES}
    reference = weights["ddp"]
    for mode in MODES[1:]:
        diff = max((weights[mode][k] - v).abs().max().item() for k, v in reference.items())
        print(f"max |weight difference| {mode} vs ddp: {diff:.2e}")
    keys = list(reference)
    print(f"checkpoint keys: {len(keys)} tensors, e.g. {keys[:2]} (no 'module.' prefix: saved unwrapped)")


def worker(env: nanoddp.DistEnv, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if env.is_master:
        print(
            f"{env.world_size} ranks x batch {args.batch_size} x {args.seq_len} tokens, "
            f"{args.steps} steps per mode, GPT tiny ({sum(p.numel() for p in GPT().parameters()):,} params)"
        )
    curves = {mode: train(env, mode, args)[0] for mode in MODES}
    if env.is_master:
        report(curves, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="runs/manual_vs_ddp", help="directory for rank 0's checkpoints")
    args = parser.parse_args()
    nanoddp.launch(worker, args.nproc, args=(args,), backend="gloo")


if __name__ == "__main__":
    main()
