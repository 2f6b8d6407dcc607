"""Your model, your data, nanoddp's fault tolerance: `nanoddp.Trainer` on a CNN it has never seen.

The script defines a small CNN and a dataset of 12x12 images (four kinds of stripes under
noise), and hands both to `nanoddp.Trainer` with its optimizer and loss. Launched with

    nanoddp run --nproc 2 --max-restarts 1 examples/your_model.py --out runs/your_model

it trains data-parallel on 2 processes, snapshots every 5 steps and writes `model.pt`. With
`--crash-at-step N`, rank 1 kills itself (SIGKILL, as the OOM killer would) at step N of the
first attempt; torchrun restarts both ranks and the Trainer resumes from the newest snapshot.

Run without a launcher, the script is the demo: it launches itself twice with `nanoddp run`,
once crashing at step 12 and once uninterrupted, and checks that both `model.pt` files are
bitwise equal.

    python examples/your_model.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nanoddp
from nanoddp.torchrun import inside_torchrun

IMAGE = 12


def make_datasets(n_train: int = 1024, n_eval: int = 256) -> tuple[TensorDataset, TensorDataset]:
    """Stripes (horizontal, vertical, and the two diagonals) plus noise; the label is the kind."""
    generator = torch.Generator().manual_seed(0)
    n = n_train + n_eval
    labels = torch.randint(0, 4, (n,), generator=generator)  # (n,)
    rows, cols = torch.meshgrid(torch.arange(IMAGE), torch.arange(IMAGE), indexing="ij")  # (H, W)
    phase = torch.randint(0, 3, (n, 1, 1), generator=generator)  # (n, 1, 1)
    coordinate = torch.stack([rows, cols, rows + cols, rows - cols])[labels]  # (n, H, W)
    images = ((coordinate + phase) % 3 == 0).float()
    images = images + 0.5 * torch.randn(n, IMAGE, IMAGE, generator=generator)
    images = images.unsqueeze(1)  # (n, 1, H, W)
    return TensorDataset(images[:n_train], labels[:n_train]), TensorDataset(images[n_train:], labels[n_train:])


class StripeCNN(nn.Module):
    """Two conv blocks and a linear head. `crash_at_step`: SIGKILL this process when the
    training forward of that step starts (rank 1, first attempt only): a demo of a lost worker."""

    def __init__(self, crash_at_step: int | None = None):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 16, 6, 6)
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 3, 3)
        )  # fmt: skip
        self.head = nn.Linear(32 * 3 * 3, 4)
        self.crash_at_step = crash_at_step
        self.start_step = 0  # where this attempt resumed: set by train()
        self.training_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.training_forwards += 1
            self._maybe_crash()
        return self.head(self.features(x).flatten(1))  # (B, 4)

    def _maybe_crash(self) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        rank1 = os.environ.get("RANK") == "1"
        this_step = self.start_step + self.training_forwards
        if first_attempt and rank1 and this_step == self.crash_at_step:
            print(f"rank 1: simulated crash (SIGKILL) at step {self.crash_at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train(args: argparse.Namespace) -> None:
    """One rank of the run: nanoddp.Trainer does the rest (process group, sampler, snapshots,
    resume, logging, model.pt)."""
    train_set, eval_set = make_datasets()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = StripeCNN(args.crash_at_step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    trainer = nanoddp.Trainer(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_dataset=eval_set,
        lr_scheduler=scheduler,
        steps=args.steps,
        batch_size=32,
        snapshot_every=5,
        log_every=5,
        eval_every=0,
        out=args.out,
        engine=args.engine,
    )
    model.start_step = trainer.step  # count this attempt's steps from where it resumed
    record = trainer.fit()
    if trainer.env.is_master:
        print(f"final validation loss {record['val_loss']:.4f}")
    nanoddp.cleanup()


def launch(out: Path, steps: int, crash_at: int | None) -> str:
    """`nanoddp run --nproc 2 --max-restarts 1` this script; returns its output."""
    command = [sys.executable, "-m", "nanoddp.run", "--nproc", "2", "--max-restarts", "1", __file__]
    command += ["--out", str(out), "--steps", str(steps)]
    if crash_at is not None:
        command += ["--crash-at-step", str(crash_at)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit code {done.returncode}):\n{output[-3000:]}")
    return output


def demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass a new --out (nothing is overwritten)")
    print(f"== 1. {args.steps} steps on 2 ranks; rank 1 is killed at step {args.crash_at_step}")
    crashed = launch(out / "crashed", args.steps, args.crash_at_step)
    print("\n".join(line for line in crashed.splitlines() if "crash" in line or "resumed" in line))
    print("== 2. the same run, uninterrupted")
    launch(out / "uninterrupted", args.steps, None)
    resumed = torch.load(out / "crashed" / "model.pt")
    reference = torch.load(out / "uninterrupted" / "model.pt")
    same = resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)
    model = StripeCNN()
    model.load_state_dict(resumed)  # a plain state_dict: no "module." prefix
    model.eval()
    _, eval_set = make_datasets()
    with torch.no_grad():
        accuracy = (model(eval_set.tensors[0]).argmax(1) == eval_set.tensors[1]).float().mean().item()
    print(f"eval accuracy {accuracy:.3f} (chance 0.25)")
    print(f"crash + restart + resume == uninterrupted, bitwise: {same}")
    return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--engine", default="nanoddp", help="nanoddp, torch, allreduce, rs_ag, zero2, fsdp")
    parser.add_argument("--out", default=time.strftime("runs/your_model-%Y%m%d-%H%M%S"), help="a new directory")
    args = parser.parse_args()
    if inside_torchrun():  # one rank of `nanoddp run` / torchrun
        train(args)
        return 0
    if args.crash_at_step is None:
        args.crash_at_step = 12
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
