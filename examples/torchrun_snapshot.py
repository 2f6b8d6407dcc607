"""Fault-tolerant training under torchrun: snapshots, a crash, and automatic resume.

A minGPT-style byte-level GPT learns the Python standard library's source. torchrun starts the
workers and sets RANK, WORLD_SIZE, MASTER_ADDR, ... (read once into `nanoddp.DistEnv`). Every
`--snapshot-every` steps rank 0 writes a snapshot with `nanoddp.train.checkpoint.snapshot` (atomic, checksummed):
model, optimizer, step, the sampler's position and every rank's RNG state. When a worker dies,
torchrun stops the others and, while `--max-restarts` allows, starts them all again; they find
the newest valid snapshot and continue from there, mid-epoch, with the exact same batches.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 1 examples/torchrun_snapshot.py --crash-at-step 15

(The variable matters for restarts: torchrun >= 2.5 shares its rendezvous store with the
workers, and a restarted group may then read the previous attempt's addresses and fail to
connect, pytorch/pytorch#135712. `nanoddp train` sets it for you.)

`--crash-at-step N` kills rank 1 right after step N, on the first attempt only
(TORCHELASTIC_RESTART_COUNT = 0), so the restart is visible (rank 0's "Connection reset by
peer" traceback that follows is expected: its peer vanished mid-collective).
`nanoddp train` does all of this for you (and launches torchrun itself); this file shows the
moving parts.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import nanoddp
from nanoddp.base.rng import capture_rng_state, restore_rng_state
from nanoddp.models import GPT, gpt_config
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.data.datasets import BYTE_VOCAB, byte_text_splits
from nanoddp.train.data.sampler import ResumableDistributedSampler


class Trainer:
    """The ddp-tutorial-series shape: _run_batch, _run_epoch, _save_snapshot, _load_snapshot."""

    def __init__(self, env: nanoddp.DistEnv, args: argparse.Namespace):
        self.env, self.args, self.step = env, args, 0
        nanoddp.seed_everything(args.seed, env.rank)
        model = GPT(
            gpt_config(
                "tiny", vocab_size=BYTE_VOCAB, seq_len=args.seq_len, d_model=128, n_heads=4, n_layers=2, d_ff=512
            )
        )
        self.model = nanoddp.DistributedDataParallel(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        dataset, _ = byte_text_splits("text", args.seq_len, val_fraction=0.1, max_bytes=2_000_000)
        self.sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(dataset, batch_size=args.batch_size, sampler=self.sampler, drop_last=True)
        self.snapshot_dir = Path(args.out) / "snapshots"
        # Every rank reads the same newest file: none can be written meanwhile, because step 1
        # needs every rank's gradients, so rank 0 cannot run ahead to the next snapshot.
        found = snapshot.find_latest_valid(self.snapshot_dir)  # skips truncated/corrupted files
        if found is not None:
            self._load_snapshot(*found)

    def _save_snapshot(self) -> None:
        """Collective (every rank sends its RNG state); rank 0 writes the file."""
        rng = [None] * self.env.world_size if self.env.is_master else None
        dist.gather_object(capture_rng_state(), rng, dst=0)
        if not self.env.is_master:
            return
        state = {
            "step": self.step,
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng,
        }
        path = snapshot.save(snapshot.snapshot_path(self.snapshot_dir, self.step), state)
        snapshot.prune(self.snapshot_dir, keep=2)
        print(f"step {self.step} | snapshot {path.name}", flush=True)

    def _load_snapshot(self, path: Path, state: dict) -> None:
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])  # epoch + how many samples the job consumed
        if len(state["rng"]) == self.env.world_size:  # else (new world size) keep the fresh seeds
            restore_rng_state(state["rng"][self.env.rank])
        self.step = state["step"]
        if self.env.is_master:
            print(f"resumed from {path.name} at step {self.step} (restart {self.env.restart_count})", flush=True)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        _, loss = self.model(x, y)  # (B, T) -> scalar; loss computed in forward
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # gradients averaged over ranks
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # same epoch as the snapshot: keeps its position
        for x, y in self.loader:
            start = time.perf_counter()
            loss = self._run_batch(x, y)
            self.sampler.advance(len(x))
            self.step += 1
            if self.env.is_master:
                print(f"step {self.step} | loss {loss:.6f} | {(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
            if self.step % self.args.snapshot_every == 0 or self.step == self.args.steps:
                self._save_snapshot()
            self._maybe_crash()
            if self.step == self.args.steps:
                return

    def _maybe_crash(self) -> None:
        if self.step == self.args.crash_at_step and self.env.rank == 1 and self.env.restart_count == 0:
            print(f"rank 1: simulated crash after step {self.step} (restart 0)", flush=True)
            os._exit(1)  # no cleanup, like a real crash; torchrun notices and restarts everyone

    def train(self) -> None:
        epoch = self.sampler.epoch  # 0, or the snapshot's epoch (resumed at its position)
        while self.step < self.args.steps:
            self._run_epoch(epoch)
            epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/torchrun_snapshot")
    parser.add_argument("--crash-at-step", type=int, default=0, help="rank 1 dies after this step, once (0: never)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = nanoddp.init()  # DistEnv.from_environ(): torchrun's variables, or a single process
    if env.is_master:
        print(f"rank 0 of {env.world_size} | torchrun: {env.torchrun} | restart {env.restart_count}", flush=True)
    trainer = Trainer(env, args)
    trainer.train()
    if env.is_master:
        print(f"training finished at step {trainer.step}", flush=True)
    nanoddp.cleanup()


if __name__ == "__main__":
    main()
