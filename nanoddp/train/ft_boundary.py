"""What `nanoddp train --on-failure continue` does between steps: snapshots, evaluation, resume.

The snapshots are the restart path's: `snapshots/step-N.pt`, written by `user_state.save_objects`
(the Trainer's writer: atomic, checksummed, keep-last-K) under the Trainer's names (model,
optimizer, scheduler, sampler, train), so `--resume auto` reads a continue run's snapshot in
either mode, and a continue run resumes from either mode's. The `train` entry also keeps
`history`, the world size of every step so far, which a continue run's replay needs.

Both run at a step boundary through `FaultTolerant(boundary=...)`: right after the quorum, on
every member of the group that runs the next step, so the state is a committed step's, the same
on every member, and never half of one. They are collectives over that group (`save_objects`
gathers every rank's RNG streams and shapes; the validation set is split over the group and the
loss sums all-reduced), not rank 0's alone: the quorum service gives a replica that does not ask
for the next quorum within its join timeout (0.5 s) up for lost, so rank 0 may not keep the others
waiting on it for an evaluation. A failure in them is a failed step: the group is rebuilt and the
boundary runs again, the snapshot rewritten with the same contents.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, default_collate

from nanoddp.base import records
from nanoddp.base.rng import restore_rng_state
from nanoddp.dataclass_cli import to_dict
from nanoddp.env import DistEnv
from nanoddp.ft import FaultTolerant, ReplicaEnv
from nanoddp.train import evaluation
from nanoddp.train.build import Job
from nanoddp.train.checkpoint import rundir, snapshot, user_state
from nanoddp.train.config import TrainConfig, filled
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.recipe import follow_steps_on_resume

logger = logging.getLogger(__name__)


@dataclass
class RunFacts:
    """What every replica must agree on besides the training state; a joiner receives it live."""

    run_id: str
    start_step: int
    """The step the run started or resumed at: nothing is snapshotted or evaluated there again."""
    last_step_finite: bool = True
    """Whether the last committed step's loss was finite (`--on-nan skip` commits others)."""
    newest_finite_snapshot: int | None = None
    """The newest snapshot taken after a finite step: pruning keeps it (`snapshot.prune`)."""


def first_run_id(env: ReplicaEnv, out: str | None) -> str:
    """The run id every first process of a fresh run derives alike (no file, no message)."""
    return hashlib.sha256(f"{env.launcher_pid}:{out}".encode()).hexdigest()[:12]


def resume(config: TrainConfig, job: Job, env: ReplicaEnv) -> tuple[int, list[int], str] | None:
    """Apply `--resume` on one of the run's first processes, before any group exists: load the
    snapshot's model, optimizer, schedule and RNG; return (step, history, run_id), or None."""
    if config.out is None:
        return None
    out = config.out
    found = rundir.resolve_resume(config.resume, out, to_dict(config))
    if found is None:
        return None
    path, state = found
    step, history = _load(path, state, job)
    train = snapshot.train_state(state, path)
    note = follow_steps_on_resume(job.scheduler, int(train["config"].get("steps", config.steps)), config.steps, step)
    if env.replica == 0:
        records.truncate_after(out, step)  # the steps after the snapshot are redone and logged again
        logger.info("resumed from %s (step %d)", path, step)
        if note:
            logger.warning("%s", note)
    return step, history, str(train.get("run_id") or first_run_id(env, out))


def _load(path: Path, state: dict[str, Any], job: Job) -> tuple[int, list[int]]:
    """Load snapshot `state` (read from `path`) into the job: model, optimizer, schedule, RNG;
    return its step and history. Collective when a group is up (`load_objects` agrees on errors)."""
    parts = {"model": job.module, "optimizer": job.optimizer, "scheduler": job.scheduler}
    user_state.load_objects(path, parts, restore_rng=False, manifest=state)
    train = snapshot.train_state(state, path)
    step = int(train["step"])
    history = list(train.get("history") or [int(train["world_size"])] * step)  # a restart run's: fixed size
    # Every replica steps with the same RNG stream (a joiner receives its source's): rank 0's.
    restore_rng_state(state["rng"][0])
    return step, history


def restore_newest(config: TrainConfig, job: Job, facts: RunFacts | None = None) -> tuple[int, list[int]] | None:
    """The whole state back to the run's newest valid snapshot (fsdp's roll-back under continue,
    `OptimizerShards`; a group in which nobody holds the state, `FaultTolerant`): its (step,
    history), or None when there is none. `facts`, if given, become the snapshot's: the group
    goes on from it as a resumed run does."""
    if config.out is None:
        return None
    found = snapshot.find_latest_valid(Path(config.out) / "snapshots")
    if found is None:
        return None
    step, history = _load(found[0], found[1], job)
    if facts is not None:
        train = snapshot.train_state(found[1], found[0])
        facts.run_id, facts.start_step = str(train.get("run_id") or facts.run_id), step
        finite = bool(train.get("loss_finite", True))
        facts.last_step_finite, facts.newest_finite_snapshot = finite, step if finite else None
    return step, history


def newest_optimizer_state(config: TrainConfig) -> tuple[int, dict[str, Any]] | None:
    """(step, the optimizer's whole state_dict) of the newest valid snapshot of the run, or None:
    where a sharded optimizer's state lost with its owner comes from (`OptimizerShards`)."""
    if config.out is None:
        return None
    found = snapshot.find_latest_valid(Path(config.out) / "snapshots")
    if found is None:
        return None
    path, state = found
    entry = state["objects"].get("optimizer", {})
    if entry.get("kind") != "stateful":  # e.g. a restart run's zero2 snapshot: in per-rank shard files
        logger.warning("%s holds no whole optimizer state to take lost state from", path)
        return None
    return int(snapshot.train_state(state, path)["step"]), entry["state"]


