"""torchft's own fault-tolerant DDP on `nanoddp train`'s job: the third mode of the failure cost.

`nanoddp bench restarts --cost-trials N` measures what one lost rank costs under
`--on-failure restart`, `--on-failure continue` and this: the same model, data, AdamW and
schedule (`nanoddp.train.recipe.build_job`), the same launcher (`nanoddp.ft.supervisor`: torchft's Lighthouse,
one process per replica, a dead one replaced), but the step loop is torchft's documented FT-DDP
path rather than `nanoddp.ft`'s:

- `torchft.Manager` over a `torchft.ProcessGroupGloo` (reconfigured at each quorum change), with
  torchft's defaults where they are a policy (asynchronous quorum, overlapped with the forward);
- `Manager.allreduce` on the gradients, after backward, as one flat bucket (the model fits in
  one of DDP's): summed by gloo, divided by the number of participants. A failed allreduce is
  reported to the Manager, which then refuses the commit;
- `torchft.Optimizer` (OptimizerWrapper): `zero_grad` asks for the quorum, `step` applies the
  update only if every participant's step may commit;
- `torchft.DistributedSampler`: each replica id owns a fixed shard of every epoch's permutation,
  `batch_size / replicas` samples of it per step. A lost replica's shard goes unused until its
  replacement is back (torchft's documented trade-off), so the global batch shrinks meanwhile.
  The position in the shard is the Manager's step (what torchft's example keeps in a stateful
  loader), so a redone step sees the same samples and a replacement resumes where its shard was.
- a joiner heals from a peer with torchft's `PGTransport` over the same gloo group.

[Note: not torchft.DistributedDataParallel] torchft 0.2.0's DDP wrapper averages each bucket in
a communication hook that asserts on the future of a failed allreduce (`assert fut._fut` in
`torchft/ddp.py`): seen here, the first lost peer raises AssertionError inside backward on every
survivor, so all of them die and are replaced, which measures a crash, not fault tolerance. Its
other wrapper (`PureDistributedDataParallel`) starts one allreduce per gradient and waits for
none, while the division by the number of participants is a callback that runs on the wait
(read in its source). So the gradients go through `Manager.allreduce` here, which is what both
wrappers call, and are waited for before the step.

It trains whole replicas (`--engine nanoddp`) without evaluation and writes no snapshots (a
replacement heals from a peer): `nanoddp bench restarts` needs no more.

Like `nanoddp train` it is two programs in one. Inside a supervised replica (the launcher set
`NANODDP_FT_LIGHTHOUSE`) it trains; outside, `python -m nanoddp.bench.torchft_ddp --nproc 3
FLAGS` (`nanoddp train`'s flags) checks the config and launches the replicas. Replica rank 0
writes the trainer's step records to `--out`'s metrics.jsonl and, at the end, `model.pt`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from nanoddp.base import files
from nanoddp.base.records import RecordWriter
from nanoddp.env import loopback_store, pin_sockets_to_loopback
from nanoddp.ft.manager import STARTUP_WAIT_S, make_manager, torchft_modules
from nanoddp.ft.replica_env import LIGHTHOUSE_VAR, ReplicaEnv
from nanoddp.ft.supervisor import Launch, supervise
from nanoddp.train.config import TrainConfig, filled, threads_per_rank
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.ft_trainer import start_replica
from nanoddp.train.metrics import format_log_line
from nanoddp.train.recipe import Job, build_job

logger = logging.getLogger(__name__)
WORKER_MODULE = "nanoddp.bench.torchft_ddp"


def per_replica_batch(batch_size: int, replicas: int) -> int:
    """Each replica's share of `batch_size`: torchft's DDP averages equal pieces, so it must divide."""
    if batch_size % replicas:
        raise ValueError(
            f"torchft's DDP gives every replica the same batch: --batch-size {batch_size} must be a "
            f"multiple of the {replicas} replicas; pick {batch_size - batch_size % replicas or replicas}"
        )
    return batch_size // replicas


class ShardBatches:
    """Step -> this replica's dataset indices: `per_replica` at a time from its shard of the
    epoch (torchft's `DistributedSampler`, reshuffled per epoch by `set_epoch`)."""

    def __init__(self, sampler: Any, per_replica: int) -> None:
        self.sampler, self.per_replica = sampler, per_replica
        self.steps_per_epoch = len(sampler) // per_replica
        if self.steps_per_epoch < 1:
            raise ValueError(f"a replica's shard ({len(sampler)} samples) must hold one batch of {per_replica}")
        self._epoch, self._order = -1, [0]

    def indices(self, step: int) -> list[int]:
        """The dataset indices of this replica's batch at `step`."""
        epoch, at = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._epoch = list(self.sampler), epoch
        return self._order[at * self.per_replica : (at + 1) * self.per_replica]


def _make_manager(torchft: Any, job: Job, pg: Any, env: ReplicaEnv, store_port: int) -> Any:
    """torchft's Manager for a replica group of one process, on loopback, healing over `pg`, with
    torchft's defaults: no step-0 sync (every replica seeds the same weights: build_job) and the
    asynchronous quorum."""

    def take() -> dict[str, Any]:
        return {"model": job.module.state_dict(), "optim": job.optimizer.state_dict(), "lr": job.scheduler.state_dict()}

    def put(state: dict[str, Any]) -> None:
        job.module.load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optim"])
        job.scheduler.load_state_dict(state["lr"])

    cpu = torch.device("cpu")  # torchft's DDP on its gloo group: the bench's CPU baseline
    return make_manager(torchft, env, pg, (take, put), store_port, init_sync=False, use_async_quorum=True, device=cpu)


def _wait_for_everyone(manager: Any, env: ReplicaEnv) -> None:
    """As `nanoddp.ft` does, the run's first step waits for all its replicas (they start one by
    one), so that both loops begin at full size and differ in their step loop only."""
    deadline = time.monotonic() + STARTUP_WAIT_S
    manager.start_quorum()
    while manager.num_participants() < env.replicas and time.monotonic() < deadline:
        time.sleep(0.05)
        manager.start_quorum()


def average_gradients(manager: Any, params: Sequence[torch.Tensor], loss: torch.Tensor) -> float:
    """Average every gradient and the loss over the participants with one `Manager.allreduce`
    of a flat buffer; return the global batch's mean loss. After a failed allreduce the values
    are not an average, and the Manager will refuse the commit (`should_commit`)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    manager.allreduce(flat).wait()  # never raises: an error is reported to the Manager instead
    offset = 0
    for param, grad in zip(params, grads, strict=True):
        param.grad = flat[offset : offset + grad.numel()].view_as(grad)
        offset += grad.numel()
    return flat[-1].item()


def _beat(env: ReplicaEnv) -> None:
    """Mark a step boundary: the supervisor ends a replica that stops marking while others go on."""
    if (path := env.beat_path()) is not None:
        with open(path, "a"):
            os.utime(path)


def train_replica(config: TrainConfig, env: ReplicaEnv) -> None:
    """Train this replica to `config.steps` committed steps on torchft's FT-DDP (module docstring)."""
    torchft = torchft_modules()
    torch.set_num_threads(threads_per_rank(config, env.replicas))
    job = build_job(config)
    pin_sockets_to_loopback()  # torchft's gloo group listens where the hostname resolves otherwise
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=env.timeout_s))
    store = loopback_store(0, rank=0, world_size=1)  # the replica group's own store: a group of one
    manager = _make_manager(torchft, job, pg, env, store.port)
    params = [p for p in job.module.parameters() if p.requires_grad]
    optimizer = torchft.Optimizer(manager, job.optimizer)
    per_replica = per_replica_batch(filled(config.batch_size), env.replicas)
    sampler = torchft.DistributedSampler(
        job.train_set, replica_rank=env.replica, num_replica_groups=env.replicas, group_rank=0, num_replicas=1,
        shuffle=True, seed=config.seed, drop_last=True,
    )  # fmt: skip
    batches, batch_loss, metrics = ShardBatches(sampler, per_replica), batch_loss_for(None), RecordWriter(env.out)
    if not env.joiner:
        _wait_for_everyone(manager, env)
    job.module.train()
    while (step := manager.current_step()) < config.steps:
        started = time.monotonic()
        optimizer.zero_grad()  # the quorum, asynchronously: it runs while the forward does
        loss = batch_loss(job.module, default_collate([job.train_set[i] for i in batches.indices(step)]))
        loss.backward()
        comm_started = time.monotonic()
        mean_loss = average_gradients(manager, params, loss)
        comm_s = time.monotonic() - comm_started
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)  # the same on every replica
        optimizer.step()  # only if the step may commit (should_commit)
        if manager.current_step() == step:
            continue  # not committed (a peer was lost): the next quorum redoes it
        _beat(env)  # after a commit: a replacement marks nothing until it has joined
        world_size = manager.num_participants()
        if manager.participating_rank() == 0:
            elapsed = time.monotonic() - started
            record = _step_record(step, mean_loss, job, world_size * per_replica, world_size, elapsed, comm_s)
            metrics.write(record)
            if (step + 1) % config.log_every == 0:
                logger.info("%s | world %d", format_log_line(record), world_size)
        job.scheduler.step()
    if manager.participating_rank() == 0 and config.out is not None:
        files.atomic_torch_save(Path(config.out) / "model.pt", job.module.state_dict())
        logger.info("saved %s", Path(config.out) / "model.pt")
    manager.shutdown(wait=False)
    pg.shutdown()


