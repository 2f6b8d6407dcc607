"""`nanoddp train --on-failure continue`: the Trainer, with the same engine, its step driven by `nanoddp.ft`.

The launcher (`nanoddp.train.launcher.cli`) hands the job to `nanoddp.ft.supervisor`, which runs
`python -m nanoddp.train.ft_trainer FLAGS...` (`WORKER_MODULE`) once per replica. Each is a
`FaultTolerantTrainer`: the Trainer of the restart path (torchtitan's shape: a subclass that
overrides start-up and the step, each difference marked `# FT:`), so the job (`recipe.build_job`),
the engine (`--engine`: the registry's class, built as the restart path builds it), `--amp`,
`--grad-accum`, `--resume`, the snapshot writer and its names, the evaluation, the `--on-nan`
guards and the `model.pt` export are the Trainer's own code. What differs, and why:

- each replica's default group is its own, made once (`nanoddp.ft.replica_group.own_world`): one
  process, or with `--group-size G` its G members (`nanoddp.ft.replica_members`, forked here
  first); the engine is built over it and never rebuilt, so it shards only inside a replica
  (every replica holds the whole state, and a lost one loses none of it; the start-up line says
  what a replica is);
- the step runs the Trainer's micro-steps on this replica's piece of the step's global batch,
  then the cross phase (`FaultTolerant`): the engine's `cross_replica_grads()` weighted by the
  piece's share and summed in rank order over the group across the replicas, which torchft's
  Manager rebuilds whenever the replicas present change; then `finish_cross_replica()`, and the
  Trainer's clip and update only if the step commits. A lost replica costs the others the step in
  flight; the sum is the same bits whatever the world size, so a run equals a replay of its
  schedule;
- the loop is `FaultTolerant.steps`: the snapshot (`--snapshot-every`, written by the group's
  rank 0: every replica holds the same state) and the evaluation (`--eval-every`, the same rank)
  run at the step boundary right after each quorum;
- a joiner takes its state (the engine's weights and optimizer state as this rank holds them,
  the schedule's position, the GradScaler's, the step, RNG, the run's facts) from a peer, not
  from a snapshot; a group that holds no state resumes from the newest snapshot; every replica
  steps with the same RNG stream (rank 0's of a snapshot);
- the step records are `FaultTolerant`'s (one per committed step, with the world size it had).

`--engine localsgd|diloco` keep their low communication: the loop is `FaultTolerantRounds`
(`nanoddp.ft.rounds`), a quorum per round of `--sync-every` steps, not per step; each replica
steps alone between syncs (`_run_inner_step`), and the sync is a sample-weighted mean over the
replicas present, retried among the survivors if one is lost during it.

`--engine fsdp` shards the model over every process: on one node they are one replica of
`--nproc` processes, whose lost process takes shards that exist nowhere else, so the replaced
group resumes from the newest snapshot (said at start-up); across hosts it is refused
(`ft_checks`), with the way out (`--engine hsdp`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from nanoddp.base.limits import STOP_GRACE_S
from nanoddp.base.rng import restore_rng_state
from nanoddp.comm.api.rank_order import all_reduce_in_rank_order
from nanoddp.dataclass_cli import add_dataclass_args, config_from_args
from nanoddp.env import DistEnv
from nanoddp.ft import FaultTolerant, ReplicaEnv
from nanoddp.ft.global_batches import share
from nanoddp.ft.replica_env import become_replica
from nanoddp.ft.replica_group import own_world
from nanoddp.ft.replica_members import start_members, wait_for_members
from nanoddp.ft.rounds import FaultTolerantRounds
from nanoddp.ft.stopped import RunStopped, run_replica
from nanoddp.parallel.tensors import move_to
from nanoddp.train import step_check
from nanoddp.train.checkpoint import snapshot
from nanoddp.train.config import TrainConfig, filled, threads_per_rank
from nanoddp.train.data.batch_rules import batch_loss_for
from nanoddp.train.data.sampler import ResumableDistributedSampler
from nanoddp.train.engines import prepare_model
from nanoddp.train.ft_checks import LOWCOMM_ENGINES
from nanoddp.train.metrics import MetricsLogger, format_log_line
from nanoddp.train.recipe import build_job
from nanoddp.train.trainer import Trainer

logger = logging.getLogger(__name__)
WORKER_MODULE = "nanoddp.train.ft_trainer"  # what the supervisor runs once per replica
MEMBER_GONE_S = 2.0  # how long a failed group's rank 0 waits to learn that a member died first


class FaultTolerantTrainer(Trainer):
    """One replica of `nanoddp train --on-failure continue` (see the module docstring)."""

    replica: ReplicaEnv
    """Which replica this process plays, and its attempt (set before `_setup`)."""

    @classmethod
    def for_replica(cls, config: TrainConfig, replica: ReplicaEnv) -> FaultTolerantTrainer:
        """The replica's trainer: `nanoddp train`'s job, resumed per `--resume` unless a joiner."""
        # FT: the replica's own default group first (one process, or its --group-size members,
        # forked here): zero1's optimizer and every engine are built over it, as the restart path
        # builds them over torchrun's world.
        replica = start_members(replica, config.group_size or 1)
        own_world(replica)
        job = build_job(config, replica.device)  # identical weights on every replica (init_sync makes sure)
        trainer = cls.__new__(cls)
        trainer._lock_fd, trainer.replica = None, replica  # the launcher holds the run directory
        group_rank, group_size = replica.group_rank, replica.group_size
        env = DistEnv(group_rank, group_rank, group_size, group_size, 0, replica.device, replica.backend)
        datasets = (job.train_set, job.val_set)
        trainer._setup(config, env, job.module, job.optimizer, job.scheduler, datasets, batch_loss_for(None), None)
        return trainer

    def _setup(self, config, env, module, optimizer, scheduler, datasets, batch_loss, collate_fn) -> None:
        # FT: the Trainer's start-up without a data loader (`FaultTolerant` picks each step's
        # samples) and with the engine in its cross-replica form.
        self.env, self.config, self.run_dir = env, config, Path(filled(config.out))
        self.train_set, self.val_set = datasets
        processes = self.replica.replicas * env.world_size
        self.micro_batch = filled(config.batch_size) // (processes * config.grad_accum)  # sizes the evaluation's
        self.threads = threads_per_rank(config, processes)
        torch.set_num_threads(self.threads)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.batch_loss, self.collate_fn = batch_loss, collate_fn or default_collate
        self._tokens_per_sample = getattr(self.train_set, "tokens_per_sample", None)
        # The restart path's sampler, placed where the committed steps are (`_place_sampler`):
        # what a snapshot records of the data's position, read back in either mode.
        self.sampler = ResumableDistributedSampler(self.train_set, 1, 0, shuffle=True, seed=config.seed)
        self.step, self._signum = 0, 0
        self._last_step_finite, self._newest_finite_snapshot = True, None
        self._evaluated: set[int] = set()  # steps this process recorded a validation loss for
        self._history: list[int] = []  # a resumed snapshot's world size per step
        self._generation = 0  # the group across the replicas last seen at a boundary
        prepare_model(config, module, optimizer, env)  # hsdp: shard now, over this replica's own group
        self._build_engine(optimizer)
        self.engine.use_cross_replica()  # FT: the engine leaves the sum across replicas to the step
        self.model = self.engine.model
        self._step_comm_bytes = 0
        self._metrics = MetricsLogger(self.run_dir)  # written through by the group's rank 0 only
        self.metrics = None
        self.run_id = first_run_id(self.replica, config.out)
        self.resumed_from = None if self.replica.joiner else self._maybe_resume()  # a joiner heals from a peer
        self._start_step = self.step  # the step the run started or resumed at: no boundary work there again
        self.rounds = config.engine in LOWCOMM_ENGINES  # a quorum per round, not per step (`nanoddp.ft.rounds`)
        kind = FaultTolerantRounds if self.rounds else FaultTolerant
        self.ft = kind(
            self.module,
            self.optimizer,
            dataset_len=len(self.train_set),
            batch_size=filled(config.batch_size),
            seed=config.seed,
            env=self.replica,
            extra_state=(self._take_facts, self._put_facts),
            tokens_per_sample=self._tokens_per_sample,
            boundary=self._boundary,
            restore=self._restore_newest,  # when nobody holds the state
        )
        if self.resumed_from is not None:
            self.ft.resume_at(self.step, self._history)
            if self.replica.replica == 0 and env.is_master:
                self.ft.metrics.truncate_after(self.step)  # the steps after the snapshot are redone and logged again
        if self.replica.replica == 0 and env.is_master and not self.replica.joiner:
            logger.info("%s", engine_line(config.engine, self.engine, env.world_size, env.backend))

    @property
    def is_master(self) -> bool:
        return self.ft.is_master  # FT: the first replica's rank 0 writes the run's files

    @property
    def world_size(self) -> int:
        return self.ft.world_size  # FT: the replicas present at this step

    def _group_across(self) -> dist.ProcessGroup:
        return self.ft.group  # FT: the evaluation is split over the replicas present

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

    def _take_facts(self) -> dict[str, Any]:
        """What a joiner receives besides weights, optimizer, step and RNG: the schedule's
        position and the run's facts."""
        facts = {"run_id": self.run_id, "start_step": self._start_step, "last_step_finite": self._last_step_finite,
                 "newest_finite_snapshot": self._newest_finite_snapshot}  # fmt: skip
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "facts": facts}

    def _put_facts(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # fp16: the loss scale and its growth tracker (disabled: an empty dict)
            self.scaler.load_state_dict(state["scaler"])
        facts = state["facts"]
        self.run_id, self._start_step = facts["run_id"], facts["start_step"]
        self._last_step_finite = facts["last_step_finite"]
        self._newest_finite_snapshot = facts["newest_finite_snapshot"]

    def _restore_newest(self) -> tuple[int, list[int]] | None:
        """`FaultTolerant(restore=)`: a group in which nobody holds the state goes on from the
        run's newest valid snapshot (the Trainer's `_load_snapshot`), as a resumed run does;
        returns its (step, history), or None when there is none."""
        found = snapshot.find_latest_valid(self.run_dir / "snapshots")
        if found is None:
            return None
        self._load_snapshot(*found)
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
            self.step = step  # a redone step, or one after a resume from a snapshot
            self._run_step(self._micro_batches(step))
        try:
            self._export_final_model()
        except step_check.NonFiniteLoss as exc:
            raise RunStopped(str(exc), self.ft.is_master) from None
        self.ft.close()
        return self.ft.last_record

    def _micro_batches(self, step: int) -> Iterator[tuple[Any, float]]:
        """This process's micro-batches of step `step`: its replica's piece of the global batch
        cut into `--group-size` x `--grad-accum` contiguous micro-batches (`share`), member g taking
        the g-th run of `--grad-accum`, each with its weight: its size over the mean micro-batch's,
        so that the replica's gradient, averaged over its members by the engine, is the piece's
        mean (every weight exactly 1 when they are of one size)."""
        piece, count = self.ft.replica_piece(step), self.config.grad_accum
        units, first = self.env.world_size * count, self.env.rank * count
        for micro in range(first, first + count):
            indices = piece[share(len(piece), micro, units)]
            batch = move_to(default_collate([self.train_set[i] for i in indices.tolist()]), self.env.device)
            yield batch, len(indices) * units / len(piece)

    def _piece_loss(self, micro_batches: list) -> torch.Tensor:
        """Forward and backward over this process's micro-batches (the Trainer's micro-steps, the
        engine's own sync on the last); returns the replica's piece's mean loss (its members'
        means averaged, summed in rank order: the same bits on every member)."""
        loss = torch.zeros((), device=self.env.device)
        for micro, (batch, weight) in enumerate(micro_batches):
            loss += self._run_batch(batch, sync=micro == len(micro_batches) - 1, weight=weight) * weight
        loss /= len(micro_batches)
        if self.env.world_size > 1:
            all_reduce_in_rank_order(loss.view(1), None)
            loss /= self.env.world_size
        return loss

    def _run_step(self, batches: Iterator) -> torch.Tensor | None:
        # FT: forward and backward are the Trainer's (its micro-steps, the engine's own sync); then
        # the cross phase over the replicas and the verdict on a non-finite loss (`FaultTolerant`),
        # and the Trainer's clip and update only if the step commits (one that does not comes again).
        if self.rounds:
            return self._run_inner_step(list(batches))
        step, loss = self.step, self._piece_loss(list(batches))
        averaged = self.ft.average_gradients(loss, self.engine.cross_replica_grads()) is not None
        if averaged:
            self.engine.finish_cross_replica()
        nonfinite = self.ft.nonfinite_ranks if averaged else ()  # the same on every member: from the summed losses
        if nonfinite and self.config.on_nan == "stop":  # before the update: the weights stay the last finite step's
            raise RunStopped(step_check.stop_line(step + 1, nonfinite), self.ft.is_master)
        committed = self.ft.commit(update=not nonfinite, apply=self._apply_update)
        self.engine.end_step()
        if not committed:
            return None
        self.scheduler.step()
        self._last_step_finite = not nonfinite
        if nonfinite:
            self._skip_nonfinite(nonfinite)  # --on-nan skip: the Trainer's line and record
        elif self.ft.is_master and (step + 1) % self.config.log_every == 0:
            logger.info("%s | world %d", format_log_line(self.ft.last_record), self.ft.world_size)
        self.step = step + 1
        return None if nonfinite else loss

    def _run_inner_step(self, micro_batches: list) -> torch.Tensor | None:
        """localsgd/diloco: this replica's inner step on its piece, alone (the restart path's
        micro-steps, clip and update: the wrapper is held, so it does not sync), then
        `FaultTolerantRounds.end_step`, which syncs the replicas present when one is due. A
        non-finite loss is this replica's alone: `--on-nan skip` skips its update (a line here; the
        next sync record counts it), `--on-nan stop` stops it (the others go on)."""
        ft, step = self.ft, self.step
        assert isinstance(ft, FaultTolerantRounds)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._piece_loss(micro_batches)
        finite = bool(loss.isfinite())
        if not finite and self.config.on_nan == "stop":  # this replica's own verdict: it says the line
            raise RunStopped(step_check.stop_line(step + 1, (ft.rank,)), speaker=True)
        if finite:
            self._apply_update()
        else:  # --on-nan skip: this replica's line; its sync facts count the step for the record
            logger.warning("%s", step_check.skip_line(step + 1, (ft.rank,), "this replica alone (the others go on)"))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.engine.end_step()
        self._last_step_finite = finite
        ft.end_step(float(loss), len(ft.batch_for(step)), self.config.steps)
        if ft.is_master and (step + 1) % self.config.log_every == 0:
            logger.info("%s | world %d", format_log_line(ft.last_record), ft.world_size)
        self.step = step + 1
        return loss if finite else None

    def _boundary(self, step: int) -> None:
        """`FaultTolerant(boundary=)`: after each quorum, with `step` committed steps, the
        Trainer's snapshot, written by the group's rank 0 alone (every replica holds the same
        state; the others go on to the step and wait for it there), and evaluation, split over the
        group (a collective: a failure in it is a failed step), when due."""
        ft = self.ft
        self.step = step  # a joiner arrives here healed to its peers' step
        self.metrics = self._metrics if self.is_master else None
        if ft.world.generation != self._generation:  # a new group: some rank may have been healed
            self._generation = ft.world.generation
            self.engine.weights_replaced()
        if step <= self._start_step:
            return
        final = step >= self.config.steps
        if final or _every(step, self.config.snapshot_every):
            self._place_sampler()
            if ft.first_replica:  # every member of it: a sharded replica's snapshot is a collective
                self._save_snapshot()
                if self.is_master:
                    logger.info("snapshot %s", snapshot.snapshot_path(self.run_dir / "snapshots", step))
            elif self._last_step_finite:  # what the writer keeps from pruning, should this replica write next
                self._newest_finite_snapshot = step
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
        with self.ft.world.guarded():  # over the replicas: on nccl aborted past the timeout
            val_loss = self.evaluate()
        if val_loss is None or self.metrics is None or step in self._evaluated:
            return
        self._evaluated.add(step)
        record = {"event": "eval", "step": step, "val_loss": val_loss, "world_size": self.ft.world_size,
                  "eval_time_s": time.monotonic() - started}  # fmt: skip
        self.metrics.write(record)
        logger.info("step %d | val %.4f | world %d", step, val_loss, self.ft.world_size)


def first_run_id(env: ReplicaEnv, out: str | None) -> str:
    """The run id every first process of a fresh run derives alike, on every host (no file, no
    message): from the run's quorum service, whose address all replicas share (on one node a port
    of the OS's choice, new each launch; across hosts the endpoint), and `--out`."""
    return hashlib.sha256(f"{env.lighthouse}:{out}".encode()).hexdigest()[:12]


def engine_line(name: str, engine: Any, group_size: int = 1, backend: str = "gloo") -> str:
    """The start-up line that names the engine a continue run trains with (the registry's class,
    as under restart), what a replica is and its groups' backend (`ReplicaEnv.backend`),
    and for zero1/zero2 what that means for their shards."""
    kind = type(engine)
    replica = "one process per replica" if group_size == 1 else f"replica groups of {group_size} processes"
    replica += f" over {backend}"
    line = f"--on-failure continue: engine {name} ({kind.__module__}.{kind.__qualname__}), {replica}"
    if name == "fsdp":
        line += (
            f"; fsdp shards the model over all {group_size} processes of the one replica: a lost process takes "
            "shards that exist nowhere else, so the run goes back to the newest snapshot (--engine hsdp keeps "
            "a whole copy in every replica group)"
        )
    if name in ("zero1", "zero2"):
        line += (
            f"; {name} shards nothing across replicas: each replica holds the whole optimizer state"
            if group_size == 1
            else f"; {name} shards over each group's {group_size} processes, and every group holds a whole copy"
        )
    return line


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
    become_replica(env)  # named, and no replica outlives its launcher, even a SIGKILLed one
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # torchft logs every quorum and commit at info, and its structured loggers an empty line each
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return config, env


def main(argv: list[str] | None = None) -> int:
    """One replica: `python -m nanoddp.train.ft_trainer FLAGS...` (`nanoddp train`'s flags); a
    stopped run is one line and `STOPPED_EXIT_CODE` (`nanoddp.ft.stopped`)."""
    try:
        code = run_replica(lambda: FaultTolerantTrainer.for_replica(*start_replica(argv, WORKER_MODULE)).train())
    except BaseException:
        # A member lost under a collective of the group fails it here first: its watch says so in
        # one line (and ends this process) once it has seen the member gone.
        wait_for_members(MEMBER_GONE_S)
        raise
    wait_for_members(STOP_GRACE_S)  # a replica group's rank 0 ends after its members
    return code


if __name__ == "__main__":
    sys.exit(main())
