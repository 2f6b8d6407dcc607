"""Keep your own training loop, get exact resume: `nanoddp.save_state` / `nanoddp.load_state`.

A hand-written torch DDP loop (dropout, random augmentation, an LR schedule, a GradScaler, the
resumable sampler) saves its state every few steps. The demo runs it three times:

1. with a simulated crash after `--crash-at-step`;
2. again, the same command: `load_state` finds the newest valid state and the loop goes on;
3. uninterrupted, as the reference.

and checks that runs 1+2 end with *bitwise* the weights of run 3. Then it evaluates with
`nanoddp.gather_for_metrics`, whose accuracy over an eval set that does not divide by the world
size equals the single-process figure exactly (a plain all_gather would count the sampler's
padding twice).

    python examples/own_loop_state.py                      # the demo, 2 processes on CPU
    nanoddp run --nproc 2 --max-restarts 1 examples/own_loop_state.py --out runs/own --crash-at-step 12

Under `nanoddp run` (or torchrun) it is one training run: the crash kills rank 1, torchrun
restarts both ranks, and they resume from `--out` by themselves.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import nanoddp
from nanoddp.torchrun import inside_torchrun
from nanoddp.train.data.sampler import ResumableDistributedSampler


def make_datasets() -> tuple[TensorDataset, TensorDataset]:
    """XOR of the quadrants: 600 training points, 101 eval points (101 is odd: the sampler pads)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(701, 2, generator=generator) * 2 - 1  # (n, 2) in [-1, 1)^2
    label = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()  # (n,)
    return TensorDataset(x[:600], label[:600]), TensorDataset(x[600:], label[600:])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 2))


def train(env: nanoddp.DistEnv, out: str, steps: int, crash_at: int | None) -> None:
    """One rank of the loop; resumes from `out` if a state is there."""
    torch.set_num_threads(1)
    train_set, _ = make_datasets()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler("cpu")
    sampler = ResumableDistributedSampler(train_set, seed=0)
    # Its own generator: iter(loader) must not draw from the global RNG the loop restores.
    loader = DataLoader(train_set, batch_size=16, sampler=sampler, generator=torch.Generator().manual_seed(0))
    nanoddp.seed_everything(0, env.rank)  # per-rank dropout and augmentation

    objects = dict(model=ddp, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler)
    state = nanoddp.load_state(out, **objects)  # None on a first run
    step = state["step"] if state else 0
    if state and env.is_master:
        print(f"resumed from step {step}")

    while step < steps:
        sampler.set_epoch(sampler.epoch)  # a new epoch starts at 0; a resumed one where it stopped
        for x, y in loader:
            x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype("float32")) * random.random()
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            sampler.advance(len(x))
            step += 1
            if env.is_master and step % 10 == 0:
                print(f"step {step} | loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}")
            if step % 4 == 0 or step == steps:
                nanoddp.save_state(out, step=step, **objects)
            if crash_at is not None and step == crash_at and env.rank == 1 and env.restart_count == 0:
                raise RuntimeError(f"simulated crash after step {step}")
            if step == steps:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)


def evaluate(env: nanoddp.DistEnv, out: str) -> float:
    """Accuracy over the eval set, sharded over the ranks and gathered without the padding."""
    torch.set_num_threads(1)
    _, eval_set = make_datasets()
    model = make_model()
    nanoddp.load_state(out, model=model)
    model.eval()
    sampler = ResumableDistributedSampler(eval_set, shuffle=False)
    preds, labels = [], []
    with torch.no_grad():
        for x, y in DataLoader(eval_set, batch_size=32, sampler=sampler):
            preds.append(model(x).argmax(1))  # (B,)
            labels.append(y)
    preds, labels = nanoddp.gather_for_metrics((torch.cat(preds), torch.cat(labels)), dataset_len=len(eval_set))
    return (preds == labels).float().mean().item()


def reference_run(env: nanoddp.DistEnv, out: str, steps: int) -> float:
    """The uninterrupted run, then its eval accuracy (one launch for both)."""
    train(env, out, steps, crash_at=None)
    return evaluate(env, out)


def final_weights(out: str) -> dict[str, torch.Tensor]:
    model = make_model()
    nanoddp.load_state(out, model=model)
    return model.state_dict()


def demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    crashed, reference = str(out / "crashed"), str(out / "uninterrupted")
    for directory in (crashed, reference):
        if Path(directory).exists() and any(Path(directory).iterdir()):
            raise SystemExit(f"{directory} is not empty: pass a new --out (nothing is overwritten)")
    print(f"== 1. train {args.steps} steps on {args.nproc} ranks, crashing after step {args.crash_at_step}")
    try:
        nanoddp.launch(train, args.nproc, args=(crashed, args.steps, args.crash_at_step), backend="gloo")
    except nanoddp.LaunchError as exc:
        print(f"crashed: {str(exc).splitlines()[0]}")
    print("== 2. the same command again: it resumes from the newest valid state")
    nanoddp.launch(train, args.nproc, args=(crashed, args.steps, None), backend="gloo")
    print("== 3. uninterrupted reference run, then its eval on the ranks")
    distributed = nanoddp.launch(reference_run, args.nproc, args=(reference, args.steps), backend="gloo")[0]
    resumed, uninterrupted = final_weights(crashed), final_weights(reference)
    same = all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    print(f"crash + resume == uninterrupted, bitwise: {same}")

    print("== 4. eval accuracy: gather_for_metrics on the ranks vs one process")
    single = evaluate(nanoddp.DistEnv.single_process("gloo"), reference)
    equal = distributed == single
    print(f"accuracy on {args.nproc} ranks {distributed:.6f} | one process {single:.6f} | equal: {equal}")
    return 0 if same and equal else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at-step", type=int, default=14)
    parser.add_argument("--out", default=time.strftime("runs/own_loop_state-%Y%m%d-%H%M%S"), help="a new directory")
    args = parser.parse_args()
    if inside_torchrun():  # one rank of `nanoddp run` / torchrun: a single (restartable) training run
        env = nanoddp.init()
        train(env, args.out, args.steps, args.crash_at_step)
        dist.destroy_process_group()
        return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