def _step_record(
    step: int, loss: float, job: Job, samples: int, world_size: int, elapsed: float, comm_s: float
) -> dict[str, Any]:
    """The trainer's step record (`nanoddp.ft`'s keys), `step` counted from 1; `loss` is the
    global batch's mean."""
    samples_per_s = samples / elapsed if elapsed > 0 else None
    tokens = getattr(job.train_set, "tokens_per_sample", None)
    return {
        "step": step + 1,
        "loss": loss,
        "lr": job.optimizer.param_groups[0]["lr"],
        "step_time_s": elapsed,
        "samples_per_s": samples_per_s,
        "tokens_per_s": None if samples_per_s is None or tokens is None else samples_per_s * tokens,
        "comm_time_s": comm_s,  # the gradient average: after backward, not overlapped with it
        "comm_bytes": None,  # torchft's gloo group bypasses nanoddp's transport, which counts bytes
        "world_size": world_size,
        "time": time.time(),
    }


def check_torchft(config: TrainConfig) -> None:
    """What this worker trains: whole replicas of the model, no evaluation; the rest is refused."""
    if config.engine != "nanoddp":
        raise ValueError(f"torchft's FT-DDP replicates the whole model: use --engine nanoddp, got {config.engine!r}")
    if config.eval_every:
        raise ValueError(f"torchft's FT-DDP worker does not evaluate: pass --eval-every 0, got {config.eval_every}")


