"""`nanoddp train --on-failure continue`: the Trainer, its step driven by `nanoddp.ft`.

The launcher (`nanoddp.train.launcher.cli`) hands the job to `nanoddp.ft.supervisor`, which runs
`python -m nanoddp.train.ft_trainer FLAGS...` (`WORKER_MODULE`) once per replica. Each is a
`FaultTolerantTrainer`: the Trainer of the restart path (torchtitan's shape: a subclass that
overrides start-up and the step, each difference marked `# FT:`), so the job (`recipe.build_job`),
`--resume`, the snapshot writer and its names, the evaluation, the `--on-nan` guards and the
`model.pt` export are the Trainer's own code. What differs, and why:

- the step runs through `FaultTolerant`: the global batch of each step is split over the
  replicas present at that step, the gradients are averaged in rank order (not DDP's buckets: a
  group rebuilt mid-run needs no reducer rebuilt, and the sum is the same on every rank whatever
  the world size), and a lost replica costs the others the step in flight. There is no engine
  over a process group: each replica's model is the module as it is, and zero1/zero2/fsdp shard
  the optimizer (and fsdp the weights) over the group with `OptimizerShards`;
- the loop is `FaultTolerant.steps`: the snapshot (`--snapshot-every`) and the evaluation
  (`--eval-every`) run at the step boundary right after each quorum, on every member of the group
  that runs the next step (a collective over it; a failure inside is a failed step: the group is
  rebuilt and the boundary runs again, the snapshot rewritten with the same contents);
- a joiner takes its state (weights, AdamW's moments, the schedule's position, the step, RNG,
  the run's facts) from a peer, not from a snapshot; a group that holds no state resumes from the
  newest snapshot; every replica steps with the same RNG stream (rank 0's of a snapshot);
- the step records are `FaultTolerant`'s (one per committed step, with the world size it had).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from nanoddp.base.processes import die_with_parent, take_descendants_along
from nanoddp.base.rng import restore_rng_state
from nanoddp.dataclass_cli import add_dataclass_args, config_from_args
from nanoddp.env import DistEnv
from nanoddp.ft import FaultTolerant, OptimizerShards, ReplicaEnv
from nanoddp.ft.stopped import RunStopped, run_replica
from nanoddp.train import step_check
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import TrainConfig, filled, threads_per_rank
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.engines.single import SingleEngine
from nanoddp.train.metrics import MetricsLogger, format_log_line
from nanoddp.train.recipe import build_job
from nanoddp.train.trainer import Trainer

logger = logging.getLogger(__name__)
WORKER_MODULE = "nanoddp.train.ft_trainer"  # what the supervisor runs once per replica
CONTINUE_ENGINES = ("nanoddp", "zero1", "zero2", "fsdp")  # all but nanoddp: `OptimizerShards` stage 1, 2, 3
CPU = torch.device("cpu")


def check_continue(config: TrainConfig) -> None:
    """What `--on-failure continue` covers today; anything else is refused with the way out."""
    if config.engine not in CONTINUE_ENGINES:
        raise ValueError(
            f"--on-failure continue supports --engine {', '.join(CONTINUE_ENGINES)}, got {config.engine!r}; "
            "use one of those, or --on-failure restart"
        )
    unsupported = {
        "grad_accum": config.grad_accum != 1,
        "amp": config.amp != "off",
        "compile": config.compile,
        "trace": config.trace is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        flags = ", ".join("--" + name.replace("_", "-") for name in named)
        raise ValueError(f"--on-failure continue does not support {flags} yet: drop them or use --on-failure restart")


class FaultTolerantTrainer(Trainer):
    """One replica of `nanoddp train --on-failure continue` (see the module docstring)."""

    replica: ReplicaEnv
    """Which replica this process plays, and its attempt (set before `_setup`)."""

    @classmethod
    def for_replica(cls, config: TrainConfig, replica: ReplicaEnv) -> FaultTolerantTrainer:
        """The replica's trainer: `nanoddp train`'s job, resumed per `--resume` unless a joiner."""
        # FT: the plain AdamW over every parameter (zero1's ZeroRedundancyOptimizer is made for one
        # fixed group; here `OptimizerShards` decides which parameters it steps, group after group).
        job = build_job(dataclasses.replace(config, engine="nanoddp"))  # identical weights (init_sync makes sure)
        trainer = cls.__new__(cls)
        trainer._lock_fd, trainer.replica = None, replica  # the launcher holds the run directory
        # FT: no group exists before the first quorum: until then each replica is a world of one
        # (it resolves `--resume` itself); the boundary after each quorum sets the group's.
        env = DistEnv(0, 0, 1, 1, 0, CPU, "gloo")
        datasets = (job.train_set, job.val_set)
        trainer._setup(config, env, job.module, job.optimizer, job.scheduler, datasets, batch_loss_for(None), None)
        return trainer

    def _setup(self, config, env, module, optimizer, scheduler, datasets, batch_loss, collate_fn) -> None:
        # FT: the Trainer's start-up without a process group (the quorum makes it), an engine or
        # a data loader (`FaultTolerant` averages, and picks each step's samples).
        self.env, self.config, self.run_dir = env, config, Path(filled(config.out))
        self.train_set, self.val_set = datasets
        self.micro_batch = filled(config.batch_size) // self.replica.replicas  # sizes the evaluation's batches
        self.threads = threads_per_rank(config, self.replica.replicas)
        torch.set_num_threads(self.threads)
        self.module, self.model, self.optimizer, self.scheduler = module, module, optimizer, scheduler
        self.batch_loss, self.collate_fn = batch_loss, collate_fn or default_collate
        self._tokens_per_sample = getattr(self.train_set, "tokens_per_sample", None)
        # The restart path's sampler, placed where the committed steps are (`_place_sampler`):
        # what a snapshot records of the data's position, read back in either mode.
        self.sampler = ResumableDistributedSampler(self.train_set, 1, 0, shuffle=True, seed=config.seed)
        self.step, self._signum = 0, 0
        self._last_step_finite, self._newest_finite_snapshot = True, None
        self._evaluated: set[int] = set()  # steps this process recorded a validation loss for
        self._history: list[int] = []  # a resumed snapshot's world size per step
        self.shards: OptimizerShards | None = None  # made after the resume, which loads the whole optimizer
        self._whole_optimizer: dict[str, Any] | None = None  # a sharded one's state, gathered for a snapshot
        self.engine = SingleEngine(SingleEngine.name, module, module)  # the model as it is
        self.scaler = torch.amp.GradScaler(CPU.type, enabled=False)  # --amp is refused under continue
        self._step_comm_bytes = 0
        self._metrics = MetricsLogger(self.run_dir)  # written through by the group's rank 0 only
        self.metrics = None
        self.run_id = first_run_id(self.replica, config.out)
        self.resumed_from = None if self.replica.joiner else self._maybe_resume()  # a joiner heals from a peer
        self._start_step = self.step  # the step the run started or resumed at: no boundary work there again
        self.shards = _shards(config, self)
        self.ft = FaultTolerant(
            module,
            optimizer,
            dataset_len=len(self.train_set),
            batch_size=filled(config.batch_size),
            seed=config.seed,
            env=self.replica,
            extra_state=(self._take_facts, self._put_facts),
            tokens_per_sample=self._tokens_per_sample,
            boundary=self._boundary,
            shards=self.shards,
            restore=lambda: self._restore_newest(whole_run=True),  # when nobody holds the state
        )
        if self.resumed_from is not None:
            self.ft.resume_at(self.step, self._history)
            if self.replica.replica == 0:
                self.ft.metrics.truncate_after(self.step)  # the steps after the snapshot are redone and logged again

    # --- start-up seams: the run's id and RNG, a snapshot's history, what a joiner receives ---

    def _fresh_run_id(self) -> str:
        # FT: derived alike by every replica (no group to broadcast over yet)
        return first_run_id(self.replica, self.config.out)

    def _loop_facts(self) -> dict[str, Any]:
        return {"history": list(self.ft.history[: self.step])}  # FT: the world size of every step, for a replay

    def _load_loop_state(self, train: dict[str, Any], saved: list[Any]) -> None:
        # FT: a restart run's snapshot had a fixed world size; every replica steps with rank 0's RNG
        self._history = list(train.get("history") or [int(train["world_size"])] * self.step)
        restore_rng_state(saved[0])

    def _parts(self) -> dict[str, Any]:
        parts = super()._parts()
        if self._whole_optimizer is not None:  # FT: a sharded optimizer is snapshotted whole
            parts["optimizer"] = WholeOptimizer(self._whole_optimizer, self.optimizer)
        return parts

    def _take_facts(self) -> dict[str, Any]:
        """What a joiner receives besides weights, optimizer, step and RNG: the schedule's
        position and the run's facts."""
        facts = {"run_id": self.run_id, "start_step": self._start_step, "last_step_finite": self._last_step_finite,
                 "newest_finite_snapshot": self._newest_finite_snapshot}  # fmt: skip
        return {"scheduler": self.scheduler.state_dict(), "facts": facts}

    def _put_facts(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        facts = state["facts"]
        self.run_id, self._start_step = facts["run_id"], facts["start_step"]
        self._last_step_finite = facts["last_step_finite"]
        self._newest_finite_snapshot = facts["newest_finite_snapshot"]

    def _restore_newest(self, whole_run: bool) -> tuple[int, list[int]] | None:
        """The state back to the run's newest valid snapshot (the Trainer's `_load_snapshot`):
        its (step, history), or None when there is none. `whole_run`: a group in which nobody
        holds the state goes on from it as a resumed run does; else (fsdp's lost weights,
        `OptimizerShards`) only the weights, optimizer, schedule and RNG go back."""
        found = snapshot.find_latest_valid(self.run_dir / "snapshots")
        if found is None:
            return None
        self._load_snapshot(*found)
        if whole_run:
            self._start_step = self.step
            self._last_step_finite = bool(snapshot.train_state(found[1], found[0]).get("loss_finite", True))
            self._evaluated = {done for done in self._evaluated if done <= self.step}  # those past it are redone
        return self.step, list(self._history)

    # --- the loop -----------------------------------------------------------------------------

    def train(self, stop_after: int | None = None) -> dict[str, Any]:
        # FT: the loop is `FaultTolerant.steps` (a failed step comes again; the boundary work runs
        # after each quorum), then the Trainer's export; a stop every member meets is `RunStopped`.
        if stop_after is not None:
            raise ValueError("train(stop_after=) stops with a snapshot; under --on-failure continue set steps instead")
        self.module.train()
        for step in self.ft.steps(self.config.steps):
            self.step = step  # a redone step, or one after a roll-back to a snapshot
            self._run_step(self._piece(step))
        try:
            self._export_final_model()
        except step_check.NonFiniteLoss as exc:
            raise RunStopped(str(exc), self.ft.is_master) from None
        self.ft.close()
        return self.ft.last_record

    def _piece(self, step: int) -> Iterator[Any]:
        """This replica's piece of step `step`'s global batch, as the one micro-batch of the step."""
        yield default_collate([self.train_set[i] for i in self.ft.batch_for(step).tolist()])

    def _run_step(self, batches: Iterator) -> torch.Tensor | None:
        # FT: forward and backward are the Trainer's; the average, the verdict on a non-finite
        # loss and the update are `FaultTolerant`'s (a step that does not commit comes again).
        step = self.step
        loss = self._run_batch(next(batches), sync=True)
        averaged = self.ft.average_gradients(loss) is not None
        nonfinite = self.ft.nonfinite_ranks if averaged else ()  # the same on every member: from the gathered losses
        if nonfinite and self.config.on_nan == "stop":  # before the update: the weights stay the last finite step's
            raise RunStopped(step_check.stop_line(step + 1, nonfinite), self.ft.is_master)
        if averaged and not nonfinite and self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.grad_clip)  # the same on every rank
        if not self.ft.commit(update=not nonfinite):
            return None
        self.scheduler.step()
        self._last_step_finite = not nonfinite
        if nonfinite:
            self._skip_nonfinite(nonfinite)  # --on-nan skip: the Trainer's line and record
        elif self.ft.is_master and (step + 1) % self.config.log_every == 0:
            logger.info("%s | world %d", format_log_line(self.ft.last_record), self.ft.world_size)
        self.step = step + 1
        return None if nonfinite else loss

    def _boundary(self, step: int) -> None:
        """`FaultTolerant(boundary=)`: after each quorum, with `step` committed steps, the
        Trainer's snapshot and evaluation when due (collectives over the group, see above)."""
        ft = self.ft
        self.step = step  # a joiner arrives here healed to its peers' step
        self.env = DistEnv(ft.rank, ft.rank, ft.world_size, ft.world_size, 0, CPU, "gloo")
        self.metrics = self._metrics if ft.is_master else None
        if step <= self._start_step:
            return
        final = step >= self.config.steps
        if final or _every(step, self.config.snapshot_every):
            self._place_sampler()
            # every member gathers (a collective); the snapshot writer asks rank 0's copy only
            self._whole_optimizer = None if self.shards is None else self.shards.whole_state_dict()
            try:
                self._save_snapshot()
            finally:
                self._whole_optimizer = None
            if ft.is_master:
                logger.info("snapshot %s", snapshot.snapshot_path(self.run_dir / "snapshots", step))
        if final or _every(step, self.config.eval_every):
            self._record_eval(step)

    def _place_sampler(self) -> None:
        """The restart path's sampler at the same place in the data: the epoch, and the samples of
        it the committed steps consumed (its order is the same seeded permutation per epoch)."""
        batches = self.ft.batches
        epoch, at = divmod(self.step, batches.steps_per_epoch)
        self.sampler.set_epoch(epoch)
        self.sampler.position = at * batches.batch_size

    def _record_eval(self, step: int) -> None:
        """The Trainer's validation loss; rank 0 logs it and writes `{"event": "eval", "step",
        "val_loss", "world_size", "eval_time_s"}`, once per step (a boundary may be redone)."""
        started = time.monotonic()
        val_loss = self.evaluate()
        if val_loss is None or self.metrics is None or step in self._evaluated:
            return
        self._evaluated.add(step)
        record = {"event": "eval", "step": step, "val_loss": val_loss, "world_size": self.ft.world_size,
                  "eval_time_s": time.monotonic() - started}  # fmt: skip
        self.metrics.write(record)
        logger.info("step %d | val %.4f | world %d", step, val_loss, self.ft.world_size)


