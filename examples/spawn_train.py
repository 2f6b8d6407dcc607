"""setup / train / cleanup, spawned like `mp.spawn`, with gloo on CPU.

`nanoddp.launch(fn, nprocs, args)` is `mp.spawn` with the chores done: it creates the process
group before `fn(env, *args)` runs (a private file:// rendezvous: no MASTER_PORT to pick), and
if one rank fails it stops the others and re-raises that rank's error here, instead of leaving
them blocked in a collective. Its ranks fork from a server that imported torch once, so each
starts at once and, like a spawned rank, imports this script anew. What remains for the script:

* setup: seed, build the model, wrap it in `nanoddp.DistributedDataParallel`;
* a distributed sampler, with `set_epoch(epoch)` so that every epoch is shuffled differently
  (forget it and every epoch repeats epoch 0's order), the shards disjoint across ranks;
* rank 0 alone saves `model.module.state_dict()`, the plain model's weights;
* cleanup: `nanoddp.cleanup()` (barrier, then destroy the process group).

Why `.module`: the DDP wrapper holds the model as its attribute `module`, so the wrapper's
own `state_dict()` names every tensor "module.<name>"; a plain model refuses those keys.

    python examples/spawn_train.py [--nproc 2] [--epochs 3] [--out runs/spawn_train]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import nanoddp
from nanoddp import comm
from nanoddp.models import MLPClassifier
from nanoddp.parallel.replicas import gather_json
from nanoddp.train.data.datasets import digits_splits
from nanoddp.train.data.sampler import ResumableDistributedSampler


def setup(env: nanoddp.DistEnv, seed: int) -> nanoddp.DistributedDataParallel:
    torch.set_num_threads(1)
    nanoddp.seed_everything(seed, env.rank)  # per-rank streams; the weights come from rank 0's broadcast
    return nanoddp.DistributedDataParallel(MLPClassifier().to(env.device))


def show_sampler(env: nanoddp.DistEnv, dataset, seed: int) -> None:
    """Each rank's first indices per epoch: with set_epoch they change; without, they repeat."""
    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=seed)
    forgot = [list(sampler)[:4], list(sampler)[:4]]  # two epochs, no set_epoch: the same order
    remembered = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        remembered.append(list(sampler)[:4])
    sampler.set_epoch(0)
    everyone = gather_json([forgot, remembered, list(sampler)], comm)
    if env.is_master:
        for rank, (without, with_) in enumerate(x[:2] for x in everyone):
            print(f"rank {rank}: without set_epoch {without[0]}, {without[1]} | with set_epoch {with_[0]}, {with_[1]}")
        indices = [i for *_, mine in everyone for i in mine]
        print(
            f"epoch 0: {len(indices)} indices over {env.world_size} ranks, {len(set(indices))} distinct "
            f"of {len(dataset)} samples (the tail is padded with repeats so all ranks step equally)"
        )


def train(env: nanoddp.DistEnv, args: argparse.Namespace) -> float:
    model = setup(env, args.seed)
    train_set, val_set = digits_splits(0.2)
    sampler = ResumableDistributedSampler(train_set, shuffle=True, seed=args.seed)  # like DistributedSampler
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # no shuffle=: the sampler does it
    show_sampler(env, train_set, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, identical on every rank
        total = torch.zeros(2)  # (loss sum, batches)
        for x, y in loader:
            _, loss = model(x.to(env.device), y.to(env.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradients averaged over ranks here
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        comm.all_reduce(total)
        if env.is_master:
            print(f"epoch {epoch} | {len(loader)} batches/rank | mean loss {total[0] / total[1]:.4f}")
    accuracy = evaluate(model.module, val_set)
    if env.is_master:
        save(model, Path(args.out) / "model.pt", val_set, accuracy)
    nanoddp.cleanup()  # barrier: nobody leaves while rank 0 is still writing
    return accuracy


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_set) -> float:
    return (model(val_set.features).argmax(-1) == val_set.labels).float().mean().item()


def save(model: nanoddp.DistributedDataParallel, path: Path, val_set, accuracy: float) -> None:
    """Rank 0 only: save the plain model's weights, then show why it must be `.module`."""
    wrapped, plain = model.state_dict(), model.module.state_dict()
    print(f"model.state_dict() keys:        {list(wrapped)[:2]} ...")
    print(f"model.module.state_dict() keys: {list(plain)[:2]} ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(plain, tmp)
    tmp.replace(path)  # atomic: a reader never sees half a file (see also nanoddp.train.checkpoint.snapshot.save)
    print(f"rank 0 saved {path}")
    fresh = MLPClassifier()
    try:
        fresh.load_state_dict(wrapped)
    except RuntimeError as exc:
        print(f"loading the wrapper's keys into a plain model fails: {str(exc).splitlines()[1].strip()[:90]}...")
    fresh.load_state_dict(torch.load(path, weights_only=True))
    print(
        f"reloaded model.pt into a plain MLPClassifier: val accuracy {evaluate(fresh, val_set):.1%} "
        f"(trained model: {accuracy:.1%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/spawn_train")
    args = parser.parse_args()
    accuracies = nanoddp.launch(train, args.nproc, args=(args,), backend="gloo")  # one value per rank
    print(f"done: {args.nproc} ranks, val accuracy per rank {[f'{a:.1%}' for a in accuracies]}")


if __name__ == "__main__":
    main()