def launch(argv: list[str]) -> int:
    """The launcher: `nanoddp train`'s checks and flags, torchft's step loop on each replica."""
    from nanoddp.dataclass_cli import to_argv
    from nanoddp.train.launcher.cli import add_launch_args, add_train_args, prepare_launch

    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description=__doc__.split("\n\n")[0])
    add_train_args(parser)
    add_launch_args(parser)
    args = parser.parse_args(argv)
    try:
        config, nproc, _, _ = prepare_launch(args)
        check_torchft(config)
        per_replica_batch(filled(config.batch_size), nproc)
    except ValueError as exc:  # one line, as `nanoddp train` refuses a config
        parser.error(str(exc))
    if config.snapshot_every:  # torchft heals a replica from a peer; a restart is not its path
        print(f"torchft ddp: no snapshots are written (--snapshot-every {config.snapshot_every})", file=sys.stderr)
    Path(filled(config.out)).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", WORKER_MODULE, *to_argv(config)]
    launch = Launch(
        command,
        nproc,
        args.max_restarts,
        config.collective_timeout,
        config.out,
        "torchft ddp",
        warm_spare=config.warm_spare,
    )  # fmt: skip: the same supervision as --on-failure continue
    return supervise(launch)


def main(argv: list[str] | None = None) -> int:
    """A replica under the supervisor (its variables set), else the launcher."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if LIGHTHOUSE_VAR not in os.environ:
        return launch(argv)
    train_replica(*start_replica(argv, WORKER_MODULE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