class WholeOptimizer:
    """A sharded optimizer as a snapshot keeps it: its whole state_dict (`OptimizerShards.
    whole_state_dict`, gathered on every member); a whole state loads into the plain optimizer."""

    def __init__(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        self.state, self.optimizer = state, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def first_run_id(env: ReplicaEnv, out: str | None) -> str:
    """The run id every first process of a fresh run derives alike (no file, no message)."""
    return hashlib.sha256(f"{env.launcher_pid}:{out}".encode()).hexdigest()[:12]


def newest_optimizer_state(run_dir: Path) -> tuple[int, dict[str, Any]] | None:
    """(step, the optimizer's whole state_dict) of the newest valid snapshot of the run, or None:
    where a sharded optimizer's state lost with its owner comes from (`OptimizerShards`)."""
    found = snapshot.find_latest_valid(run_dir / "snapshots")
    if found is None:
        return None
    path, state = found
    entry = state["objects"].get("optimizer", {})
    if entry.get("kind") != "stateful":  # e.g. a restart run's zero2 snapshot: in per-rank shard files
        logger.warning("%s holds no whole optimizer state to take lost state from", path)
        return None
    return int(snapshot.train_state(state, path)["step"]), entry["state"]


def _shards(config: TrainConfig, trainer: FaultTolerantTrainer) -> OptimizerShards | None:
    """zero1/zero2: the optimizer sharded over the group, a lost shard's state read from the
    newest snapshot; fsdp: the weights too, a lost shard rolls the whole state back to it."""
    stage = {"zero1": 1, "zero2": 2, "fsdp": 3}.get(config.engine)
    if stage is None:
        return None
    name_of = {p: name for name, p in trainer.module.named_parameters()}
    names = [name_of[p] for group in trainer.optimizer.param_groups for p in group["params"]]
    return OptimizerShards(
        trainer.optimizer,
        names,
        stage,
        lambda: newest_optimizer_state(trainer.run_dir),
        lambda: trainer._restore_newest(whole_run=False),
    )


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def start_replica(argv: list[str] | None, module: str) -> tuple[TrainConfig, ReplicaEnv]:
    """What every replica process of a `nanoddp train` job does first (this trainer's, and the
    torchft-DDP loop's of `nanoddp bench restarts`): read the config its launcher passed as flags
    and its place in the run, tie its life to the launcher's, and quiet torchft's per-step logs."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    add_dataclass_args(parser, TrainConfig)  # the launcher passes the config as flags
    config = config_from_args(TrainConfig, parser.parse_args(argv))
    env = ReplicaEnv.from_environ()
    die_with_parent(env.launcher_pid)  # no replica outlives its launcher, even a SIGKILLed one
    take_descendants_along()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # torchft logs every quorum and commit at info, and its structured loggers an empty line each
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return config, env


def main(argv: list[str] | None = None) -> int:
    """One replica: `python -m nanoddp.train.ft_trainer FLAGS...` (`nanoddp train`'s flags); a
    stopped run is one line and `STOPPED_EXIT_CODE` (`nanoddp.ft.stopped`)."""
    return run_replica(lambda: FaultTolerantTrainer.for_replica(*start_replica(argv, WORKER_MODULE)).train())


if __name__ == "__main__":
    sys.exit(main())