class WholeOptimizer:
    """A sharded optimizer's state as a snapshot keeps it: its whole state_dict (gathered first)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("a snapshot's view of a sharded optimizer is written, never loaded into")


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


class Boundary:
    """`FaultTolerant`'s boundary work for the built-in job: the snapshot and the evaluation
    that the restart path's Trainer does after the same steps (`--snapshot-every`,
    `--eval-every`, and both after the last step)."""

    def __init__(
        self,
        config: TrainConfig,
        job: Job,
        facts: RunFacts,
        whole_optimizer: Callable[[], Any] | None = None,
    ) -> None:
        self.config, self.job, self.facts = config, job, facts
        self.ft: FaultTolerant | None = None  # set once made: the boundary is one of its arguments
        # the optimizer as a snapshot holds it: whole (a sharded one's pieces are gathered first)
        self.whole_optimizer = whole_optimizer or (lambda: job.optimizer)
        self.batch_loss = batch_loss_for(None)
        self._evaluated: set[int] = set()  # steps this process recorded a validation loss for

    def __call__(self, step: int) -> None:
        """At `step` committed steps: snapshot and evaluate when due (collectives, see above)."""
        config = self.config
        if step <= self.facts.start_step or config.out is None:
            return
        final = step >= config.steps
        if final or _every(step, config.snapshot_every):
            self.save(step)
        if final or _every(step, config.eval_every):
            self.evaluate(step)

    def restore(self) -> tuple[int, list[int]] | None:
        """`FaultTolerant(restore=)`, for a group in which nobody holds the state: every member
        loads the newest snapshot (`restore_newest`); `FaultTolerant` then drops the records past
        it, as a resumed run does (`resume`), so that the steps redone after it are each recorded once."""
        restored = restore_newest(self.config, self.job, self.facts)
        if restored is not None:
            step = restored[0]
            self._evaluated = {done for done in self._evaluated if done <= step}  # those past it are redone
        return restored

    def _group(self) -> FaultTolerant:
        assert self.ft is not None, "Boundary.ft must be set before the loop starts"
        return self.ft

    def save(self, step: int) -> Path:
        """Write `snapshots/step-<step>.pt` (collective); rank 0 then prunes the old ones."""
        ft, config = self._group(), to_dict(self.config)
        directory = Path(filled(self.config.out)) / "snapshots"
        path = snapshot.snapshot_path(directory, step)
        batches = ft.batches
        train = {"step": step, "epoch": step // batches.steps_per_epoch, "config": config,
                 "run_id": self.facts.run_id, "fingerprint": rundir.fingerprint(config),
                 "world_size": ft.world_size, "interrupted": 0, "loss_finite": self.facts.last_step_finite,
                 "history": list(ft.history[:step])}  # fmt: skip
        objects = {"model": self.job.module, "optimizer": self.whole_optimizer(), "scheduler": self.job.scheduler}
        objects |= {"sampler": self._sampler_at(step), snapshot.TRAIN: train}
        user_state.save_objects(path, objects)
        if self.facts.last_step_finite:
            self.facts.newest_finite_snapshot = step
        if ft.is_master:
            snapshot.prune(directory, self.config.keep_snapshots, protect=self.facts.newest_finite_snapshot)
            logger.info("snapshot %s", path)
        return path

    def _sampler_at(self, step: int) -> ResumableDistributedSampler:
        """The restart path's sampler at the same place in the data: the epoch, and the samples of
        it that `step` steps consumed (its order is the same seeded permutation per epoch)."""
        batches = self._group().batches
        sampler = ResumableDistributedSampler(self.job.train_set, 1, 0, shuffle=True, seed=self.config.seed)  # type: ignore[arg-type]
        epoch, at = divmod(step, batches.steps_per_epoch)
        sampler.set_epoch(epoch)
        sampler.position = at * batches.batch_size
        return sampler

    def evaluate(self, step: int) -> float | None:
        """The validation loss, the set split over the group (`evaluation.mean_loss`); rank 0
        logs it and writes `{"event": "eval", "step", "val_loss", "world_size", "eval_time_s"}`."""
        ft = self._group()
        dataset: Dataset | None = self.job.val_set
        if dataset is None:
            return None
        limit = filled(self.config.eval_samples)
        if limit:
            dataset = Subset(dataset, range(min(limit, len(dataset))))  # type: ignore[arg-type]
        started = time.monotonic()
        env = DistEnv(ft.rank, ft.rank, ft.world_size, ft.world_size, 0, torch.device("cpu"), "gloo")
        batch_size = max(filled(self.config.batch_size) // self.job_replicas(), 16)
        val_loss = evaluation.mean_loss(
            self.job.module, dataset, env, batch_size=batch_size, batch_loss=self.batch_loss,
            collate_fn=default_collate, autocast=contextlib.nullcontext, sharded=False,
        )  # fmt: skip
        if ft.is_master and step not in self._evaluated:  # a boundary redone after a failure records once here
            self._evaluated.add(step)
            record = {"event": "eval", "step": step, "val_loss": val_loss, "world_size": ft.world_size,
                      "eval_time_s": time.monotonic() - started}  # fmt: skip
            ft.metrics.write(record)
            logger.info("step %d | val %.4f | world %d", step, val_loss, ft.world_size)
        return val_loss

    def job_replicas(self) -> int:
        """The replicas the run starts with: the evaluation's batch is sized by it, as the
        restart path's is by the world size, and stays fixed when the group shrinks."""
        return self._group().env.replicas
